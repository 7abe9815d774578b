"""Third-party readers and comparisons for the producer tests (nothing here uses mxfp4conv).

Readers, each returning a float32 ``transformers`` model so that two reads can be compared
parameter by parameter and logit by logit:

* ``hf_load``: stock ``AutoModelForCausalLM.from_pretrained`` (compressed-tensors' HF quantizer
  for ``quant_method: compressed-tensors``; ``Mxfp4Config(dequantize=True)`` for native GPT-OSS),
  then the whole module cast to float32.
* ``reference_model``: compressed-tensors' own dequantizer
  (``compressed_tensors.entrypoints.convert`` ``CompressedTensorsDequantizer``) on the checkpoint's
  tensors, laid into a ``from_config`` model with the fused expert parameters transformers 5.17
  declares (Qwen3-MoE / Mixtral ``gate_up_proj [E, 2I, H]`` gate rows first, ``down_proj [E, H, I]``;
  GPT-OSS ``gate_up_proj [E, H, 2I]`` with gate/up interleaved columns, ``down_proj [E, I, H]``).
  Used where transformers cannot read a checkpoint itself (FORMATS.md "Observed" items 2 and 5).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.producers.build_fixtures import guard_torchvision_aliases

SEQ = 16
_EXPERT = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<what>weight|bias)$"
)
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


# ----------------------------------------------------------------------------- tensors / inputs
def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[k] = fh.get_tensor(k)
    return out


def input_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1234))


def logits(model: torch.nn.Module) -> torch.Tensor:
    config: Any = model.config  # a PreTrainedModel's config (nn.Module types attributes as Tensor | Module)
    ids = input_ids(config.vocab_size)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# ----------------------------------------------------------------------------- readers
def hf_load(folder: Path, *, mxfp4_dequantize: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(float32 model, loading info with the non-empty key sets) via stock transformers."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    from transformers.utils.quantization_config import Mxfp4Config

    guard_torchvision_aliases()
    kw: dict[str, Any] = {}
    if mxfp4_dequantize:
        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    elif json.loads((Path(folder) / "config.json").read_text()).get("quantization_config", {}).get("quant_method") == "compressed-tensors":
        # Without dequantize=True, FP4 *dense* Linears stay compressed (weight_packed) and decompress
        # in bf16 on every forward, so the model cannot run in float32; MoE experts are always
        # decompressed into the fused parameters. Leaves a decompressed ``weight_scale`` per Linear.
        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    with warnings.catch_warnings():  # "You passed `quantization_config` ... already has a `quantization_config`"
        warnings.filterwarnings("ignore", message=".*already has a `quantization_config`", category=UserWarning)
        # with output_loading_info=True from_pretrained returns (model, info); its annotation says model only
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                           output_loading_info=True, **kw)
    model, info = loaded
    model = torch.nn.Module.to(model, torch.float32)  # PreTrainedModel.float()/.to() refuse quantized models
    model.eval()
    return model, {k: sorted(v) for k, v in info.items() if v}


def ct_dequantize(folder: Path, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors' own dequantizer: every quantized ``M.weight_packed`` -> float32 ``M.weight``.

    Note: it computes in bf16 (``unpack_fp4_from_uint8`` defaults to bf16), which is exact for
    MXFP4 (E2M1 x 2^e) but rounds NVFP4's ``e2m1 * scale / global_scale`` to bf16.
    """
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    t = dict(load_tensors(folder) if tensors is None else tensors)
    out = CompressedTensorsDequantizer(str(folder), dtype=torch.float32).validate(t)
    return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}


def exact_nvfp4_dequantize(folder: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors NVFP4 in float32, NUMERICS.md order: (e2m1(code) * fp32(e4m3)) / global_scale.

    Codes are unpacked with compressed-tensors' own ``unpack_fp4_from_uint8`` (at float32);
    non-quantized tensors are returned as float32.
    """
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    t = load_tensors(folder)
    out: dict[str, torch.Tensor] = {}
    for k, v in t.items():
        if k.endswith(".weight_packed"):
            m = k[: -len(".weight_packed")]
            n, kh = v.shape
            codes = unpack_fp4_from_uint8(v, n, kh * 2, dtype=torch.float32)
            scale = t[f"{m}.weight_scale"].float().repeat_interleave(16, dim=1)
            out[f"{m}.weight"] = (codes * scale) / t[f"{m}.weight_global_scale"].float()
        elif not k.endswith((".weight_scale", ".weight_global_scale", ".input_global_scale")):
            out[k] = v.float()
    return out


def assemble_state_dict(model_type: str, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert dequantized ``...experts.E.{proj}.{weight,bias}`` -> transformers 5.17 fused params."""
    experts: dict[int, dict[tuple[str, int, str], torch.Tensor]] = {}
    sd: dict[str, torch.Tensor] = {}
    for k, v in dense.items():
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(int(m["layer"]), {})[(_ROLE[m["proj"]], int(m["e"]), m["what"])] = v.float()
        else:
            sd[k.replace(".block_sparse_moe.", ".mlp.")] = v.float()
    for layer, parts in experts.items():
        num = 1 + max(e for _, e, _ in parts)
        p = f"model.layers.{layer}.mlp.experts"

        def get(role: str, what: str, parts=parts, num=num) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return torch.stack([parts[(role, e, what)] for e in range(num)])

        gate, up, down = get("gate", "weight"), get("up", "weight"), get("down", "weight")
        if model_type == "gpt_oss":
            # [E, I, H] x2 -> interleaved rows [E, 2I, H] -> [E, H, 2I]; down [E, H, I] -> [E, I, H]
            sd[f"{p}.gate_up_proj"] = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()
            sd[f"{p}.down_proj"] = down.transpose(1, 2).contiguous()
            sd[f"{p}.gate_up_proj_bias"] = torch.stack([get("gate", "bias"), get("up", "bias")], dim=2).flatten(1, 2)
            sd[f"{p}.down_proj_bias"] = get("down", "bias")
        else:
            sd[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)
            sd[f"{p}.down_proj"] = down
    return sd


def reference_model(folder: Path, dense: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """float32 model from ``folder``'s config, weights = ``dense`` (default: ``ct_dequantize(folder)``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    guard_torchvision_aliases()
    cfg = AutoConfig.from_pretrained(str(folder))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = assemble_state_dict(cfg.model_type, ct_dequantize(folder) if dense is None else dense)
    want = model.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    assert set(sd) == set(want), f"reference reader key mismatch: missing {sorted(set(want) - set(sd))[:5]}, extra {sorted(set(sd) - set(want))[:5]}"
    for k, v in sd.items():
        assert v.shape == want[k].shape, f"{k}: {tuple(v.shape)} vs model {tuple(want[k].shape)}"
    model.load_state_dict(sd, strict=True)
    model.eval()
    return model


# ----------------------------------------------------------------------------- quark -> compressed-tensors
def ct_config_from_quark(q: dict[str, Any]) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` (FORMATS.md §1.4 template) equivalent to a Quark MXFP4 one."""
    g = q["global_quant_config"]
    w = g["weight"]
    assert (w["dtype"], w["qscheme"], w["group_size"], w["scale_format"]) == ("fp4", "per_group", 32, "e8m0"), w
    weights: dict[str, Any] = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
               "symmetric": True, "type": "float", "zp_dtype": None}
    acts = None
    a = g.get("input_tensors")
    if a:
        assert (a["dtype"], a["qscheme"], a["group_size"], a["is_dynamic"]) == ("fp4", "per_group", 32, True), a
        acts = {**weights, "dynamic": True, "observer": None}
    return {"config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "input_activations": acts,
                                          "output_activations": None, "targets": ["Linear"], "weights": weights}},
            "format": "mxfp4-pack-quantized", "global_compression_ratio": None, "ignore": list(q.get("exclude", [])),
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}


_QUARK_FUSED = re.compile(r"^(?P<p>.+\.experts\.\d+)\.(?P<w>w13|w2)_(?P<what>weight|weight_scale|bias)$")


def quark_to_ct(src: Path, dst: Path) -> dict[str, int]:
    """Rename a Quark MXFP4 checkpoint onto compressed-tensors names (same bytes).

    ``P.weight`` (uint8, with a uint8 ``P.weight_scale``) -> ``P.weight_packed``; GPT-OSS per-expert
    fused ``experts.E.w13_{weight,weight_scale,bias}`` (gate/up rows interleaved, vLLM
    ``_load_weights_quark``) -> ``experts.E.{gate,up}_proj.*`` (rows 0::2 / 1::2), ``w2_*`` ->
    ``down_proj.*``. Returns counts of what was renamed.
    """
    from safetensors.torch import save_file

    t = load_tensors(src)
    out: dict[str, torch.Tensor] = {}
    counts = {"packed": 0, "fused_split": 0}
    for k, v in t.items():
        m = _QUARK_FUSED.match(k)
        if m:
            suffix = {"weight": "weight_packed", "weight_scale": "weight_scale", "bias": "bias"}[m["what"]]
            if m["w"] == "w13":
                out[f"{m['p']}.gate_proj.{suffix}"] = v[0::2].contiguous()
                out[f"{m['p']}.up_proj.{suffix}"] = v[1::2].contiguous()
                counts["fused_split"] += 1
            else:
                out[f"{m['p']}.down_proj.{suffix}"] = v
            continue
        if k.endswith(".weight") and v.dtype == torch.uint8 and t.get(k + "_scale", torch.empty(0)).dtype == torch.uint8:
            out[k[: -len(".weight")] + ".weight_packed"] = v
            counts["packed"] += 1
            continue
        out[k] = v
    dst.mkdir(parents=True)
    save_file(dict(sorted(out.items())), str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "quark"
    cfg["quantization_config"] = ct_config_from_quark(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copyfile(src / extra, dst / extra)
    return counts


# ----------------------------------------------------------------------------- comparisons
def diff_state_dicts(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names whose tensors are not bit-identical (or missing on one side); [] when identical.

    ``M.weight_scale`` present on one side only is not a difference: compressed-tensors' HF loader
    keeps the decompressed scale of a dequantized dense Linear as a parameter, a from_config model
    has none (the weights themselves are compared).
    """
    sa, sb = a.state_dict(), b.state_dict()
    bad = sorted(k for k in set(sa) ^ set(sb) if not k.endswith(".weight_scale"))
    for k in sorted(set(sa) & set(sb)):
        x, y = sa[k], sb[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            bad.append(k)
    return bad


def expert_keys(model: torch.nn.Module) -> list[str]:
    return [k for k in model.state_dict() if ".experts." in k]


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref64, err = ref.double(), (ref.double() - test.double())
    e = float((err * err).sum())
    return math.inf if e == 0 else 10 * math.log10(float((ref64 * ref64).sum()) / e)


# ----------------------------------------------------------------------------- MXFP4 scale rules (NUMERICS.md)
_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e2m1_rne(q: torch.Tensor) -> torch.Tensor:
    """|q| float64 -> nearest E2M1 magnitude, ties to the even code, saturating at 6 (sign kept)."""
    a = q.abs().clamp(max=6.0)
    d = (a[..., None] - _GRID).abs()
    best = d.min(dim=-1, keepdim=True).values
    # among equally near grid points pick the even code (codes 0..7: the index in _GRID)
    idx = torch.arange(8)
    cand = (d == best) & (idx % 2 == 0)
    none_even = ~cand.any(-1, keepdim=True)
    cand = cand | ((d == best) & none_even)
    code = torch.where(cand, idx, 99).min(dim=-1).values
    return torch.copysign(_GRID[code], q)


def mx_quantize(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent model of NUMERICS.md MXFP4 quantization of float32 ``x [..., K]``.

    Returns (dequantized float64 [..., K], per-block exponent [..., K/32]). For ``mse`` the block
    errors are plain float64 sums (not the contract's sequential fold), so blocks whose two
    candidate errors differ by less than ~1e-12 relative are reported by ``mse_near_ties``.
    """
    xb = x.double().reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1)
    zero = amax == 0
    safe = torch.where(zero, torch.ones_like(amax), amax)
    floor_l2 = torch.floor(torch.log2(safe))

    def deq(e: torch.Tensor) -> torch.Tensor:
        s = torch.pow(2.0, e)[..., None]
        return _e2m1_rne(xb / s) * s

    rceil = torch.ceil(torch.log2(safe / 6.0))
    if rule == "floor":
        e = floor_l2 - 2
    elif rule == "even":
        m = safe / torch.pow(2.0, floor_l2)  # mantissa in [1, 2)
        e = floor_l2 - 2 + (m >= 1.75).double()
    elif rule == "rceil":
        e = rceil
    elif rule == "mse":
        ea, eb = rceil.clamp(-127, 127), (rceil - 1).clamp(-127, 127)
        da, db = deq(ea), deq(eb)
        err_a, err_b = ((xb - da) ** 2).sum(-1), ((xb - db) ** 2).sum(-1)
        e = torch.where(err_b < err_a, eb, ea)
    else:
        raise ValueError(rule)
    e = torch.where(zero, torch.zeros_like(e), e.clamp(-127, 127))
    return deq(e).reshape(x.shape), e


def mse_near_ties(x: torch.Tensor, rel: float = 1e-12) -> torch.Tensor:
    """[..., K/32] bool: blocks where the two MSE candidates' errors are within ``rel``."""
    xb = x.double().reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1).clamp(min=1e-300)
    rceil = torch.ceil(torch.log2(amax / 6.0))
    errs = []
    for e in (rceil, rceil - 1):
        s = torch.pow(2.0, e)[..., None]
        errs.append(((xb - _e2m1_rne(xb / s) * s) ** 2).sum(-1))
    return (errs[0] - errs[1]).abs() <= rel * torch.maximum(errs[0], errs[1]).clamp(min=1e-300)
