"""``gguf``: a GGUF llama.cpp serves, FP4 weights as GGML MXFP4 (type 39) from the FP4 bytes themselves.

Routed experts are stacked per projection (``blk.L.ffn_{gate,up,down}_exps.weight``, ``[E, N, K/32 * 17]``
bytes, GGML dims ``{K, N, E}``) and every FP4 Linear is one MXFP4 tensor: each 32-element block is the
source's scale byte and its codes in GGML's nibble order (``formats/ggml.py``), so the values are the
source's exactly (MXFP4) or the MXFP4 requantization every target writes (NVFP4). The other tensors are
named as llama.cpp's converter names them (``gguf_arch.ARCHS``) and kept in their dtype, but norms and other 1-D
tensors, biases and the router, which llama.cpp computes in F32 (they are widened exactly). The metadata
is llama.cpp's: the architecture's hyper-parameters from config.json, the tokenizer (``gguf_vocab``) and
``general.*`` naming the source and mxfp4conv. ``--max-shard-size`` splits as ``llama-gguf-split`` does
(``model-00001-of-00003.gguf``, every key in the first file, ``split.*`` in each).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from mxfp4conv import __version__
from mxfp4conv.errors import InputError
from mxfp4conv.files.safetensors import torch_dtype
from mxfp4conv.model.canonical import Canonical, DenseFP4, FP4Weight, MoELayer, Passthrough, UnitSpec
from mxfp4conv.sources.gguf import GGUF, KV, VType, mxfp4_row_bytes, nvfp4_row_bytes
from mxfp4conv.targets.base import Getter, OutTensor, Split, Target, WriterContext
from mxfp4conv.targets.gguf_arch import (
    ARCHS,
    Arch,
    Reshape,
    expert_prefix,
    gguf_name,
    layer_of,
    rope_config,
    text_hparams,
    text_name,
)
from mxfp4conv.targets.gguf_vocab import tokenizer_kvs, tokenizer_refusal
from mxfp4conv.targets.layers import precision_refusal

__all__ = ["FILE_TYPE_MXFP4_MOE", "FILE_TYPE_NVFP4", "GgufTarget", "gguf_kvs"]

FILE_TYPE_MXFP4_MOE = 38  # llama_ftype LLAMA_FTYPE_MOSTLY_MXFP4_MOE
FILE_TYPE_NVFP4 = 39  # LLAMA_FTYPE_MOSTLY_NVFP4 (--keep-nvfp4)
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION
_PROJ = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# what llama.cpp's converter keeps in F32 beyond 1-D
_F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "attn_sinks.weight", "ssm_conv1d.weight")
_KV_SCALES = (".k_scale", ".v_scale")


def provenance_kvs(ctx: WriterContext) -> list[KV]:
    """``general.*`` naming the source release (the GGUF's base model) and the converter: what ``verify`` does
    not compare, as the same release may be named by its repo id or by a folder holding it."""
    name = ctx.source.rsplit("/", 1)[-1] or ctx.facts.model_type
    out = [KV("general.name", VType.STRING, name), KV("general.quantized_by", VType.STRING, f"mxfp4conv {__version__}"),
           KV("general.base_model.count", VType.UINT32, 1), KV("general.base_model.0.name", VType.STRING, name)]
    if ctx.source_is_repo:
        org = ctx.source.split("/", 1)[0]
        out += [KV("general.base_model.0.organization", VType.STRING, org),
                KV("general.base_model.0.repo_url", VType.STRING, f"https://huggingface.co/{ctx.source}")]
    return out


def gguf_kvs(src_config: Mapping[str, Any], ctx: WriterContext, *, provenance: bool = True) -> list[KV]:
    """Every metadata entry of the first (or only) file."""
    arch = ARCHS[ctx.facts.model_type]
    out = [KV("general.architecture", VType.STRING, arch.name),
           KV("general.type", VType.STRING, "model"),
           KV("general.quantization_version", VType.UINT32, QUANTIZATION_VERSION),
           KV("general.file_type", VType.UINT32,
              FILE_TYPE_NVFP4 if ctx.target_options.keep_nvfp4 else FILE_TYPE_MXFP4_MOE)]
    out += provenance_kvs(ctx) if provenance else []
    out += [dataclasses.replace(kv, key=f"{arch.name}.{kv.key}") for kv in arch.hparams(text_hparams(src_config))]
    return out + tokenizer_kvs(ctx.read_file, src_config)


def _split_kvs(split: Split) -> list[KV]:
    return [KV("split.no", VType.UINT16, split.at), KV("split.count", VType.UINT16, split.files),
            KV("split.tensors.count", VType.INT32, split.tensors)]


def _widened(dtype: str, shape: tuple[int, ...], out_name: str) -> bool:
    """Tensors llama.cpp computes in F32: 1-D ones (norms, biases) and the router."""
    return dtype in ("BF16", "F16") and (len(shape) <= 1 or out_name.endswith(_F32_ALWAYS))


# the GGUF weights llama.cpp multiplies by a per-tensor ``<name>.scale`` (its generic NVFP4 scale2 pass)
_SCALED = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
           "ffn_down.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
NVFP4_DIVISOR_REFUSAL = ("--keep-nvfp4: compressed-tensors NVFP4 divides by weight_global_scale and llama.cpp multiplies "
                         "by a per-tensor scale, whose reciprocal float32 does not hold exactly; drop the flag to "
                         "requantize to MXFP4")


def _keep_refusal(ctx: WriterContext, arch: Arch) -> str | None:
    """Why an NVFP4 source cannot be written as GGML NVFP4 (type 40) exactly."""
    if ctx.facts.source_quant != "nvfp4":
        return "--keep-nvfp4 keeps NVFP4 sources as NVFP4; this source is MXFP4 (drop the flag: it converts losslessly)"
    if ctx.layout == "ct-nvfp4":
        return NVFP4_DIVISOR_REFUSAL
    if not arch.nvfp4_scales:
        checked = ", ".join(sorted({a.name for a in ARCHS.values() if a.nvfp4_scales}))
        return (f"--keep-nvfp4: GGML NVFP4 is written for the architectures whose llama.cpp graph is checked to "
                f"multiply NVFP4 weights by their per-tensor scale ({checked}), not {arch.name}; drop the flag to "
                "requantize to MXFP4")
    for u in ctx.units:
        if u.kind == "moe" and (u.dims[1] % 64 or u.dims[2] % 64):
            return (f"{u.key}: --keep-nvfp4: GGML NVFP4 blocks are 64 elements along the input; hidden {u.dims[1]} "
                    f"/ intermediate {u.dims[2]} are not multiples of 64 (drop the flag to requantize to MXFP4)")
        if u.kind == "dense":
            name = gguf_name(f"{u.key}.weight", arch) or ""
            if u.dims[1] % 64:
                return (f"{u.key}: --keep-nvfp4: an input of {u.dims[1]} is not a multiple of GGML NVFP4's 64-element "
                        "block (drop the flag to requantize to MXFP4)")
            if not name.endswith(_SCALED):
                return (f"{u.key}: --keep-nvfp4: llama.cpp applies no per-tensor NVFP4 scale to {name or 'it'} "
                        "(drop the flag to requantize to MXFP4)")
    return None


def _per_tensor(w: FP4Weight, rows: slice, what: str) -> torch.Tensor:
    """The one per-tensor scale of each stacked matrix (an NVFP4 weight's ``global_rows`` are its rows' copies)."""
    assert w.global_rows is not None and not w.global_is_divisor  # refused at planning otherwise
    g = w.global_rows[..., rows]
    first = g[..., :1]
    if not bool((g == first).all()):
        raise ValueError(f"{what}: rows of one matrix with different NVFP4 global scales have no GGUF form")
    return first.reshape(-1).float().contiguous()


def _vocab_refusal(ctx: WriterContext) -> str | None:
    """llama.cpp sizes its vocabulary from the GGUF's token list and requires token_embd to have that many rows."""
    embed = ctx.passthrough_dtypes.get("model.embed_tokens.weight")
    if embed is None:
        return None
    tokens = next(kv.value for kv in tokenizer_kvs(ctx.read_file, ctx.src_config) if kv.key == "tokenizer.ggml.tokens")
    if len(tokens) != embed[1][0]:
        return (f"tokenizer.json: {len(tokens)} tokens (config.json vocab_size {ctx.src_config.get('vocab_size')}) but "
                f"model.embed_tokens.weight has {embed[1][0]} rows; llama.cpp needs one token per row")
    return None


def _reshape(spec: UnitSpec, ctx: WriterContext) -> Reshape | None:
    """What llama.cpp's converter does to this tensor (or FP4 Linear) beyond naming it, None if nothing."""
    arch = ARCHS[ctx.facts.model_type]
    if spec.kind == "moe" or arch.reshape is None:
        return None
    name = text_name(f"{spec.key}.weight" if spec.kind == "dense" else spec.key)
    m = layer_of(name)
    return arch.reshape(name if m is None else m[2], text_hparams(ctx.src_config))


def _rows(unit: Canonical, perm: torch.Tensor) -> Canonical:
    """``unit`` with its output rows in the order ``perm`` (codes, scales, global scales and bias alike)."""
    if isinstance(unit, Passthrough):
        return Passthrough(unit.name, unit.tensor.index_select(0, perm))
    assert isinstance(unit, DenseFP4)
    w = unit.weight
    g = None if w.global_rows is None else w.global_rows.index_select(-1, perm)
    weight = FP4Weight(w.quant, w.packed.index_select(0, perm), w.scales.index_select(0, perm), g, w.global_is_divisor)
    return DenseFP4(unit.module, weight, None if unit.bias is None else unit.bias.index_select(0, perm))


def _no_nan_scale(*scales: torch.Tensor, what: str) -> None:
    """An E8M0 byte 0xFF is NaN in MXFP4 but 2^127 in ggml: carried as it is, it would become a finite weight."""
    if any(bool((s == 0xFF).any()) for s in scales):
        raise InputError("E8M0 scale byte 0xFF (NaN) is not a valid MXFP4 scale", tensor=what,
                         hint="the checkpoint is corrupt; re-download or re-export it")


def _nvfp4_blocks(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    import torch

    from mxfp4conv.formats.ggml import to_ggml_nvfp4

    return to_ggml_nvfp4(packed, scales.view(torch.uint8)).view(torch.int8)  # declared I8: NVFP4 blocks


def _weight(blocks: torch.Tensor, scale: torch.Tensor | None) -> FP4Weight:
    """A GGUF FP4 tensor back in canonical form: MXFP4 blocks, or NVFP4 blocks with their per-tensor scale
    (one per stacked matrix, as every row's global scale)."""
    import torch

    from mxfp4conv.formats.ggml import from_ggml_nvfp4
    from mxfp4conv.kernels.ggml_native import from_ggml_mxfp4

    if scale is None:
        return FP4Weight("mxfp4", *from_ggml_mxfp4(blocks))
    packed, scales = from_ggml_nvfp4(blocks.view(torch.uint8))
    rows = scale.reshape(*blocks.shape[:-2], 1).expand(*blocks.shape[:-1]).contiguous()
    return FP4Weight("nvfp4", packed, scales.view(torch.float8_e4m3fn), rows)


def _mla_parts(kv_b: torch.Tensor, cfg: Mapping[str, Any]) -> list[torch.Tensor]:
    """kv_b_proj ``[heads * (nope + v), kv_lora]`` -> llama.cpp's (attn_k_b ``[heads, kv_lora, nope]``,
    attn_v_b ``[heads, v, kv_lora]``): per head the nope rows, transposed, then the v rows."""
    heads, nope = int(cfg["num_attention_heads"]), int(cfg["qk_nope_head_dim"])
    per = kv_b.reshape(heads, -1, kv_b.shape[-1])
    return [per[:, :nope].transpose(1, 2).contiguous(), per[:, nope:].contiguous()]


def _mla_join(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.cat([k_b.transpose(1, 2), v_b], 1).reshape(-1, k_b.shape[1])


class GgufTarget(Target):
    NAME = "gguf"
    CONTAINER = GGUF
    HF_FOLDER = False  # one self-contained GGUF (or its splits): no config.json, index or tokenizer files

    def refuse(self, ctx: WriterContext) -> str | None:
        mt = ctx.facts.model_type
        if mt not in ARCHS:
            return (f"--to gguf converts the architectures whose llama.cpp names it is checked against "
                    f"({', '.join(sorted(ARCHS))}), not {mt!r}")
        arch = ARCHS[mt]
        if ctx.target_options.keep_nvfp4 and (why := _keep_refusal(ctx, arch)):
            return why
        cfg = text_hparams(ctx.src_config)
        if arch.refusal is not None and (why := arch.refusal(cfg)):
            return why
        rope = rope_config(cfg)["rope_type"]
        if rope not in (*arch.ropes, None):
            return (f"config.json: rope_type {rope!r} is not one this target writes for llama.cpp's {arch.name} "
                    f"({', '.join(arch.ropes)})")
        for lin in ctx.precision.fp8.values():
            return (f"{lin.module}: {lin.kind} ({lin.scale} {lin.scale_dtype}) has no GGUF type (GGUF has no FP8 "
                    "scheme); --to ct or --to quark carry it")
        for u in ctx.units:
            if why := self._unit_refusal(u, ctx, arch):
                return why
        return (precision_refusal(ctx, "GGUF", fp8_block=False, fp8=False) or tokenizer_refusal(ctx.read_file)
                or _vocab_refusal(ctx))

    def _unit_refusal(self, u: UnitSpec, ctx: WriterContext, arch: Arch) -> str | None:
        if self._dropped(u, ctx):
            return None
        nextn = int(text_hparams(ctx.src_config).get("num_nextn_predict_layers") or 0) if arch.writes_nextn else 0
        if (layer := layer_of(u.key)) is not None and int(layer[1]) >= ctx.facts.num_layers + nextn:
            return (f"{u.key}: a layer past config.json's num_hidden_layers ({ctx.facts.num_layers}) and MTP blocks "
                    f"({nextn}), whose tensors llama.cpp's {arch.name} would not load")
        if u.kind == "moe":
            if expert_prefix(u.key, arch) is None:
                return f"{u.key}: routed experts where llama.cpp's {arch.name} has none"
            if u.extra.get("fused") and ctx.facts.model_type != "gpt_oss":
                return f"{u.key}: fused experts of {ctx.facts.model_type!r} are not converted to GGUF"
            return None
        if u.kind == "dense":
            if (r := _reshape(u, ctx)) is not None and (r.cols is not None or r.values is not None or r.parts):
                return (f"{u.key}: an FP4 Linear llama.cpp's converter splits or reorders by input columns; --to "
                        "gguf moves FP4 rows only (--to ct or --to quark carry it)")
            if gguf_name(f"{u.key}.weight", arch) is None or (arch.mla and u.key.endswith(".kv_b_proj")):
                return (f"{u.key}: an FP4 Linear llama.cpp's {arch.name} has no MXFP4 tensor for (MLA uses kv_b_proj "
                        "transposed)" if arch.mla and u.key.endswith(".kv_b_proj") else
                        f"{u.key}: an FP4 Linear llama.cpp's {arch.name} has no tensor for")
            return None
        if gguf_name(u.key, arch) is None:
            return f"{u.key}: a tensor llama.cpp's {arch.name} has no name for; --to ct or --to quark carry it"
        if (dtype := ctx.passthrough_dtypes[u.key][0]) not in ("BF16", "F16", "F32"):
            return f"{u.key}: {dtype} has no exact GGUF type; --to ct or --to quark carry it"
        return None

    def _dropped(self, spec: UnitSpec, ctx: WriterContext) -> bool:
        """What llama.cpp has no tensor for and computes without: an FP8 KV cache's scales (its cache is F16),
        DeepSeek-V3's MTP layer (past num_hidden_layers; llama.cpp's converter drops it too) and what the
        architecture's GGUF leaves out (``Arch.drop``: Qwen3.5's vision tower and MTP block)."""
        if spec.kind == "passthrough" and ctx.precision.kv_cache is not None and spec.key.endswith(_KV_SCALES):
            return True
        arch = ARCHS[ctx.facts.model_type]
        if spec.key.startswith(arch.drop):
            return True
        layer = layer_of(spec.key)
        return arch.mtp and layer is not None and int(layer[1]) >= ctx.facts.num_layers

    def _mla(self, spec: UnitSpec, ctx: WriterContext) -> bool:
        return spec.kind == "passthrough" and ARCHS[ctx.facts.model_type].mla and spec.key.endswith(
            ".self_attn.kv_b_proj.weight")

    def shard_names(self, count: int) -> list[str]:
        return ["model.gguf"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.gguf" for i in range(count)]

    def shard_metadata(self, ctx: WriterContext, split: Split | None = None) -> Any:
        if split is None or split.files == 1:
            return gguf_kvs(ctx.src_config, ctx)
        return (gguf_kvs(ctx.src_config, ctx) if split.at == 0 else []) + _split_kvs(split)

    def passthrough_name(self, name: str, ctx: WriterContext) -> str:
        out = gguf_name(name, ARCHS[ctx.facts.model_type])
        assert out is not None  # refused at planning otherwise
        return out

    def _out_dtype(self, spec: UnitSpec, ctx: WriterContext) -> str:
        dtype, shape = ctx.passthrough_dtypes[spec.key]
        return "F32" if _widened(dtype, shape, self.passthrough_name(spec.key, ctx)) else dtype

    def direct_sources(self, spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
        if spec.kind != "passthrough" or self._dropped(spec, ctx) or self._mla(spec, ctx) or (
                _reshape(spec, ctx) is not None):
            return None
        if self._out_dtype(spec, ctx) == ctx.passthrough_dtypes[spec.key][0]:
            return [spec.key]  # GGML's dims are the torch shape reversed: the same bytes
        return None

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        arch = ARCHS[ctx.facts.model_type]
        if self._dropped(spec, ctx):
            return []
        keep = ctx.target_options.keep_nvfp4
        dtype, row_bytes = ("I8", nvfp4_row_bytes) if keep else ("U8", mxfp4_row_bytes)
        if spec.kind == "moe":
            e, h, i = spec.dims
            blk = expert_prefix(spec.key, arch)
            out = [OutTensor(f"{blk}.{p}.weight", dtype, (e, n, row_bytes(k)))
                   for p, n, k in zip(_PROJ, (i, i, h), (h, h, i), strict=True)]
            if keep:
                out += [OutTensor(f"{blk}.{p}.scale", "F32", (e,)) for p in _PROJ]
            if spec.has_bias:
                out += [OutTensor(f"{blk}.{p}.bias", "F32", (e, n)) for p, n in zip(_PROJ, (i, i, h), strict=True)]
            return out
        if spec.kind == "dense":
            n, k = spec.dims
            name = gguf_name(f"{spec.key}.weight", arch)
            assert name is not None
            base = name[:-len(".weight")]
            out = [OutTensor(name, dtype, (n, row_bytes(k)))] + ([OutTensor(f"{base}.scale", "F32", (1,))] if keep else [])
            return out + ([OutTensor(f"{base}.bias", "F32", (n,))] if spec.has_bias else [])
        dtype, shape = ctx.passthrough_dtypes[spec.key]
        name = self.passthrough_name(spec.key, ctx)
        if self._mla(spec, ctx):
            cfg = ctx.src_config
            heads, nope, v, lora = (int(cfg[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim",
                                                          "kv_lora_rank"))
            return [OutTensor(name, dtype, (heads, lora, nope)),
                    OutTensor(name.replace(".attn_k_b.", ".attn_v_b."), dtype, (heads, v, lora))]
        r = _reshape(spec, ctx)
        if r is None:
            return [OutTensor(name, self._out_dtype(spec, ctx), shape)]
        names = [f"{name.rsplit('.', 2)[0]}.{part}" for part, _ in r.parts] if r.parts else [name]
        dtype = "F32" if r.values is not None else self._out_dtype(spec, ctx)
        types = [dtype] * len(names) + ["F32"] * len(r.extra)
        return [OutTensor(n, t, s) for n, t, s in zip(names + [n for n, _ in r.extra], types, r.shapes(shape),
                                                        strict=True)]

    def encode(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        from mxfp4conv.kernels.ggml_native import to_ggml_mxfp4

        if self._dropped(spec, ctx):
            return []
        r = _reshape(spec, ctx)
        if r is not None and r.rows is not None and not isinstance(unit, Passthrough):
            unit = _rows(unit, r.rows)
        if isinstance(unit, MoELayer):
            i = unit.w13.packed.shape[1] // 2
            parts = ((unit.w13, slice(0, i)), (unit.w13, slice(i, 2 * i)), (unit.w2, slice(None)))
            if unit.w13.quant == "nvfp4":
                out = [_nvfp4_blocks(w.packed[:, r], w.scales[:, r]) for w, r in parts]
                out += [_per_tensor(w, r, f"{spec.key}.{p}") for (w, r), p in zip(parts, _PROJ, strict=True)]
            else:
                _no_nan_scale(unit.w13.scales, unit.w2.scales, what=spec.key)
                out = [to_ggml_mxfp4(w.packed[:, r], w.scales[:, r]) for w, r in parts]
            if unit.w13_bias is not None and unit.w2_bias is not None:
                out += [unit.w13_bias[:, r].float() for r in (slice(0, i), slice(i, 2 * i))] + [unit.w2_bias.float()]
            return out
        if isinstance(unit, DenseFP4):
            w = unit.weight
            if w.quant == "nvfp4":
                out = [_nvfp4_blocks(w.packed, w.scales), _per_tensor(w, slice(None), unit.module)[:1]]
            else:
                _no_nan_scale(w.scales, what=unit.module)
                out = [to_ggml_mxfp4(w.packed, w.scales)]
            return out + ([unit.bias.float()] if unit.bias is not None else [])
        assert isinstance(unit, Passthrough)
        if self._mla(spec, ctx):
            return _mla_parts(unit.tensor, ctx.src_config)
        pieces = [unit.tensor] if r is None else r.apply(unit.tensor)
        return [t.float() if o.dtype == "F32" else t for o, t in zip(self.out_specs(spec, ctx), pieces, strict=True)]

    def decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        got = self._decode(spec, ctx, get)
        r = _reshape(spec, ctx)
        if r is None:
            return got
        if r.values is not None:  # not invertible: proven by ``verify_unit`` against the stated transformation
            raise ValueError(f"{spec.key}: written transformed; its source values are not recovered from the GGUF")
        if spec.kind == "passthrough":
            dtype, shape = ctx.passthrough_dtypes[spec.key]
            pieces = [get(o.name) for o in self.out_specs(spec, ctx)]
            return Passthrough(spec.key, r.undo(pieces, shape).to(torch_dtype(dtype)))
        return got if r.rows is None else _rows(got, r.rows.argsort())

    def _decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        import torch

        outs = self.out_specs(spec, ctx)
        keep = ctx.target_options.keep_nvfp4
        bias_dtype = torch_dtype(spec.extra.get("bias_dtype", "BF16"))
        if spec.kind == "moe":
            scales = [get(o.name) for o in outs[3:6]] if keep else [None, None, None]
            ws = [_weight(get(o.name), sc) for o, sc in zip(outs[:3], scales, strict=True)]
            b = [get(o.name).to(bias_dtype) for o in outs[6 if keep else 3:]]
            g, u, d = ws
            w13 = FP4Weight(g.quant, torch.cat([g.packed, u.packed], 1), torch.cat([g.scales, u.scales], 1),
                            None if g.global_rows is None or u.global_rows is None else torch.cat(
                                [g.global_rows, u.global_rows], -1))
            return MoELayer(spec.key, w13, d, torch.cat(b[:2], 1) if b else None, b[2] if b else None)
        if spec.kind == "dense":
            w = _weight(get(outs[0].name), get(outs[1].name) if keep else None)
            bias = get(outs[-1].name).to(bias_dtype) if spec.has_bias else None
            return DenseFP4(spec.key, w, bias)
        if self._mla(spec, ctx):
            return Passthrough(spec.key, _mla_join(get(outs[0].name), get(outs[1].name)))
        return Passthrough(spec.key, get(outs[0].name).to(torch_dtype(ctx.passthrough_dtypes[spec.key][0])))

    def verify_unit(self, want: Canonical, spec: UnitSpec, ctx: WriterContext, get: Getter
                    ) -> list[dict[str, str]] | None:
        """A widened tensor is the source's only if narrowing it back loses nothing: compare in F32."""
        import torch

        if self._dropped(spec, ctx):
            return []  # nothing written, nothing to compare
        r = _reshape(spec, ctx)
        if isinstance(want, MoELayer | DenseFP4) and not ctx.target_options.keep_nvfp4:
            if r is not None and r.rows is not None:
                want = _rows(want, r.rows)
                assert isinstance(want, DenseFP4)
            return self._verify_mxfp4(want, spec, ctx, get)
        if r is not None and isinstance(want, Passthrough):  # the stated moves and transformation, bit for bit
            found = []
            for o, ref in zip(self.out_specs(spec, ctx), self.encode(want, spec, ctx), strict=True):
                got = get(o.name)
                if got.shape != ref.shape or got.dtype != ref.dtype or not torch.equal(
                        got.view(torch.uint8), ref.contiguous().view(torch.uint8)):
                    found.append({"tensor": o.name, "message": "values differ from the source's as llama.cpp's "
                                                               "converter transforms them"})
            return found
        if r is not None:
            return None  # decoded (rows put back) and compared
        if not isinstance(want, Passthrough) or self._mla(spec, ctx) or (
                self._out_dtype(spec, ctx) == ctx.passthrough_dtypes[spec.key][0]):
            return None
        name = self.passthrough_name(spec.key, ctx)
        got, ref = get(name), want.tensor.float()
        if got.shape != ref.shape or got.dtype != torch.float32 or not torch.equal(got.view(torch.int32),
                                                                                  ref.view(torch.int32)):
            return [{"tensor": name, "message": "F32 values differ from the source's"}]
        return []

    def _verify_mxfp4(self, want: MoELayer | DenseFP4, spec: UnitSpec, ctx: WriterContext, get: Getter
                      ) -> list[dict[str, str]]:
        """``decode`` and the comparison in one pass per tensor (``ggml_native.differs``: each block decoded in
        registers, no decoded copy), biases compared bit for bit."""
        import torch

        from mxfp4conv.kernels.ggml_native import differs

        outs = self.out_specs(spec, ctx)
        if isinstance(want, MoELayer):
            i = want.w13.packed.shape[1] // 2
            parts = [(want.w13, slice(0, i)), (want.w13, slice(i, 2 * i)), (want.w2, slice(None))]
            weights = [(w.packed[:, r], w.scales[:, r]) for w, r in parts]
            biases = [] if want.w13_bias is None or want.w2_bias is None else [
                want.w13_bias[:, :i], want.w13_bias[:, i:], want.w2_bias]
        else:
            weights = [(want.weight.packed, want.weight.scales)]
            biases = [] if want.bias is None else [want.bias]
        found = []
        for o, (packed, scales) in zip(outs, weights, strict=False):
            if (row := differs(get(o.name), packed, scales)) is not None:
                found.append({"tensor": o.name, "message": f"{spec.key}: MXFP4 blocks of row {row} differ from the source's"})
        for o, b in zip(outs[len(weights):], biases, strict=True):
            got = get(o.name)
            if got.dtype != torch.float32 or not torch.equal(got, b.float()) or not torch.equal(got.to(b.dtype), b):
                found.append({"tensor": o.name, "message": "F32 values differ from the source's"})
        return found

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        """The metadata written into the GGUF, as its reader returns it (for the verify's comparison)."""
        from mxfp4conv.sources.gguf import kv_dict

        return kv_dict(gguf_kvs(src_config, ctx, provenance=False))
