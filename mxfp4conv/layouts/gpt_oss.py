"""``gpt-oss``: native GPT-OSS MXFP4 (FORMATS.md §3).

Per MoE layer: ``experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16], ``_scales`` [E, 2I, H/32],
``_bias`` [E, 2I] with gate/up rows INTERLEAVED (row 2j = gate_j, 2j+1 = up_j), and
``experts.down_proj_{blocks,scales,bias}``. The reader de-interleaves weights, scales and biases
alike into the canonical gate-then-up order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from mxfp4conv.errors import InputError
from mxfp4conv.layouts.base import Plan, Problem, config_facts, natural_key
from mxfp4conv.model.canonical import Canonical, FP4Weight, MoELayer, Passthrough, UnitSpec
from mxfp4conv.model.precision import Declared, fnmatch_to_re
from mxfp4conv.sources.checkpoint import Checkpoint

NAME = "gpt-oss"
CONFIG_FILES: tuple[str, ...] = ()
READS_EXPERT_GROUPS = False  # fused [E, ...] tensors: a MoE unit is read whole
_PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
          "down_proj_blocks", "down_proj_scales", "down_proj_bias")


def detect(ckpt: Checkpoint) -> list[str] | None:
    ev: list[str] = []
    q = ckpt.config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4":
        ev.append("config.json quantization_config.quant_method = mxfp4")
    marker = next((n for n in ckpt.tensors if n.endswith(".gate_up_proj_blocks")), None)
    if marker:
        ev.append(f"tensor {marker}")
    return ev or None


def deinterleave_rows(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] -> [g0, g1, ..., u0, u1, ...] along ``dim``."""
    import torch

    n = x.shape[dim]
    idx = torch.cat([torch.arange(0, n, 2, device=x.device), torch.arange(1, n, 2, device=x.device)])
    return x.index_select(dim, idx)


def interleave_rows(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of ``deinterleave_rows``."""
    import torch

    n = x.shape[dim]
    half = n // 2
    idx = torch.stack([torch.arange(half, device=x.device), torch.arange(half, device=x.device) + half], dim=1).reshape(-1)
    return x.index_select(dim, idx)


def declared(ckpt: Checkpoint) -> Declared:
    """``modules_to_not_convert`` name modules and everything under them (transformers matches prefixes)."""
    q = ckpt.config.get("quantization_config")
    keep = q.get("modules_to_not_convert") if isinstance(q, dict) else None
    return Declared(unquantized=tuple(fnmatch_to_re(str(x), children=True) for x in keep or ()))


def plan(ckpt: Checkpoint) -> Plan:
    q = ckpt.config.get("quantization_config")
    ignore = q.get("modules_to_not_convert") if isinstance(q, dict) else None
    problems: list[Problem] = []
    if ignore is not None and not (isinstance(ignore, list) and all(isinstance(x, str) for x in ignore)):
        raise InputError(f"quantization_config.modules_to_not_convert must be a list of module patterns, "
                         f"got {type(ignore).__name__}", file=str(ckpt.root / "config.json"),
                         hint="restore config.json from the original release")
    facts = config_facts(ckpt.config, scheme="w4a16", quant="mxfp4", expert_names=("gate_up_proj", "gate_up_proj", "down_proj"),
                         ignore=tuple(str(x) for x in ignore or ()))
    t = ckpt.tensors
    units: list[UnitSpec] = []
    consumed: set[str] = set()
    for name in sorted(n for n in t if n.endswith((".gate_up_proj_blocks", ".down_proj_blocks"))):
        prefix = name.rsplit(".", 1)[0]
        if prefix in {u.key for u in units} or any(p.tensor.startswith(prefix + ".") for p in problems):
            continue
        names = [f"{prefix}.{p}" for p in _PARTS]
        file = ckpt.rel(t[name].file)
        missing = [n for n in names if n not in t]
        if missing:
            problems.append(Problem(missing[0], file, f"missing partner tensor of {name}"))
            continue
        gb, gs, gbias, db, ds, dbias = (t[n] for n in names)
        dims = _check(gb, gs, gbias, db, ds, dbias, facts.num_experts, facts.hidden_size, facts.intermediate_size)
        if isinstance(dims, str):
            problems.append(Problem(name, file, dims))
            continue
        consumed.update(names)
        units.append(UnitSpec("moe", prefix, tuple(names), dims, True, {"bias_dtype": gbias.dtype}))
    for name in t:
        if name not in consumed:
            units.append(UnitSpec("passthrough", name, (name,)))
    units.sort(key=lambda u: natural_key(u.key))
    return Plan(NAME, facts, units, problems)


def _check(gb, gs, gbias, db, ds, dbias, e_cfg: int, h_cfg: int, i_cfg: int) -> tuple[int, int, int] | str:  # type: ignore[no-untyped-def]
    if len(gb.shape) != 4 or gb.shape[3] != 16 or len(db.shape) != 4 or db.shape[3] != 16:
        return f"blocks must be [E, rows, K/32, 16], got {list(gb.shape)} and {list(db.shape)}"
    e, two_i, hb = gb.shape[:3]
    h, i = hb * 32, two_i // 2
    want = {gs.name: [e, two_i, hb], gbias.name: [e, two_i], db.name: [e, h, i // 32, 16], ds.name: [e, h, i // 32],
            dbias.name: [e, h]}
    for ref in (gs, gbias, db, ds, dbias):
        if list(ref.shape) != want[ref.name]:
            return f"{ref.name} has shape {list(ref.shape)}, expected {want[ref.name]} from {gb.name} {list(gb.shape)}"
    for ref in (gb, gs, db, ds):
        if ref.dtype != "U8":
            return f"{ref.name} has dtype {ref.dtype}, expected U8"
    for ref in (gbias, dbias):
        if ref.dtype not in ("BF16", "F16", "F32") or ref.dtype != gbias.dtype:
            return f"{ref.name} has dtype {ref.dtype}; expert biases must share one float dtype ({gbias.dtype})"
    if (e_cfg and e != e_cfg) or (h_cfg and h != h_cfg) or (i_cfg and i != i_cfg):
        return (f"experts [E={e}, H={h}, I={i}] disagree with config.json (num_local_experts={e_cfg}, "
                f"hidden_size={h_cfg}, intermediate_size={i_cfg})")
    return (e, h, i)


def read(ckpt: Checkpoint, spec: UnitSpec, *, device: str | None = None) -> Canonical:
    """One unit in canonical form (``device`` is ignored: GPT-OSS weights are MXFP4, never requantized)."""
    t = ckpt.tensors
    if spec.kind == "passthrough":
        return Passthrough(spec.key, t[spec.key].load())
    e, h, i = spec.dims
    gb, gs, gbias, db, ds, dbias = (t[n].load() for n in spec.sources)
    w13 = FP4Weight("mxfp4", deinterleave_rows(gb.reshape(e, 2 * i, h // 2)), deinterleave_rows(gs))
    w2 = FP4Weight("mxfp4", db.reshape(e, h, i // 2), ds)
    return MoELayer(spec.key, w13, w2, deinterleave_rows(gbias), dbias)
