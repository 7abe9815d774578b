"""Parameters at the prepared Marlin shapes, filled from the shards byte for byte."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import current_platform

from mxfp4conv.vllm_plugin.shards import MarlinReadyMismatch, TensorInfo

DTYPES = {"I32": torch.int32, "F8_E8M0": torch.float8_e8m0fnu, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32,
          "BF16": torch.bfloat16, "F16": torch.float16}


def torch_dtype(info: TensorInfo, name: str) -> torch.dtype:
    if info.dtype not in DTYPES:
        raise MarlinReadyMismatch(f"{name}: dtype {info.dtype} is not a Marlin-ready dtype")
    return DTYPES[info.dtype]


class Slot:
    """Where one checkpoint tensor goes: a parameter, or a slice of it along its last dimension."""

    def __init__(self, param: torch.nn.Parameter, name: str, info: TensorInfo,
                 columns: slice | None = None, on_load: Callable[[torch.Tensor], None] | None = None,
                 view: Callable[[], torch.Tensor] | None = None) -> None:
        self.param = param
        self.name = name
        self.info = info
        self.columns = columns
        self.on_load = on_load
        self._view = view
        self.loaded = False

    def view(self) -> torch.Tensor:
        """The bytes this tensor was loaded into, as the layer holds them now."""
        if self._view is not None:
            return self._view()
        return self.param.data if self.columns is None else self.param.data[..., self.columns]

    def load(self, tensor: torch.Tensor) -> None:
        want = torch_dtype(self.info, self.name)
        if tensor.dtype != want or tuple(tensor.shape) != self.info.shape:
            raise MarlinReadyMismatch(f"{self.name}: got {tensor.dtype} {tuple(tensor.shape)}, the layer was allocated "
                                      f"for {want} {self.info.shape}")
        if self.loaded:
            raise MarlinReadyMismatch(f"{self.name}: appears twice in the shards")
        if self.on_load is not None:
            self.on_load(tensor)
        else:
            dst = self.view()
            if dst.shape != tensor.shape:
                raise MarlinReadyMismatch(f"{self.name}: shape {tuple(tensor.shape)} does not fill the parameter's "
                                          f"{tuple(dst.shape)}")
            if tensor.element_size() == 1:  # fp8 / e8m0 bytes: copied as bytes, never converted
                dst.view(torch.uint8).copy_(tensor.view(torch.uint8))
            else:
                dst.copy_(tensor)
        self.loaded = True


def _refuse(name: str) -> Callable[..., Any]:
    def weight_loader(*_: Any, **__: Any) -> None:
        raise MarlinReadyMismatch(f"{name}: the model's own weight loader was handed a Marlin-ready tensor (it would "
                                  "slice or convert it); serve with --load-format auto or safetensors")
    return weight_loader


def allocate(layer: torch.nn.Module, leaf: str, info: TensorInfo, name: str, shape: tuple[int, ...] | None = None
             ) -> torch.nn.Parameter:
    """An uninitialized parameter of the shard's dtype (every byte is then loaded from the shard)."""
    param = torch.nn.Parameter(torch.empty(shape or info.shape, dtype=torch_dtype(info, name)), requires_grad=False)
    layer.register_parameter(leaf, param)
    set_weight_attrs(param, {"weight_loader": _refuse(name)})
    return param


def check_all_loaded(slots: Iterable[Slot]) -> None:
    missing = [s.name for s in slots if not s.loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MarlinReadyMismatch(f"{missing[0]}{more}: not loaded from the Marlin-ready shards")


def refuse_on_cpu(module: str) -> None:
    if not current_platform.is_cuda():
        raise MarlinReadyMismatch(f"{module}: Marlin-ready layers run on vLLM's CUDA Marlin kernels; this platform is "
                                  f"{current_platform.device_type}")
