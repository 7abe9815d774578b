"""FusedMoE layers whose experts are already in Marlin's layout: allocate, hold, run vLLM's MarlinExperts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts

from mxfp4conv.vllm_plugin.params import Slot, allocate, check_all_loaded, refuse_on_cpu
from mxfp4conv.vllm_plugin.shards import MarlinReadyMismatch

if TYPE_CHECKING:
    from mxfp4conv.vllm_plugin.config import MarlinReadyConfig

# GPT-OSS's gated activation, as vLLM's GPT-OSS MXFP4 method passes it to every backend
_GPT_OSS_SWIGLU = {"gemm1_alpha": 1.702, "gemm1_beta": 1.0, "swiglu_limit": 7.0}


class MarlinReadyMoEMethod(FusedMoEMethodBase):
    """Experts of one FusedMoE layer, loaded from a rank's Marlin-ready tensors without a repack."""

    def __init__(self, moe: Any, cfg: MarlinReadyConfig, module: str) -> None:
        super().__init__(moe)
        self.cfg = cfg
        self.module = module  # the experts' checkpoint module (``model.layers.N.mlp.experts``)
        shards = cfg.require_shards()
        self.infos = shards.moe[module]
        self.quant = shards.quant
        self.interleaved = shards.meta.get("mxfp4conv.w13_order") == "interleaved"
        self.experts_cls = MarlinExperts
        self.slots: dict[str, Slot] = {}
        par = moe.moe_parallel_config
        if par.use_ep:
            raise MarlinReadyMismatch(f"{module}: expert parallelism is on, but Marlin-ready experts are split by TP rank")
        if (par.tp_size, par.tp_rank) != (shards.tp_size, shards.tp_rank):
            raise MarlinReadyMismatch(f"{module}: the MoE layer runs as TP rank {par.tp_rank} of {par.tp_size}, the shards "
                                      f"were written for rank {shards.tp_rank} of {shards.tp_size}")
        if str(getattr(moe, "moe_backend", "auto")) not in ("auto", "marlin"):
            raise MarlinReadyMismatch(f"{module}: MoE backend {moe.moe_backend!r} is forced, but the experts are in "
                                      "Marlin's layout (use --moe-backend marlin or auto)")

    # ---- sizes and parameters --------------------------------------------------------------------

    def padded_sizes(self) -> tuple[int, int]:
        """(Hp, Ip) of the shards: w2_weight is int32 ``[E, Ip/16, 2*Hp]``."""
        _, ip16, hp2 = self.infos["w2_weight"].shape
        return hp2 // 2, ip16 * 16

    def maybe_roundup_sizes(self, hidden_size: int, intermediate_size_per_partition: int, act_dtype: torch.dtype,
                            moe_parallel_config: Any) -> tuple[int, int]:
        hp, ip = self.padded_sizes()
        if hp < hidden_size or ip < intermediate_size_per_partition:
            raise MarlinReadyMismatch(f"{self.module}: the shards hold H={hp}, I/tp={ip}, the model needs "
                                      f"H={hidden_size}, I/tp={intermediate_size_per_partition}")
        return hp, ip

    def create_weights(self, layer: Any, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any) -> None:
        e = self.infos["w13_weight"].shape[0]
        if e != num_experts:
            raise MarlinReadyMismatch(f"{self.module}: the shards hold {e} experts per rank, the layer {num_experts}")
        if self.moe.has_bias != ("w13_bias" in self.infos):
            raise MarlinReadyMismatch(f"{self.module}: the layer {'has' if self.moe.has_bias else 'has no'} expert "
                                      "biases, the shards disagree")
        layer.params_dtype = params_dtype
        layer.num_experts = num_experts
        for leaf, info in sorted(self.infos.items()):
            param = allocate(layer, leaf, info, f"{self.module}.{leaf}")
            self.slots[f"{self.module}.{leaf}"] = Slot(param, f"{self.module}.{leaf}", info)

    def targets(self, layer: Any) -> dict[str, Slot]:
        return self.slots

    # ---- after loading: the kernel vLLM itself builds for Marlin FP4 experts ---------------------

    def process_weights_after_loading(self, layer: Any) -> None:
        check_all_loaded(self.slots.values())
        refuse_on_cpu(self.module)
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        routing = layer._expert_routing_tables() if hasattr(layer, "_expert_routing_tables") else None
        if self.quant == "nvfp4":
            from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (
                NvFp4MoeBackend,
                make_nvfp4_moe_kernel,
            )

            self.moe_kernel = make_nvfp4_moe_kernel(self.moe_quant_config, self.moe, MarlinExperts,
                                                    NvFp4MoeBackend.MARLIN, routing_tables=routing)
        else:
            from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
                Mxfp4MoeBackend,
                make_mxfp4_moe_kernel,
            )

            self.moe_kernel = make_mxfp4_moe_kernel(self.moe_quant_config, self.moe, MarlinExperts,
                                                    Mxfp4MoeBackend.MARLIN, routing_tables=routing)
        self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    def get_fused_moe_quant_config(self, layer: Any) -> Any:
        limit = getattr(layer, "swiglu_limit", None)
        if self.quant == "nvfp4":
            from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (
                NvFp4MoeBackend,
                make_nvfp4_moe_quant_config,
            )

            return make_nvfp4_moe_quant_config(
                NvFp4MoeBackend.MARLIN, layer.w13_weight_scale, layer.w2_weight_scale, layer.w13_weight_scale_2,
                layer.w2_weight_scale_2, None, None, swiglu_limit=limit,
                swiglu_alpha=getattr(layer, "swiglu_alpha", None), swiglu_beta=getattr(layer, "swiglu_beta", None),
                layer=layer)
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
            Mxfp4MoeBackend,
            make_mxfp4_moe_quant_config,
        )

        act = _GPT_OSS_SWIGLU if self.interleaved else {"swiglu_limit": limit}
        return make_mxfp4_moe_quant_config(Mxfp4MoeBackend.MARLIN, w1_scale=layer.w13_weight_scale,
                                           w2_scale=layer.w2_weight_scale, w1_bias=getattr(layer, "w13_bias", None),
                                           w2_bias=getattr(layer, "w2_bias", None), layer=layer, **act)

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any, shared_experts_input: torch.Tensor | None) -> Any:
        if self.moe_kernel is None:
            raise MarlinReadyMismatch(f"{self.module}: the Marlin kernel was not built (weights not processed)")
        return self.moe_kernel.apply(
            hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight, topk_weights=topk_weights, topk_ids=topk_ids,
            activation=layer.activation, global_num_experts=layer.global_num_experts,
            apply_router_weight_on_input=layer.apply_router_weight_on_input, expert_map=layer.expert_map,
            shared_experts=shared_experts, shared_experts_input=shared_experts_input)

