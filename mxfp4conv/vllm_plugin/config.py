"""The ``mxfp4conv_marlin`` quantization method: which layers hold Marlin-ready tensors, and checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from mxfp4conv.vllm_plugin import NAME
from mxfp4conv.vllm_plugin.shards import (
    MarlinReadyMismatch,
    RankShards,
    Server,
    check_server,
    read_rank_folder,
)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class MarlinReadyConfig(QuantizationConfig):
    """Checkpoint config with ``mxfp4conv_marlin``: FP4 layers load Marlin-ready tensors as they are."""

    def __init__(self, marker: dict[str, Any], base: dict[str, Any]) -> None:
        super().__init__()
        self.marker = marker
        self.base = base
        self.model_path: Path | None = None
        self.shards: RankShards | None = None
        self.rename: Any = None  # the model's hf -> vLLM rename mapper (WeightsMapper)
        self._checked = False
        self._vllm_modules: dict[str, list[tuple[int, str]]] | None = None
        self._native: QuantizationConfig | None = None

    # ---- what vLLM asks of every quantization config ------------------------------------------

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return list(_DTYPES)  # the shards' params dtype is checked against the server's, with its own message

    @classmethod
    def get_min_capability(cls) -> int:
        return 75  # Marlin's FP4 kernels (sm75+)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MarlinReadyConfig:
        return cls(dict(config[NAME]), config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Any, hf_config: Any = None,
                                     **_: Any) -> str | None:
        if not (isinstance(hf_quant_cfg, dict) and NAME in hf_quant_cfg):
            return None
        if user_quant not in (None, NAME):
            raise MarlinReadyMismatch(f"--quantization {user_quant} was given, but this checkpoint holds Marlin-ready "
                                      f"shards (quantization method {NAME}): drop --quantization")
        return NAME

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        folder = Path(model_name)
        if not folder.is_dir():
            raise MarlinReadyMismatch(f"{model_name}: Marlin-ready shards are served from a local rank-N folder")
        self.model_path = folder

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        self.rename = hf_to_vllm_mapper

    # ---- layers ----------------------------------------------------------------------------------

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        self.check_once()
        if isinstance(layer, RoutedExperts):
            parts = self.vllm_modules().get(prefix)
            if not parts:
                return None
            from mxfp4conv.vllm_plugin.moe import MarlinReadyMoEMethod

            return MarlinReadyMoEMethod(layer.moe_config, self, parts[0][1])
        if isinstance(layer, LinearBase):
            parts = self.vllm_modules().get(prefix)
            if not parts:
                native = self.native()
                return UnquantizedLinearMethod() if native is None else native.get_quant_method(layer, prefix)
            from mxfp4conv.vllm_plugin.linear import MarlinReadyLinearMethod

            return MarlinReadyLinearMethod(self, prefix, sorted(parts))
        native = self.native()  # Attention layers: the KV-cache scheme, as the runtime-native config says
        return None if native is None else native.get_quant_method(layer, prefix)

    def native(self) -> QuantizationConfig | None:
        """The compressed-tensors config each rank carries beside the marker: it describes every layer that is
        not Marlin-ready (FP8 Linears, unquantized Linears, the KV cache), which vLLM's own methods load.
        None for GPT-OSS ranks, whose native config declares nothing but the experts."""
        if self._native is None and self.base.get("quant_method") == "compressed-tensors":
            from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
                CompressedTensorsConfig,
            )

            native = CompressedTensorsConfig.from_config({k: v for k, v in self.base.items() if k != NAME})
            native.packed_modules_mapping = self.packed_modules_mapping
            if self.rename is not None:
                native.apply_vllm_mapper(self.rename)
            self._native = native
        return self._native

    def vllm_modules(self) -> dict[str, list[tuple[int, str]]]:
        """vLLM module name -> [(shard index in a packed module, checkpoint module)] of every Marlin module."""
        if self._vllm_modules is None:
            shards = self.require_shards()
            out: dict[str, list[tuple[int, str]]] = {}
            for module in [*shards.moe, *shards.dense]:
                name, index = self.to_vllm(module)
                out.setdefault(name, []).append((index, module))
            self._vllm_modules = out
        return self._vllm_modules

    def to_vllm(self, module: str) -> tuple[str, int]:
        """A checkpoint module name as vLLM names it: the model's renames, then packed modules (qkv_proj...)."""
        name = module
        if self.rename is not None:
            mapped = self.rename.map_name(module + ".weight")
            if mapped is not None:
                name = mapped.removesuffix(".weight")
        parent, _, leaf = name.rpartition(".")
        for fused, members in (self.packed_modules_mapping or {}).items():
            if leaf in members:
                return f"{parent}.{fused}" if parent else fused, list(members).index(leaf)
        return name, 0

    def require_shards(self) -> RankShards:
        """This TP rank's shards: ``vllm serve DST/rank-0`` makes rank r read ``DST/rank-r``."""
        if self.shards is None:
            if self.model_path is None:
                raise MarlinReadyMismatch("the Marlin-ready shards were not found (vLLM did not call maybe_update_config)")
            self.shards = read_rank_folder(rank_folder(self.model_path, current_server().tp_rank))
        return self.shards

    def check_once(self) -> RankShards:
        shards = self.require_shards()
        if not self._checked:
            if why := check_server(shards, current_server()):
                raise MarlinReadyMismatch(why)
            self._checked = True
        return shards


def rank_folder(served: Path, tp_rank: int) -> Path:
    """The sibling ``rank-<tp_rank>`` of a served ``rank-N`` folder when there is one, else the folder itself."""
    if served.name.startswith("rank-") and served.name[5:].isdigit():
        sibling = served.parent / f"rank-{tp_rank}"
        if sibling.is_dir():
            return sibling
    return served


def current_server() -> Server:
    """The running server's settings that Marlin-ready shards depend on."""
    from vllm import envs
    from vllm.config import get_current_vllm_config
    from vllm.distributed import parallel_state

    cfg = get_current_vllm_config()
    act = (envs.VLLM_MARLIN_INPUT_DTYPE or "bf16").lower()
    kernel = getattr(cfg, "kernel_config", None)
    return Server(
        params_dtype=_DTYPES.get(cfg.model_config.dtype, str(cfg.model_config.dtype)),
        act_dtype={"bf16": "bf16", "fp8": "fp8_e4m3"}.get(act, act),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        expert_parallel=bool(cfg.parallel_config.enable_expert_parallel),
        moe_backend=str(getattr(kernel, "moe_backend", "auto") or "auto"),
    )


def register() -> None:
    register_quantization_config(NAME)(MarlinReadyConfig)
