"""The machinery the split-expert layouts share (compressed-tensors, ModelOpt, Quark, DeepSeek-V4).

Each quantized Linear is a set of tensors named by ``LinearRoles``; ``plan_split_layout`` groups a
checkpoint's tensors into MoE, dense FP4 and passthrough units from headers alone, and
``read_split_unit`` reads one unit into the canonical model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from mxfp4conv.errors import InputError
from mxfp4conv.files.safetensors import TensorRef, read_many, tensor_view
from mxfp4conv.layouts.base import EXPERT_RE, Plan, Problem, natural_key
from mxfp4conv.model.canonical import (
    Canonical,
    DenseFP4,
    FP4Weight,
    ModelFacts,
    MoELayer,
    Passthrough,
    UnitSpec,
)
from mxfp4conv.sources.checkpoint import Checkpoint

__all__ = ["DEEPSEEK_V4_MXFP4", "LinearRoles", "expert_group", "plan_split_layout", "read_split_unit"]

_GATE_UP_DOWN = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


@dataclass(frozen=True)
class LinearRoles:
    """Tensor suffixes of one quantized Linear in a split layout."""

    packed: str  # "weight_packed" (compressed-tensors) or "weight" (ModelOpt)
    scale: str  # "weight_scale"
    scale_dtype: str  # "U8" (E8M0) or "F8_E4M3"
    group: int  # 32 or 16
    quant: str  # "mxfp4" | "nvfp4"
    global_scale: str | None = None  # "weight_global_scale" (divisor) / "weight_scale_2" (multiplier)
    global_is_divisor: bool = False
    input_scale: str | None = None  # "input_global_scale" / "input_scale" / "input_scale_2"
    packed_dtypes: tuple[str, ...] = ("U8",)  # DeepSeek-V4 stores packed E2M1 as I8
    global_dtypes: tuple[str, ...] = ("F32",)  # Quark NVFP4 allows a bf16 scalar

    def partners(self) -> tuple[str, ...]:
        return tuple(s for s in (self.scale, self.global_scale) if s)

    def owned(self) -> tuple[str, ...]:
        return tuple(s for s in (self.packed, self.scale, self.global_scale, self.input_scale, "bias") if s)


# DeepSeek-V4's native MXFP4 experts: packed E2M1 as I8 ``weight``, E8M0 block scales as F8_E8M0 ``scale``
DEEPSEEK_V4_MXFP4 = LinearRoles(packed="weight", scale="scale", scale_dtype="F8_E8M0", group=32, quant="mxfp4",
                                packed_dtypes=("I8", "U8"))


def _is_fp4_primary(ref: TensorRef, roles: LinearRoles, tensors: dict[str, TensorRef]) -> bool:
    if ref.dtype not in roles.packed_dtypes or len(ref.shape) < 2:
        return False
    module = ref.name[: -len(roles.packed) - 1]
    # A ModelOpt "weight" is FP4 only when its block scale is there; a bare uint8 weight with no
    # partner is reported as a missing partner by the caller only if a scale-like sibling exists.
    return roles.packed != "weight" or f"{module}.{roles.scale}" in tensors


def _check_linear(ckpt: Checkpoint, module: str, roles: LinearRoles, problems: list[Problem],
                  n: int | None = None, k: int | None = None) -> tuple[int, int] | None:
    """Validate one quantized Linear's tensors; returns (N, K) when consistent."""
    t = ckpt.tensors
    packed = t[f"{module}.{roles.packed}"]
    file = ckpt.rel(packed.file)
    if len(packed.shape) != 2:
        problems.append(Problem(packed.name, file, f"packed FP4 weight must be 2-D [N, K/2], got {list(packed.shape)}"))
        return None
    rows, kk = packed.shape[0], packed.shape[1] * 2
    if packed.dtype not in ("U8", "I8"):
        problems.append(Problem(packed.name, file, f"packed FP4 weight must be uint8 (two codes per byte), got {packed.dtype}"))
        return None
    ok = True
    for suffix in roles.partners():
        if f"{module}.{suffix}" not in t:
            problems.append(Problem(f"{module}.{suffix}", file, f"missing partner tensor of {packed.name}"))
            ok = False
    if not ok:
        return None
    scale = t[f"{module}.{roles.scale}"]
    sfile = ckpt.rel(scale.file)
    if scale.dtype != roles.scale_dtype:
        problems.append(Problem(scale.name, sfile, f"scale dtype {scale.dtype}, layout requires {roles.scale_dtype}"))
        ok = False
    if kk % roles.group or list(scale.shape) != [rows, kk // roles.group]:
        problems.append(Problem(scale.name, sfile, f"scale shape {list(scale.shape)} does not match packed weight "
                                f"{list(packed.shape)} (expected [{rows}, {kk // roles.group}], one per {roles.group})"))
        ok = False
    if roles.global_scale:
        g = t[f"{module}.{roles.global_scale}"]
        if g.dtype not in roles.global_dtypes or math.prod(g.shape) != 1:
            problems.append(Problem(g.name, ckpt.rel(g.file), f"global scale must be one "
                                    f"{' or '.join(roles.global_dtypes)} value, got {g.dtype}{list(g.shape)}"))
            ok = False
    bias = t.get(f"{module}.bias")
    if bias is not None and list(bias.shape) != [rows]:
        problems.append(Problem(bias.name, ckpt.rel(bias.file), f"bias shape {list(bias.shape)}, expected [{rows}]"))
        ok = False
    if n is not None and rows != n:
        problems.append(Problem(packed.name, file, f"has {rows} output rows, expected {n}"))
        ok = False
    if k is not None and kk != k:
        problems.append(Problem(packed.name, file, f"has K = {kk} input columns, expected {k}"))
        ok = False
    return (rows, kk) if ok else None


def plan_split_layout(ckpt: Checkpoint, layout: str, roles: LinearRoles, facts: ModelFacts,
                      fused: Callable[[Checkpoint, set[str], list[Problem], list[UnitSpec]], None] | None = None,
                      also: tuple[LinearRoles, ...] = ()) -> Plan:
    """Group a split-expert checkpoint's tensors into MoE, dense FP4 and passthrough units.

    ``also``: further FP4 naming schemes in the same checkpoint (NVIDIA's DeepSeek-V4 NVFP4 release keeps
    V4-native MXFP4 experts in its MTP layers); their units record the scheme's index as ``extra["roles"]``.
    """
    tensors = ckpt.tensors
    problems: list[Problem] = []
    units: list[UnitSpec] = []
    consumed: set[str] = set()
    for index, r in enumerate((roles, *also)):
        found = _plan_roles(ckpt, r, facts, problems, consumed, fused if index == 0 else None)
        units += [dataclasses.replace(u, extra={**u.extra, "roles": str(index)}) if index else u for u in found]
    for name in sorted((n for n in tensors if n not in consumed), key=natural_key):  # keys of the few left only
        units.append(UnitSpec("passthrough", name, (name,)))
    units.sort(key=lambda u: natural_key(u.key))
    return Plan(layout, facts, units, problems)


def _plan_roles(ckpt: Checkpoint, roles: LinearRoles, facts: ModelFacts, problems: list[Problem], consumed: set[str],
                fused: Callable[[Checkpoint, set[str], list[Problem], list[UnitSpec]], None] | None) -> list[UnitSpec]:
    """The MoE and dense FP4 units of one naming scheme; their tensors join ``consumed``."""
    tensors = ckpt.tensors
    units: list[UnitSpec] = []
    suffix = "." + roles.packed
    primaries = sorted(n for n, r in tensors.items() if n.endswith(suffix) and n not in consumed
                       and _is_fp4_primary(r, roles, tensors))
    experts: dict[str, dict[int, dict[str, str]]] = {}
    for name in primaries:
        module = name[: -len(suffix)]
        m = EXPERT_RE.match(f"{module}.x")
        if m:
            role, file = _GATE_UP_DOWN[m["proj"]], ckpt.rel(tensors[name].file)
            if m["e"] != str(int(m["e"])):  # "01", non-ASCII digits: the reader rebuilds names from int ids
                problems.append(Problem(name, file, f"expert id {m['e']!r} is not a plain decimal number"))
                continue
            slot = experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})
            if role in slot:  # e.g. both gate_proj and w1
                problems.append(Problem(name, file, f"expert {m['e']} has a second {role} projection (also {slot[role]})"))
                continue
            slot[role] = module
            continue
        nk = _check_linear(ckpt, module, roles, problems)
        owned = [f"{module}.{s}" for s in roles.owned() if f"{module}.{s}" in tensors]
        consumed.update(owned)
        if nk:
            units.append(UnitSpec("dense", module, tuple(owned), nk, f"{module}.bias" in tensors,
                                  {"bias_dtype": tensors[f"{module}.bias"].dtype} if f"{module}.bias" in tensors else {}))
    if fused:
        fused(ckpt, consumed, problems, units)
    for prefix in sorted(experts, key=natural_key):
        unit = _plan_moe(ckpt, prefix, experts[prefix], roles, facts, problems, consumed)
        if unit:
            units.append(unit)
    return units


def _plan_moe(ckpt: Checkpoint, prefix: str, by_expert: dict[int, dict[str, str]], roles: LinearRoles,
              facts: ModelFacts, problems: list[Problem], consumed: set[str]) -> UnitSpec | None:
    ids = sorted(by_expert)
    any_mod = next(iter(by_expert[ids[0]].values()))
    file = ckpt.rel(ckpt.tensors[f"{any_mod}.{roles.packed}"].file)
    num = facts.num_experts or (ids[-1] + 1)
    # The first absent id is found within len(ids) + 1 steps, whatever num_experts config.json claims.
    missing = next((e for e in range(num) if e not in by_expert), None)
    extra = [e for e in ids if e >= num]
    if missing is not None or extra:
        bad = missing if missing is not None else extra[0]
        what = f"expert {bad} is missing" if missing is not None else f"expert id {bad} is beyond num_experts={num}"
        problems.append(Problem(f"{prefix}.{bad}", file, f"{what} (experts must be 0..{num - 1}, found {len(ids)})"))
        return None
    h, i = facts.hidden_size or None, facts.intermediate_size or None
    ok = True
    sources: list[str] = []
    bias_dtype = ""
    has_bias = None
    first = {r: m.rsplit(".", 1)[1] for r, m in by_expert[ids[0]].items()}  # the reader uses expert 0's names
    for e in range(num):
        projs = by_expert[e]
        for role in ("gate", "up", "down"):
            if role not in projs:
                problems.append(Problem(f"{prefix}.{e}.{role}", file, f"expert {e} has no {role} projection"))
                ok = False
                continue
            module = projs[role]
            if module.rsplit(".", 1)[1] != first.get(role, module.rsplit(".", 1)[1]):
                problems.append(Problem(f"{module}.{roles.packed}", file, f"expert {e} names its {role} projection "
                                        f"{module.rsplit('.', 1)[1]!r}, expert {ids[0]} {first[role]!r}"))
                ok = False
                continue
            nk = _check_linear(ckpt, module, roles, problems, *((i, h) if role != "down" else (h, i)))
            if nk is None:
                ok = False
                continue
            if role == "gate" and (h is None or i is None):
                i, h = nk
            owned = [f"{module}.{s}" for s in roles.owned() if f"{module}.{s}" in ckpt.tensors]
            consumed.update(owned)
            sources.extend(owned)
            b = ckpt.tensors.get(f"{module}.bias")
            if has_bias is None:
                has_bias = b is not None
            elif has_bias != (b is not None):
                problems.append(Problem(f"{module}.bias", file, "some expert projections have a bias and some do not"))
                ok = False
            if b is not None:
                if bias_dtype and b.dtype != bias_dtype:
                    problems.append(Problem(b.name, ckpt.rel(b.file), f"bias dtype {b.dtype}, other experts' {bias_dtype}"))
                    ok = False
                bias_dtype = b.dtype
    if not ok or h is None or i is None:
        return None
    extra_info = {"gate": by_expert[0]["gate"].rsplit(".", 1)[1], "up": by_expert[0]["up"].rsplit(".", 1)[1],
                  "down": by_expert[0]["down"].rsplit(".", 1)[1]}
    if bias_dtype:
        extra_info["bias_dtype"] = bias_dtype
    return UnitSpec("moe", prefix, tuple(sources), (num, h, i), bool(has_bias), extra_info)


def expert_group(spec: UnitSpec, first: int, stop: int) -> UnitSpec:
    """Experts ``first .. stop - 1`` of a split MoE unit, as a unit of their own: it reads, requantizes
    and encodes to those experts' part of the whole unit's results (a fused unit has no such part)."""
    if spec.kind != "moe" or spec.extra.get("fused") or not spec.first <= first < stop <= spec.experts.stop:
        raise ValueError(f"{spec.key}: no split expert group {first}..{stop - 1}")
    at = len(spec.key) + 1
    ids = [s[at:].split(".", 1)[0] if s.startswith(spec.key + ".") else "" for s in spec.sources]
    if not all(i.isdigit() for i in ids):  # a tensor of the layer's, not of one expert's
        raise ValueError(f"{spec.key}: a source is not an expert's own")
    sources = tuple(s for s, i in zip(spec.sources, ids, strict=True) if first <= int(i) < stop)
    return dataclasses.replace(spec, sources=sources, dims=(stop - first, *spec.dims[1:]), first=first)


def unit_groups(spec: UnitSpec) -> dict[str, list[list[str]]]:
    """The modules of a moe or dense unit's FP4 weights, by canonical weight: ``w13`` (every expert's
    gate, then every expert's up: gate rows, then up rows) and ``w2`` (down), or a dense ``weight``."""
    if spec.kind == "dense":
        return {"weight": [[spec.key]]}
    mods = {r: [f"{spec.key}.{e}.{spec.extra[r]}" for e in spec.experts] for r in ("gate", "up", "down")}
    return {"w13": [mods["gate"], mods["up"]], "w2": [mods["down"]]}


def weight_refs(ckpt: Checkpoint, groups: list[list[str]], roles: LinearRoles) -> tuple[list[TensorRef], list[TensorRef], int, list[int]]:
    """The packed and block-scale tensors of ``groups`` (group-major), the modules per group and each
    group's rows: what ``stack_plan`` lays out."""
    t = ckpt.tensors
    refs = [[t[f"{m}.{roles.packed}"] for m in g] for g in groups]
    srefs = [t[f"{m}.{roles.scale}"] for g in groups for m in g]
    return [r for g in refs for r in g], srefs, len(groups[0]), [r[0].shape[0] for r in refs]


def _weight(ckpt: Checkpoint, groups: list[list[str]], roles: LinearRoles, device: str | None = None,
            reads: list[tuple[TensorRef, memoryview]] | None = None) -> FP4Weight:
    """The FP4 tensors of ``groups`` of modules: module e of every group stacked as ``[E, ...]`` and
    the groups concatenated along the rows (gate then up: w13). Bytes are read straight into the
    result (no per-module tensors, no stack or cat copies); block scales are checked once, on the
    whole result, and a NaN is then traced back to its source tensor. ``device``: a CUDA device that
    NVFP4 stacks are read onto (they are requantized there; the global scales stay on the host).
    ``reads``: host reads are queued there instead of made, and the scales are checked by the caller
    once they are (``_checked_scales``), so that a unit's weights are read in one call."""
    import torch

    t = ckpt.tensors
    prefs, srefs, num, rows = weight_refs(ckpt, groups, roles)
    onto = device if roles.quant == "nvfp4" else None
    packed = _stack_into(ckpt, prefs, num, rows, onto, reads)
    scales = _stack_into(ckpt, srefs, num, rows, onto, reads)
    if reads is None:
        scales = _checked_scales(ckpt, srefs, roles, scales)
    global_rows = None
    if roles.global_scale:
        parts = []
        for mods, n in zip(groups, rows, strict=True):
            gs = torch.stack([_checked_global(ckpt, t[f"{m}.{roles.global_scale}"]) for m in mods])
            parts.append(gs[:, None].expand(-1, n))
        global_rows = torch.cat(parts, dim=1).contiguous()
    return FP4Weight(roles.quant, packed, scales, global_rows, roles.global_is_divisor)  # type: ignore[arg-type]


def _checked_scales(ckpt: Checkpoint, srefs: list[TensorRef], roles: LinearRoles, scales: torch.Tensor) -> torch.Tensor:
    """A weight's block scales as read: a NaN E4M3 scale is traced back to its source tensor; E4M3
    bytes are viewed as ``float8_e4m3fn``."""
    import torch

    from mxfp4conv.formats.fp4 import e4m3_has_nan

    if roles.scale_dtype != "F8_E4M3":
        return scales
    if e4m3_has_nan(scales):
        for ref in srefs:
            _checked_scale(ckpt, ref, roles)
    return scales.view(torch.float8_e4m3fn)


def stack_plan(ckpt: Checkpoint, refs: list[TensorRef], num: int, rows: list[int]) -> tuple[tuple[int, int, int], list[tuple[TensorRef, int]]]:
    """Where each of ``refs`` (2-D one-byte tensors, group-major) goes in a uint8 ``[num, sum(rows),
    cols]`` stack: group j's module e fills rows ``sum(rows[:j]) .. + rows[j]`` of slot e. Returns the
    stack's shape and each tensor's byte offset in it; a tensor whose shape differs from its
    partners' is an ``InputError``."""
    first = refs[0]
    cols = first.shape[1]
    total = sum(rows)
    at: list[tuple[TensorRef, int]] = []
    r0 = 0
    for j, n in enumerate(rows):
        for e in range(num):
            ref = refs[j * num + e]
            if ref.shape != (n, first.shape[1]) or ref.dtype != first.dtype:
                raise InputError(f"shape {list(ref.shape)} {ref.dtype} differs from its partners' "
                                 f"{[n, first.shape[1]]} {first.dtype}", file=ckpt.rel(ref.file), tensor=ref.name,
                                 hint="the checkpoint is inconsistent; re-export it")
            at.append((ref, (e * total + r0) * cols))
        r0 += n
    return (num, total, cols), at


def _stack_into(ckpt: Checkpoint, refs: list[TensorRef], num: int, rows: list[int], device: str | None,
                reads: list[tuple[TensorRef, memoryview]] | None = None) -> torch.Tensor:
    """uint8 ``[num, sum(rows), cols]`` from 2-D one-byte tensors (``stack_plan``). On ``device``
    (CUDA) when given, read there through small pinned buffers (``files/device_read``); ``reads``: a
    host stack's reads are queued there, not made."""
    import torch

    shape, at = stack_plan(ckpt, refs, num, rows)
    out = torch.empty(shape, dtype=torch.uint8, device=device)
    if device is not None:
        from mxfp4conv.files.device_read import read_to_device

        read_to_device(at, out)
    else:
        flat = tensor_view(out.view(-1)) if out.numel() else memoryview(b"")
        todo = [(ref, flat[off:off + ref.nbytes]) for ref, off in at]
        if reads is None:
            read_many(todo)  # every tensor, in parallel runs
        else:
            reads += todo
    return out


def _checked_scale(ckpt: Checkpoint, ref: TensorRef, roles: LinearRoles) -> torch.Tensor:
    """NVFP4 E4M3 block scales must not be NaN (0x7F/0xFF): the error names the source tensor."""
    import torch

    raw = ref.load()
    if roles.scale_dtype == "F8_E4M3":
        bad = (raw.view(torch.uint8) & 0x7F) == 0x7F
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            raise InputError(f"E4M3 block scale is NaN at index {at}", file=ckpt.rel(ref.file), tensor=ref.name,
                             hint="the checkpoint is corrupt; re-export it")
    return raw


def _checked_global(ckpt: Checkpoint, ref: TensorRef) -> torch.Tensor:
    """An NVFP4 per-tensor (global) scale must be finite and non-zero."""
    g = ref.load().reshape(()).float()
    v = float(g)
    if not math.isfinite(v) or v == 0.0:
        raise InputError(f"global scale is {v}; it must be finite and non-zero", file=ckpt.rel(ref.file),
                         tensor=ref.name, hint="the checkpoint is corrupt; re-export it")
    return g


def read_split_unit(ckpt: Checkpoint, spec: UnitSpec, roles: LinearRoles, *, device: str | None = None) -> Canonical:
    """One unit's tensors in canonical form; ``device``: the CUDA device its NVFP4 stacks are read onto."""
    import torch

    t = ckpt.tensors
    if spec.kind == "passthrough":
        return Passthrough(spec.key, t[spec.key].load())
    groups = unit_groups(spec)
    if spec.kind == "dense":
        w = _weight(ckpt, groups["weight"], roles, device)
        one = FP4Weight(w.quant, w.packed[0], w.scales[0], None if w.global_rows is None else w.global_rows[0],
                        w.global_is_divisor)
        bias = t[f"{spec.key}.bias"].load() if spec.has_bias else None
        return DenseFP4(spec.key, one, bias)
    # host stacks are read in one call: the unit's tensors follow each other in its shard, and
    # ranges next to each other are read together (``files/safetensors.runs``)
    reads: list[tuple[TensorRef, memoryview]] | None = [] if device is None else None
    w13 = _weight(ckpt, groups["w13"], roles, device, reads)  # gate rows, then up rows
    down = _weight(ckpt, groups["w2"], roles, device, reads)
    if reads is not None:
        read_many(reads)
        del reads
        w13 = dataclasses.replace(w13, scales=_checked_scales(ckpt, weight_refs(ckpt, groups["w13"], roles)[1], roles, w13.scales))
        down = dataclasses.replace(down, scales=_checked_scales(ckpt, weight_refs(ckpt, groups["w2"], roles)[1], roles, down.scales))
    w13_bias = w2_bias = None
    if spec.has_bias:
        gate, up = groups["w13"]
        w13_bias = torch.cat([torch.stack([t[f"{m}.bias"].load() for m in mods]) for mods in (gate, up)], dim=-1)
        w2_bias = torch.stack([t[f"{m}.bias"].load() for m in groups["w2"][0]])
    return MoELayer(spec.key, w13, down, w13_bias, w2_bias)
