"""FP4 Linear layers already in Marlin's layout (MARLIN.md §4 dense): allocate, hold, run Marlin's GEMM.

A packed vLLM layer (``qkv_proj``, ``gate_up_proj``) holds its checkpoint modules side by side along
N: Marlin tiles N in blocks of 64 columns, so the per-module tensors concatenate exactly when no
module was padded. A padded member of a packed layer is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase

from mxfp4conv.vllm_plugin.params import Slot, allocate, check_all_loaded, refuse_on_cpu, torch_dtype
from mxfp4conv.vllm_plugin.shards import MarlinReadyMismatch, TensorInfo

if TYPE_CHECKING:
    from mxfp4conv.vllm_plugin.config import MarlinReadyConfig


class MarlinReadyLinearMethod(LinearMethodBase):
    """One vLLM Linear layer made of one or more Marlin-ready checkpoint modules."""

    def __init__(self, cfg: MarlinReadyConfig, prefix: str, parts: list[tuple[int, str]]) -> None:
        self.cfg = cfg
        self.prefix = prefix
        self.parts = [m for _, m in parts]
        self.slots: dict[str, Slot] = {}

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra: Any) -> None:
        dense = self.cfg.require_shards().dense
        infos = [dense[m] for m in self.parts]
        if len(infos) != len(output_partition_sizes):
            raise MarlinReadyMismatch(f"{self.prefix}: {len(infos)} of its {len(output_partition_sizes)} packed modules "
                                      "are Marlin-ready FP4; all or none must be")
        k16 = {i["weight"].shape[0] for i in infos}
        if len(k16) != 1 or 16 * k16.pop() < input_size_per_partition:
            raise MarlinReadyMismatch(f"{self.prefix}: the shards' K per rank does not fit this layer's "
                                      f"{input_size_per_partition}")
        widths = [i["weight_scale"].shape[1] for i in infos]
        for m, n, np_ in zip(self.parts, output_partition_sizes, widths, strict=True):
            if np_ < n or (len(infos) > 1 and np_ != n):
                raise MarlinReadyMismatch(f"{m}: {np_} Marlin columns for {n} outputs per rank; a packed layer needs "
                                          "each member unpadded (N a multiple of 64)")
        layer.params_dtype = params_dtype
        total = sum(widths)
        first = infos[0]
        w = allocate(layer, "weight", first["weight"], f"{self.parts[0]}.weight",
                     shape=(first["weight"].shape[0], 2 * total))
        s = allocate(layer, "weight_scale", first["weight_scale"], f"{self.parts[0]}.weight_scale",
                     shape=(first["weight_scale"].shape[0], total))
        g = None
        if "weight_global_scale" in first:
            g = allocate(layer, "weight_global_scale", first["weight_global_scale"],
                         f"{self.parts[0]}.weight_global_scale")
        start = 0
        for m, info, n in zip(self.parts, infos, widths, strict=True):
            self._slot(Slot(w, f"{m}.weight", info["weight"], slice(2 * start, 2 * (start + n))))
            self._slot(Slot(s, f"{m}.weight_scale", info["weight_scale"], slice(start, start + n)))
            if g is not None:
                self._slot(Slot(g, f"{m}.weight_global_scale", info["weight_global_scale"],
                                on_load=self._global_loader(g, m)))
            if "bias" in info:
                cols = slice(start, start + n)
                self._slot(Slot(w, f"{m}.bias", info["bias"], on_load=self._bias_loader(layer, m, info["bias"], cols, total),
                                view=_bias_view(layer, cols)))
            start += n

    def _slot(self, slot: Slot) -> None:
        self.slots[slot.name] = slot

    def _global_loader(self, param: torch.nn.Parameter, module: str) -> Any:
        """A Marlin layer holds one NVFP4 global scale: packed members must agree on it."""
        def load(t: torch.Tensor) -> None:
            seen = [s for s in self.slots.values() if s.param is param and s.loaded]
            if seen and not torch.equal(param.data, t.to(param.device)):
                raise MarlinReadyMismatch(f"{module}.weight_global_scale differs from {seen[0].name}, but the packed "
                                          f"layer {self.prefix} holds one global scale")
            param.data.copy_(t)
        return load

    def _bias_loader(self, layer: Any, module: str, info: TensorInfo, cols: slice, total: int) -> Any:
        """The layer allocates its bias itself (logical N, params dtype); the shards' is Marlin-permuted."""
        def load(t: torch.Tensor) -> None:
            bias = getattr(layer, "bias", None)
            if bias is None:
                raise MarlinReadyMismatch(f"{module}.bias: the shards hold a bias, the vLLM layer has none")
            dtype = torch_dtype(info, f"{module}.bias")
            if tuple(bias.shape) != (total,) or bias.dtype != dtype:
                layer.bias = torch.nn.Parameter(torch.empty(total, dtype=dtype, device=bias.device), requires_grad=False)
            layer.bias.data[cols].copy_(t)
        return load

    def targets(self, layer: Any) -> dict[str, Slot]:
        return self.slots

    def process_weights_after_loading(self, layer: Any) -> None:
        check_all_loaded(self.slots.values())
        if getattr(layer, "bias", None) is not None and not any(n.endswith(".bias") for n in self.slots):
            raise MarlinReadyMismatch(f"{self.prefix}: the layer has a bias, the Marlin-ready shards hold none")
        refuse_on_cpu(self.prefix)
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new

        layer.workspace = marlin_make_workspace_new(layer.weight.device)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import get_marlin_input_dtype
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import apply_fp4_marlin_linear

        return apply_fp4_marlin_linear(
            input=x, weight=layer.weight, weight_scale=layer.weight_scale,
            weight_global_scale=getattr(layer, "weight_global_scale", None), workspace=layer.workspace,
            size_n=layer.output_size_per_partition, size_k=layer.input_size_per_partition, bias=bias,
            input_dtype=get_marlin_input_dtype(self.prefix))


def _bias_view(layer: Any, cols: slice) -> Callable[[], torch.Tensor]:
    def view() -> torch.Tensor:
        return layer.bias.data[cols]
    return view
