"""``marlin``: Marlin-ready shards, byte-identical to vLLM's load-time FP4 Marlin preparation.

One output folder per tensor-parallel rank (``rank-0`` ... ``rank-N-1``), each holding the tensors
that rank's layer holds after ``process_weights_after_loading`` (MARLIN.md §4), named after the
vLLM parameters (``<experts>.w13_weight``, ``w13_weight_scale``, ``w2_*``, biases; NVFP4 kept as
NVFP4 adds ``*_weight_scale_2``). Layout v2 (vLLM >= 0.20, bf16 params, 16-bit activations).

Rank slicing follows vLLM's FusedMoE (gate and up rows each split by I/tp, down split on K; the
w2 bias lives on rank 0 only) and, for GPT-OSS, its loader's 32-row chunks with the Marlin
padding (Ip = round_up(I/tp, 128), Hp = round_up(H, 256)) and interleaved gate/up rows.
``--engine sglang`` writes gate/up halves, pads I per shard to 64 (128 if H % 128) and uses
SGLang's bias names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mxfp4conv.formats.marlin_shapes import check_marlin_shape, gptoss_marlin_padded_sizes, marlin_padded_nk
from mxfp4conv.layouts.gpt_oss import deinterleave_rows, interleave_rows
from mxfp4conv.model.canonical import Canonical, DenseFP4, FP4Weight, MoELayer, UnitSpec
from mxfp4conv.targets import ct as ct_writer
from mxfp4conv.targets import gpt_oss as gpt_oss_writer
from mxfp4conv.targets.base import Getter, OutTensor, Split, Target, WriterContext

if TYPE_CHECKING:  # torch and the Marlin numerics load on first use: plans and inspect need neither
    import torch


LAYOUT_VERSION = "v2"
VLLM_VERIFIED = "0.33.0"
_ROW_PARALLEL = ("o_proj", "down_proj", "w2", "dense_4h_to_h", "out_proj")


@dataclass(frozen=True)
class _Geo:
    """One rank's view of a MoE layer: data rows [start, start+rows) of I, padded sizes."""

    start: int
    rows: int  # logical I rows this rank holds
    ip: int  # padded I per shard (== rows when unpadded)
    hp: int  # padded H
    interleaved: bool


def _opts(ctx: WriterContext) -> tuple[int, int, str, bool]:
    o = ctx.target_options
    return o.tp_size, o.tp_rank, o.engine, o.keep_nvfp4


def _a8(ctx: WriterContext) -> bool:
    """``--marlin-act fp8``: the FP8-activation (W4A8) tiling and scale layout (MARLIN.md §1-2)."""
    return ctx.target_options.marlin_act == "fp8"


def _gptoss(ctx: WriterContext) -> bool:
    return ctx.facts.model_type == "gpt_oss"


def _geo(spec: UnitSpec, ctx: WriterContext) -> _Geo:
    tp, rank, engine, keep = _opts(ctx)
    _, h, i = spec.dims
    if _gptoss(ctx) and engine == "vllm":
        chunk = -(-i // 32 // tp) * 32
        start = min(i, rank * chunk)
        hp, ip = gptoss_marlin_padded_sizes(h, i // tp)
        return _Geo(start, min(i, start + chunk) - start, ip, hp, True)
    i_r = i // tp
    if keep and not _gptoss(ctx):  # vLLM's NVFP4 MoE preparation pads I per gate/up shard (MARLIN.md §4)
        step = 64 if h % 128 == 0 else 128
        return _Geo(rank * i_r, i_r, -(-i_r // step) * step, h, False)
    if _gptoss(ctx):  # sglang: per-shard padding
        ip = -(-i_r // (64 if h % 128 == 0 else 128)) * (64 if h % 128 == 0 else 128)
        return _Geo(rank * i_r, i_r, ip, h, False)
    return _Geo(rank * i_r, i_r, i_r, h, False)


def _bias_names(ctx: WriterContext) -> tuple[str, str]:
    return ("w13_weight_bias", "w2_weight_bias") if _opts(ctx)[2] == "sglang" else ("w13_bias", "w2_bias")


class MarlinTarget(Target):
    NAME = "marlin"

    def passthrough_name(self, name: str, ctx: WriterContext) -> str:
        """Non-FP4 tensors keep the names of the runtime-native config each rank carries."""
        return name if _gptoss(ctx) else ct_writer.CtTarget().passthrough_name(name, ctx)

    def refuse(self, ctx: WriterContext) -> str | None:
        native = (gpt_oss_writer.GptOssTarget() if _gptoss(ctx) else ct_writer.CtTarget()).refuse(ctx)
        if native is not None and not _gptoss(ctx):
            return native  # the rank config describes non-FP4 layers in the compressed-tensors syntax
        tp, _, engine, keep = _opts(ctx)
        if keep and ctx.facts.source_quant != "nvfp4":
            return "--keep-nvfp4 needs an NVFP4 source (this one is MXFP4)"
        if keep and _a8(ctx):
            return "--marlin-act fp8 exists for MXFP4 only (vLLM has no FP8-activation NVFP4 Marlin)"
        if keep and _gptoss(ctx):
            return "--keep-nvfp4: GPT-OSS has no NVFP4 Marlin layer in vLLM; drop the flag to requantize to MXFP4"
        group = 16 if keep else 32
        for u in ctx.units:
            if u.kind == "moe":
                _, h, i = u.dims
                if i % tp:
                    return f"{u.key}: intermediate size {i} is not divisible by --tp-size {tp}"
                if not _gptoss(ctx):
                    ip = _geo(u, ctx).ip
                    for what, n, k in (("w13", 2 * ip, h), ("w2", h, ip)):
                        if why := check_marlin_shape(n, k, group):
                            return f"{u.key}.{what} per rank [N={n}, K={k}] fails the Marlin rule {why}"
                elif (i // tp) % 32:
                    return f"{u.key}: I/tp = {i // tp} must be a multiple of 32 (MXFP4 block)"
                elif engine == "sglang":
                    geo = _geo(u, ctx)
                    for what, n, k in (("w13", 2 * geo.ip, h), ("w2", h, geo.ip)):
                        if why := check_marlin_shape(n, k, group):
                            return f"{u.key}.{what} per rank [N={n}, K={k}] fails SGLang's Marlin rule {why}"
            elif u.kind == "dense":
                n, k = u.dims
                row = u.key.rsplit(".", 1)[-1] in _ROW_PARALLEL
                if (k if row else n) % tp or (row and (k // tp) % group):
                    return f"{u.key} [N={n}, K={k}] cannot be split {'on K' if row else 'on N'} over --tp-size {tp}"
        return None

    def ranks(self, ctx: WriterContext) -> list[int]:
        return list(range(_opts(ctx)[0]))

    def rank_folder(self, rank: int, ctx: WriterContext) -> str:
        return f"rank-{rank}"

    def shard_metadata(self, ctx: WriterContext, split: Split | None = None) -> dict[str, str]:
        tp, rank, engine, keep = _opts(ctx)
        f = ctx.facts
        return {
            "format": "pt",
            "mxfp4conv.format": "marlin-fp4",
            "mxfp4conv.marlin_layout": LAYOUT_VERSION,
            "mxfp4conv.quant": "nvfp4" if keep else "mxfp4",
            "mxfp4conv.params_dtype": "bfloat16",
            "mxfp4conv.act_dtype": "fp8_e4m3" if _a8(ctx) else "bf16",
            "mxfp4conv.nvfp4_rescale": "true" if keep else "false",
            "mxfp4conv.tile_padding": "zero" if _gptoss(ctx) or any(u.kind == "dense" for u in ctx.units) else "none",
            "mxfp4conv.w13_order": "interleaved" if _gptoss(ctx) and engine == "vllm" else "halves",
            "mxfp4conv.engine": engine,
            "mxfp4conv.tp_size": str(tp),
            "mxfp4conv.tp_rank": str(rank),
            "mxfp4conv.vllm_verified": VLLM_VERIFIED,
            "mxfp4conv.logical_shapes": json.dumps({"hidden_size": f.hidden_size, "intermediate_size": f.intermediate_size},
                                                   sort_keys=True),
        }

    # ---- planning ---------------------------------------------------------------------------

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        keep = _opts(ctx)[3]
        g = 16 if keep else 32
        sdt = "F8_E4M3" if keep else "F8_E8M0"
        if spec.kind == "moe":
            e = spec.dims[0]
            geo = _geo(spec, ctx)
            n13, k13, n2, k2 = 2 * geo.ip, geo.hp, geo.hp, geo.ip
            p = spec.key
            out = [OutTensor(f"{p}.w13_weight", "I32", (e, k13 // 16, 2 * n13)),
                   OutTensor(f"{p}.w13_weight_scale", sdt, (e, k13 // g, n13)),
                   OutTensor(f"{p}.w2_weight", "I32", (e, k2 // 16, 2 * n2)),
                   OutTensor(f"{p}.w2_weight_scale", sdt, (e, k2 // g, n2))]
            if keep:
                out += [OutTensor(f"{p}.w13_weight_scale_2", "F32", (e,)), OutTensor(f"{p}.w2_weight_scale_2", "F32", (e,))]
            if spec.has_bias:
                b13, b2 = _bias_names(ctx)
                out += [OutTensor(f"{p}.{b13}", "BF16", (e, n13)), OutTensor(f"{p}.{b2}", "BF16", (e, n2))]
            return out
        if spec.kind == "dense":
            n, k = self._dense_nk(spec, ctx)
            np_, kp = (n, k) if check_marlin_shape(n, k, g) is None else marlin_padded_nk(n, k, g)
            out = [OutTensor(f"{spec.key}.weight", "I32", (kp // 16, 2 * np_)),
                   OutTensor(f"{spec.key}.weight_scale", sdt, (kp // g, np_))]
            if keep:
                out.append(OutTensor(f"{spec.key}.weight_global_scale", "F32", ()))
            if spec.has_bias:
                out.append(OutTensor(f"{spec.key}.bias", spec.extra.get("bias_dtype", "BF16"), (np_,)))
            return out
        return super().out_specs(spec, ctx)

    def _dense_nk(self, spec: UnitSpec, ctx: WriterContext) -> tuple[int, int]:
        tp = _opts(ctx)[0]
        n, k = spec.dims
        return (n, k // tp) if spec.key.rsplit(".", 1)[-1] in _ROW_PARALLEL else (n // tp, k)

    # ---- the canonical slice a rank holds -----------------------------------------------------

    def slice_for_rank(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> Canonical:
        import torch

        tp, rank, _, keep = _opts(ctx)
        if isinstance(unit, MoELayer):
            geo = _geo(spec, ctx)
            i = spec.dims[2]
            rows = torch.cat([torch.arange(geo.start, geo.start + geo.rows), torch.arange(i + geo.start, i + geo.start + geo.rows)])
            g = 16 if unit.w13.quant == "nvfp4" else 32
            w13 = _take_rows(unit.w13, rows)
            w2 = _take_k(unit.w2, geo.start, geo.rows, g)
            b13 = unit.w13_bias.index_select(1, rows).to(torch.bfloat16) if unit.w13_bias is not None else None
            b2 = None
            if unit.w2_bias is not None:
                b2 = unit.w2_bias.to(torch.bfloat16) if rank == 0 else torch.zeros_like(unit.w2_bias, dtype=torch.bfloat16)
            if keep:
                w13, w2 = _multiplier(w13), _multiplier(w2)
            return MoELayer(unit.prefix, w13, w2, b13, b2)
        if isinstance(unit, DenseFP4):
            n, k = spec.dims
            g = 16 if unit.weight.quant == "nvfp4" else 32
            if spec.key.rsplit(".", 1)[-1] in _ROW_PARALLEL:
                w = _take_k(unit.weight, rank * (k // tp), k // tp, g)
                bias = unit.bias
            else:
                rows = torch.arange(rank * (n // tp), (rank + 1) * (n // tp))
                w = _take_rows(unit.weight, rows)
                bias = unit.bias.index_select(0, rows) if unit.bias is not None else None
            return DenseFP4(unit.module, _multiplier(w) if keep else w, bias)
        return unit

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        if isinstance(unit, MoELayer | DenseFP4):
            return self._encode_part(self.slice_for_rank(unit, spec, ctx), spec, ctx)
        return super().encode(unit, spec, ctx)

    def verify_unit(self, want: Canonical, spec: UnitSpec, ctx: WriterContext, get: Getter) -> list[dict[str, str]] | None:
        """NVFP4 kept as NVFP4: S0E5M3 scales do not decode uniquely ((s*2^k, g/2^k) encode alike), so
        the rank's slice of SRC is encoded again and every output byte compared; the FP4 codes are
        also decoded back and compared. None (the default decode-and-compare) for MXFP4 outputs."""
        import torch

        from mxfp4conv.formats import marlin as fm
        if not _opts(ctx)[3] or spec.kind == "passthrough":
            return None
        assert isinstance(want, MoELayer | DenseFP4)
        out: list[dict[str, str]] = []
        for o, t in zip(self.out_specs(spec, ctx), self._encode_part(want, spec, ctx), strict=True):
            got = get(o.name)
            a, b = t.contiguous().reshape(-1).view(torch.uint8), got.contiguous().reshape(-1).view(torch.uint8)
            if a.shape != b.shape or not torch.equal(a, b):
                out.append({"tensor": o.name, "message": "bytes differ from SRC re-encoded for this rank"})
        if isinstance(want, MoELayer) and not out:
            geo = _geo(spec, ctx)
            codes = fm.unrepack_fp4_weight(get(f"{spec.key}.w2_weight"), geo.hp, geo.ip)[..., : spec.dims[1], : geo.rows // 2]
            if not torch.equal(codes, want.w2.packed):
                out.append({"tensor": f"{spec.key}.w2_weight", "message": "decoded FP4 codes differ from SRC"})
        return out

    def _encode_part(self, part: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        from mxfp4conv.formats import marlin as fm
        names = [t.name for t in self.out_specs(spec, ctx)]
        if isinstance(part, MoELayer):
            if part.w13.quant == "nvfp4":
                _check_one_global(part, spec)
            geo = _geo(spec, ctx)
            padded = self._pad_moe(part, geo)
            quant = part.w13.quant
            out = fm.prepare_moe_fp4(
                padded["w13"], padded["w13s"], padded["w2"], padded["w2s"], quant=quant,
                w13_global=part.w13.global_rows[:, 0] if quant == "nvfp4" and part.w13.global_rows is not None else None,
                w2_global=part.w2.global_rows[:, 0] if quant == "nvfp4" and part.w2.global_rows is not None else None,
                w13_bias=padded.get("b13"), w2_bias=padded.get("b2"), a8=_a8(ctx))
            b13, b2 = _bias_names(ctx)
            out = {**out, **({b13: out.pop("w13_bias")} if "w13_bias" in out else {}),
                   **({b2: out.pop("w2_bias")} if "w2_bias" in out else {})}
            return [out[n.rsplit(".", 1)[1]] for n in names]
        if isinstance(part, DenseFP4):
            w = part.weight
            out = fm.prepare_dense_fp4(w.packed, w.scales, quant=w.quant, bias=part.bias, a8=_a8(ctx),
                                       global_scale=w.global_rows[0] if w.global_rows is not None else None)
            return [out[n.rsplit(".", 1)[1]] for n in names]
        raise TypeError(type(part).__name__)

    def _pad_moe(self, part: MoELayer, geo: _Geo) -> dict[str, torch.Tensor]:
        """Per-rank w13 rows in the engine's order, zero-padded to (2Ip, Hp) / (Hp, Ip)."""
        import torch

        from mxfp4conv.formats import marlin as fm
        two_r = part.w13.packed.shape[1]
        r = two_r // 2
        g = 16 if part.w13.quant == "nvfp4" else 32
        out: dict[str, torch.Tensor] = {}
        if geo.interleaved:
            w13p, w13s = interleave_rows(part.w13.packed), interleave_rows(part.w13.scales)
            b13 = interleave_rows(part.w13_bias) if part.w13_bias is not None else None
            p = fm.pad_dense_fp4(w13p, w13s, b13, group=g, to=(2 * geo.ip, geo.hp))
        else:  # halves, padded per shard
            halves = [fm.pad_dense_fp4(part.w13.packed[:, s], part.w13.scales[:, s],
                                       part.w13_bias[:, s] if part.w13_bias is not None else None,
                                       group=g, to=(geo.ip, geo.hp)) for s in (slice(0, r), slice(r, two_r))]
            p = fm.PaddedFP4(torch.cat([h.packed for h in halves], 1), torch.cat([h.scales for h in halves], 1),
                             torch.cat([h.bias for h in halves], 1) if halves[0].bias is not None else None,  # type: ignore[misc]
                             2 * r, geo.hp, 2 * geo.ip, geo.hp)
        q = fm.pad_dense_fp4(part.w2.packed, part.w2.scales, part.w2_bias, group=g, to=(geo.hp, geo.ip))
        out.update(w13=p.packed, w13s=p.scales, w2=q.packed, w2s=q.scales)
        if p.bias is not None and q.bias is not None:
            out.update(b13=p.bias, b2=q.bias)
        return out

    def decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        """Marlin MXFP4 -> canonical (inverse permutations, padding cropped); NVFP4 goes through verify_unit."""
        import torch

        from mxfp4conv.formats import marlin_scales as fms
        g = 32
        if spec.kind == "moe":
            h = spec.dims[1]
            geo = _geo(spec, ctx)
            p = spec.key
            w13 = _unmarlin(get(f"{p}.w13_weight"), get(f"{p}.w13_weight_scale"), 2 * geo.ip, geo.hp, _a8(ctx))
            w2 = _unmarlin(get(f"{p}.w2_weight"), get(f"{p}.w2_weight_scale"), geo.hp, geo.ip, _a8(ctx))
            b13n, b2n = _bias_names(ctx)
            b13 = fms.unpermute_bias(get(f"{p}.{b13n}")) if spec.has_bias else None
            b2 = fms.unpermute_bias(get(f"{p}.{b2n}"))[:, :h] if spec.has_bias else None
            if geo.interleaved:
                rows = slice(0, 2 * geo.rows)
                w13 = _crop(w13, rows, h, g)
                w13 = FP4Weight(w13.quant, deinterleave_rows(w13.packed), deinterleave_rows(w13.scales), w13.global_rows)
                b13 = deinterleave_rows(b13[:, rows]) if b13 is not None else None
            else:
                idx = torch.cat([torch.arange(geo.rows), torch.arange(geo.ip, geo.ip + geo.rows)])
                w13 = _crop(_take_rows(w13, idx), slice(None), h, g)
                b13 = b13.index_select(1, idx) if b13 is not None else None
            w2 = _crop(w2, slice(0, h), geo.rows, g)
            return MoELayer(p, w13, w2, b13, b2)
        if spec.kind == "dense":
            n, k = self._dense_nk(spec, ctx)
            np_, kp = (n, k) if check_marlin_shape(n, k, g) is None else marlin_padded_nk(n, k, g)
            w = _crop(_unmarlin(get(f"{spec.key}.weight"), get(f"{spec.key}.weight_scale"), np_, kp, _a8(ctx)),
                      slice(0, n), k, g)
            bias = fms.unpermute_bias(get(f"{spec.key}.bias"))[:n] if spec.has_bias else None
            return DenseFP4(spec.key, w, bias)
        return super().decode(spec, ctx, get)

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        tp, rank, engine, keep = _opts(ctx)
        base = (gpt_oss_writer.GptOssTarget() if _gptoss(ctx) else ct_writer.CtTarget()).config(src_config, ctx)
        q = dict(base["quantization_config"])  # type: ignore[call-overload]
        q["mxfp4conv_marlin"] = {"format": "marlin-fp4", "layout": LAYOUT_VERSION, "engine": engine, "tp_size": tp,
                                 "tp_rank": rank, "quant": "nvfp4" if keep else "mxfp4", "params_dtype": "bfloat16",
                                 "vllm_verified": VLLM_VERIFIED}
        return {**base, "quantization_config": q}


def _check_one_global(part: MoELayer, spec: UnitSpec) -> None:
    """Marlin NVFP4 holds one second-level scale per expert for w13: gate and up must agree."""
    g = part.w13.global_rows
    assert g is not None
    bad = (g != g[:, :1]).any(dim=1).nonzero()
    if bad.numel():
        e = int(bad[0])
        from mxfp4conv.errors import InputError

        raise InputError(f"expert {e}: gate and up weight_scale_2 differ, but an NVFP4 Marlin layer holds one per "
                         "expert (vLLM would mis-scale the up half)", tensor=f"{spec.key}.{e}",
                         hint="drop --keep-nvfp4 to requantize to MXFP4, which keeps both scales exact")


def _take_rows(w: FP4Weight, rows: torch.Tensor) -> FP4Weight:
    import torch

    g = w.global_rows.index_select(-1, rows) if w.global_rows is not None else None
    return FP4Weight(w.quant, w.packed.index_select(-2, rows), w.scales.view(torch.uint8).index_select(-2, rows).view(w.scales.dtype),
                     g, w.global_is_divisor)


def _take_k(w: FP4Weight, start: int, length: int, group: int) -> FP4Weight:
    return FP4Weight(w.quant, w.packed[..., start // 2:(start + length) // 2].contiguous(),
                     w.scales[..., start // group:(start + length) // group].contiguous(), w.global_rows, w.global_is_divisor)


def _crop(w: FP4Weight, rows: slice, k: int, group: int) -> FP4Weight:
    g = w.global_rows[..., rows] if w.global_rows is not None else None
    return FP4Weight(w.quant, w.packed[..., rows, : k // 2].contiguous(), w.scales[..., rows, : k // group].contiguous(), g)


def _multiplier(w: FP4Weight) -> FP4Weight:
    """NVFP4 second-level scale as the dequant multiplier vLLM uses (1/x of compressed-tensors' divisor)."""
    if w.global_rows is None or not w.global_is_divisor:
        return w
    return FP4Weight(w.quant, w.packed, w.scales, (1.0 / w.global_rows).float(), False)


def _unmarlin(weight: torch.Tensor, scale: torch.Tensor, n: int, k: int, a8: bool) -> FP4Weight:
    """Marlin MXFP4 tensors back to canonical codes and E8M0 bytes (NVFP4 is verified by re-encoding)."""
    import torch

    from mxfp4conv.formats import marlin as fm
    from mxfp4conv.formats import marlin_scales as fms
    packed = fm.unrepack_fp4_weight(weight, n, k, a8=a8)
    return FP4Weight("mxfp4", packed, fms.mxfp4_scales_from_marlin(scale.view(torch.uint8), a8=a8))
