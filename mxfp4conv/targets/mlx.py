"""``mlx``: the folder ``mlx_lm.convert -q --q-mode mxfp4`` writes, from the FP4 bytes themselves.

MLX packs eight E2M1 codes per uint32, little-endian, element 0 in the low nibble: the bytes of an OCP
``weight_packed`` viewed as uint32, so a weight is written as it is under MLX's names and dtype. Its
uint8 scales are the E8M0 bytes. Routed experts are stacked per projection, as mlx-lm's ``sanitize``
leaves them (it stacks only unquantized ``.weight``): ``<layer>.<moe>.switch_mlp.{gate,up,down}_proj.
{weight,scales,bias}`` ``[E, out, in/8]`` / ``[E, out, in/32]`` (GPT-OSS: ``mlp.experts.*``, the names
its ``sanitize`` produces from ``_blocks``); an FP4 Linear is ``<module>.{weight,scales,bias}``; every
other tensor is carried byte for byte, but an FP8 KV cache's ``k_scale`` / ``v_scale``: mlx-lm computes
activations and keeps its cache in the compute dtype (bf16), so a W4A4 source runs W4A16 and an FP8 KV
cache is a bf16 one. mlx-lm quantizes exactly the modules whose ``.scales`` it finds.

The config is the source's with MLX's ``quantization`` (and the same under ``quantization_config``), the
keys mlx-lm's model classes read restored where transformers 5 renamed them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv.model.canonical import Canonical, DenseFP4, FP4Weight, MoELayer, UnitSpec
from mxfp4conv.targets.base import Getter, OutTensor, Split, Target, WriterContext, split_direct_sources
from mxfp4conv.targets.layers import precision_refusal

__all__ = ["ARCHITECTURES", "QUANTIZATION", "MlxTarget", "mlx_config", "switch_prefix"]

QUANTIZATION = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
# model_type -> the mlx-lm 0.32 model module that loads it (its sanitize and names checked for each)
ARCHITECTURES = {"qwen3_moe": "qwen3_moe", "qwen3_5_moe": "qwen3_5_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss",
                 "glm4_moe": "glm4_moe", "granitemoe": "granitemoe", "deepseek_v3": "deepseek_v3",
                 "kimi_k2": "deepseek_v3"}
PROJS = ("gate_proj", "up_proj", "down_proj")
# What keeps an MLX nvfp4 layer from holding a ModelOpt / compressed-tensors NVFP4 weight exactly
KEEP_NVFP4_REFUSAL = ("--keep-nvfp4: MLX's nvfp4 dequantizes code * (scale * (global_scale / 2688)) with the block "
                      "scale's product rounded first, not (code * scale) * weight_scale_2; drop the flag to requantize "
                      "to MXFP4")
_DROPPED_KEYS = ("quantization_config", "compression_config", "_name_or_path")
_KV_SCALES = (".k_scale", ".v_scale")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_NO_MTP = ("deepseek_v3", "kimi_k2")  # mlx-lm's deepseek_v3 builds num_hidden_layers layers, no MTP


def switch_prefix(key: str, ctx: WriterContext) -> str:
    """Where mlx-lm's model holds a MoE layer's stacked experts: ``X.switch_mlp`` for the experts
    container ``X.experts``; GPT-OSS keeps ``mlp.experts``."""
    if ctx.facts.model_type == "gpt_oss":
        return key
    return key.rsplit(".", 1)[0] + ".switch_mlp"


def _linear_specs(base: str, lead: tuple[int, ...], n: int, k: int, bias: str | None) -> list[OutTensor]:
    out = [OutTensor(f"{base}.weight", "U32", (*lead, n, k // 8)), OutTensor(f"{base}.scales", "U8", (*lead, n, k // 32))]
    return out + ([OutTensor(f"{base}.bias", bias, (*lead, n))] if bias else [])


def _u32(packed: torch.Tensor) -> torch.Tensor:
    """OCP-packed uint8 codes as MLX's uint32 words (the same bytes)."""
    import torch

    return packed.contiguous().view(torch.uint32)


def _u8(words: torch.Tensor) -> torch.Tensor:
    import torch

    return words.contiguous().view(torch.uint8)


def mlx_config(src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
    """The source's config with MLX's quantization, keys sorted as mlx-lm's ``save_config`` writes them."""
    cfg: dict[str, Any] = {k: v for k, v in src_config.items() if k not in _DROPPED_KEYS}
    # transformers 5 configs: mlx-lm's ModelArgs read the earlier names
    if "num_experts" not in cfg and "num_local_experts" in cfg and ctx.facts.model_type == "qwen3_moe":
        cfg["num_experts"] = cfg["num_local_experts"]
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    cfg.setdefault("rope_scaling", None)  # glm4_moe's ModelArgs take it without a default; absent means None
    cfg["quantization"] = dict(QUANTIZATION)
    cfg["quantization_config"] = dict(QUANTIZATION)
    return dict(sorted(cfg.items()))


class MlxTarget(Target):
    NAME = "mlx"
    ALWAYS_INDEX = True

    def refuse(self, ctx: WriterContext) -> str | None:
        mt = ctx.facts.model_type
        if mt not in ARCHITECTURES:
            return (f"--to mlx converts the architectures whose mlx-lm model it is checked against "
                    f"({', '.join(sorted(ARCHITECTURES))}), not {mt!r}")
        if ctx.target_options.keep_nvfp4:
            return KEEP_NVFP4_REFUSAL
        for u in ctx.units:
            if u.kind == "moe" and u.extra.get("fused") and mt != "gpt_oss":
                return f"{u.key}: fused experts of {mt!r} are not converted to MLX"
        for lin in ctx.precision.fp8.values():
            return (f"{lin.module}: {lin.kind} ({lin.scale} {lin.scale_dtype}) has no exact MLX form (mlx-lm's FP8 is "
                    "mxfp8: E8M0 scales per 32 inputs); --to ct or --to quark carry it")
        return precision_refusal(ctx, "MLX", fp8_block=False, fp8=False)

    def _dropped(self, spec: UnitSpec, ctx: WriterContext) -> bool:
        """What mlx-lm's model has no parameter for, so its ``sanitize`` (and so ``mlx_lm.convert``) drops it:
        an FP8 KV cache's scales (mlx-lm keeps its cache in the compute dtype) and DeepSeek-V3's MTP layer
        (a decoder layer past ``num_hidden_layers``)."""
        if spec.kind == "passthrough" and ctx.precision.kv_cache is not None and spec.key.endswith(_KV_SCALES):
            return True
        layer = _LAYER.match(spec.key)
        return ctx.facts.model_type in _NO_MTP and layer is not None and int(layer[1]) >= ctx.facts.num_layers

    def shard_metadata(self, ctx: WriterContext, split: Split | None = None) -> dict[str, str]:
        return {"format": "mlx"}  # what mlx.core.save_safetensors records

    def direct_sources(self, spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
        if spec.kind != "passthrough" or self._dropped(spec, ctx):
            return None
        return super().direct_sources(spec, ctx)

    def direct_parts(self, spec: UnitSpec, ctx: WriterContext) -> list[tuple[str, ...]] | None:
        """A split MXFP4 source's per-expert tensors, stacked by copying them one after the other: expert
        e's bytes are row block e of the stacked tensor."""
        if self._dropped(spec, ctx):
            return None
        if spec.kind == "passthrough":
            return super().direct_parts(spec, ctx)
        names = split_direct_sources(spec, ctx)
        if names is None or spec.kind == "dense":
            return None if names is None else [(n,) for n in names]
        per = len(names) // (3 * spec.dims[0])  # tensors per expert projection: packed, scale[, bias]
        by_expert = [names[i:i + 3 * per] for i in range(0, len(names), 3 * per)]
        return [tuple(e[proj * per + field] for e in by_expert) for proj in range(3) for field in range(per)]

    def verify_unit(self, want: Canonical, spec: UnitSpec, ctx: WriterContext, get: Getter
                    ) -> list[dict[str, str]] | None:
        return [] if self._dropped(spec, ctx) else None  # nothing written, nothing to compare

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        bias = spec.extra.get("bias_dtype", "BF16") if spec.has_bias else None
        if self._dropped(spec, ctx):
            return []
        if spec.kind == "moe":
            e, h, i = spec.dims
            sw = switch_prefix(spec.key, ctx)
            return [t for proj, n, k in zip(PROJS, (i, i, h), (h, h, i), strict=True)
                    for t in _linear_specs(f"{sw}.{proj}", (e,), n, k, bias)]
        if spec.kind == "dense":
            n, k = spec.dims
            return _linear_specs(spec.key, (), n, k, bias)
        return super().out_specs(spec, ctx)

    def encode(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        if self._dropped(spec, ctx):
            return []
        if isinstance(unit, MoELayer):
            i = unit.w13.packed.shape[1] // 2
            out: list[torch.Tensor] = []
            for w, b, rows in ((unit.w13, unit.w13_bias, slice(0, i)), (unit.w13, unit.w13_bias, slice(i, 2 * i)),
                               (unit.w2, unit.w2_bias, slice(None))):
                out += [_u32(w.packed[:, rows]), w.scales[:, rows]] + ([b[:, rows]] if b is not None else [])
            return out
        if isinstance(unit, DenseFP4):
            w = unit.weight
            return [_u32(w.packed), w.scales] + ([unit.bias] if unit.bias is not None else [])
        return super().encode(unit, spec, ctx)

    def decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        import torch

        if spec.kind == "moe":
            sw = switch_prefix(spec.key, ctx)
            g, u, d = (f"{sw}.{p}" for p in PROJS)
            w13 = FP4Weight("mxfp4", torch.cat([_u8(get(f"{g}.weight")), _u8(get(f"{u}.weight"))], 1),
                            torch.cat([get(f"{g}.scales"), get(f"{u}.scales")], 1))
            w2 = FP4Weight("mxfp4", _u8(get(f"{d}.weight")), get(f"{d}.scales"))
            b13 = torch.cat([get(f"{g}.bias"), get(f"{u}.bias")], 1) if spec.has_bias else None
            return MoELayer(spec.key, w13, w2, b13, get(f"{d}.bias") if spec.has_bias else None)
        if spec.kind == "dense":
            bias = get(f"{spec.key}.bias") if spec.has_bias else None
            return DenseFP4(spec.key, FP4Weight("mxfp4", _u8(get(f"{spec.key}.weight")), get(f"{spec.key}.scales")), bias)
        return super().decode(spec, ctx, get)

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        return mlx_config(src_config, ctx)
