"""What every output target provides, and helpers the split-expert writers share.

A writer never opens files: ``out_specs`` declares the output tensors of a unit from its
``UnitSpec`` alone (for shard planning and --dry-run), ``encode`` produces them from the
canonical unit in the same order, ``decode`` maps written tensors back to the canonical model
(for verify), and ``config`` builds the output config.json.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

from mxfp4conv.files.safetensors import ITEMSIZE, SAFETENSORS, Container
from mxfp4conv.model.canonical import (
    Canonical,
    DenseFP4,
    FP4Weight,
    ModelFacts,
    MoELayer,
    Passthrough,
    UnitSpec,
)
from mxfp4conv.model.precision import PrecisionModel

__all__ = ["OutTensor", "Split", "SplitTarget", "Target", "TargetOptions", "WriterContext", "split_names"]

Getter = Callable[[str], "torch.Tensor"]


def _no_file(name: str) -> bytes | None:
    return None


class Split(NamedTuple):
    """Which file of a rank's output a shard is: ``at`` (from 0) of ``files``, ``tensors`` in all of them."""

    at: int
    files: int
    tensors: int


class OutTensor(NamedTuple):
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class TargetOptions:
    """The target options of a conversion. Their string form (``as_strings``) is what manifests record
    (``--skip-if-current`` compares it)."""

    tp_size: int = 1
    tp_rank: int = 0
    engine: str = "vllm"  # "vllm" | "sglang"
    marlin_act: str = "bf16"  # "bf16" | "fp8"
    keep_nvfp4: bool = False
    quark_activations: str | None = None  # "mxfp4" | "none" | None (follow the source's scheme)

    def as_strings(self) -> dict[str, str]:
        """The string form of the command's options (a rank's ``tp_rank`` is the rank folder's)."""
        out = {"tp_size": str(self.tp_size), "engine": self.engine}
        if self.marlin_act != "bf16":
            out["marlin_act"] = self.marlin_act
        if self.keep_nvfp4:
            out["keep_nvfp4"] = "1"
        if self.quark_activations is not None:
            out["quark_activations"] = self.quark_activations
        return out

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> TargetOptions:
        """The options from their string form (a manifest's)."""
        return cls(tp_size=int(options.get("tp_size", "1")), tp_rank=int(options.get("tp_rank", "0")),
                   engine=options.get("engine", "vllm"), marlin_act=options.get("marlin_act", "bf16"),
                   keep_nvfp4=options.get("keep_nvfp4") == "1", quark_activations=options.get("quark_activations"))


@dataclass(frozen=True)
class WriterContext:
    """What a writer may know beyond one unit: facts, source layout, the whole plan, options."""

    facts: ModelFacts
    layout: str
    units: Sequence[UnitSpec]
    passthrough_dtypes: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    target_options: TargetOptions = field(default_factory=TargetOptions)
    precision: PrecisionModel = field(default_factory=PrecisionModel)
    src_config: Mapping[str, Any] = field(default_factory=dict)  # SRC's config.json
    source: str = ""  # SRC's Hub repo id, else its folder's name (targets that record where they come from)
    source_is_repo: bool = False
    # SRC's other top-level files by name (tokenizer files, for targets that embed them), None when absent
    read_file: Callable[[str], bytes | None] = _no_file

    def for_rank(self, rank: int) -> WriterContext:
        """This context for tensor-parallel rank ``rank``."""
        return dataclasses.replace(self, target_options=dataclasses.replace(self.target_options, tp_rank=rank))


class Target:
    """Base class with the passthrough behaviour shared by every target."""

    NAME = ""
    # ``encode`` takes a unit whose weights are on a GPU and returns views and device tensors the
    # shard writer copies back itself (``device.device_write``); else GPU results come back to the host first
    ENCODES_ON_DEVICE = False
    # a MoE unit's ``decode`` reads per-expert names "<key>.<e>.<...>" or fused [E, ...] tensors, so the
    # proof decodes a group of experts at a time from a narrower spec (names or rows shifted)
    DECODES_EXPERT_GROUPS = False
    # a MoE unit's outputs are each expert's own tensors, expert after expert, encoded from that expert
    # alone: a group of experts (``UnitSpec.first``) encodes to a run of the unit's outputs
    EXPERT_MAJOR = False
    # model.safetensors.index.json is written for one shard too (mlx-lm's save_model always writes it)
    ALWAYS_INDEX = False
    # the shards' file format (safetensors, or GGUF's container)
    CONTAINER: Container = SAFETENSORS
    # a Hugging Face folder: config.json, the index and SRC's other files beside the shards
    HF_FOLDER = True

    def refuse(self, ctx: WriterContext) -> str | None:
        """Why this (source, target) pair makes no sense, or None."""
        return None

    def ranks(self, ctx: WriterContext) -> list[int]:
        """Tensor-parallel ranks written (one output folder each); runtime-native targets write one."""
        return [0]

    def rank_folder(self, rank: int, ctx: WriterContext) -> str:
        return ""

    def shard_metadata(self, ctx: WriterContext, split: Split | None = None) -> Any:
        """What the container's header holds besides the tensors (safetensors' ``__metadata__``)."""
        return {"format": "pt"}

    def shard_names(self, count: int) -> list[str]:
        """The files of a rank's output of ``count`` shards."""
        if count == 1:
            return ["model.safetensors"]
        return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

    def direct_sources(self, spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
        """For each output tensor (``out_specs`` order), the source tensor holding exactly its bytes,
        when the whole unit is a byte-for-byte rename; None otherwise. Lets the pipeline copy byte
        ranges without decoding them (lossless fast path)."""
        return [spec.key] if spec.kind == "passthrough" else None

    def direct_parts(self, spec: UnitSpec, ctx: WriterContext) -> list[tuple[str, ...]] | None:
        """For each output tensor, the source tensors whose bytes, one after the other, are exactly its
        bytes (several where the target stacks them); None when the unit needs decoding. By default
        ``direct_sources``, one source tensor each."""
        names = self.direct_sources(spec, ctx)
        return None if names is None else [(n,) for n in names]

    def slice_for_rank(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> Canonical:
        """The canonical part of ``unit`` a rank's output holds (all of it for single-rank targets)."""
        return unit

    def passthrough_name(self, name: str, ctx: WriterContext) -> str:
        """The output name of a tensor carried byte for byte (the source's, unless the target's config
        syntax names that tensor differently)."""
        return name

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        dtype, shape = ctx.passthrough_dtypes[spec.key]
        return [OutTensor(self.passthrough_name(spec.key, ctx), dtype, shape)]

    def encode(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        assert isinstance(unit, Passthrough)
        return [unit.tensor]

    def decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        return Passthrough(spec.key, get(self.passthrough_name(spec.key, ctx)))

    def verify_unit(self, want: Canonical, spec: UnitSpec, ctx: WriterContext, get: Getter
                    ) -> list[dict[str, str]] | None:
        """Differences between ``want`` (what SRC yields) and what DST holds, for targets whose bytes do not
        decode uniquely; None (the default) proves the unit by ``decode`` and a byte comparison."""
        return None

    def config(self, src_config: dict[str, object], ctx: WriterContext) -> dict[str, object]:
        raise NotImplementedError


def split_names(ctx: WriterContext) -> tuple[str, str, str]:
    """Per-expert (gate, up, down) names the architecture's vLLM loader maps (FORMATS.md §2.2)."""
    if ctx.facts.model_type in ("mixtral", "minimax_m2", "minimax", "deepseek_v4"):
        return ("w1", "w3", "w2")
    return ("gate_proj", "up_proj", "down_proj")


def moe_split_specs(spec: UnitSpec, ctx: WriterContext, packed: str, scale: str) -> list[OutTensor]:
    _, h, i = spec.dims
    g, u, d = split_names(ctx)
    bias_dtype = spec.extra.get("bias_dtype", "BF16")
    out: list[OutTensor] = []
    for e in spec.experts:
        for proj, n, k in ((g, i, h), (u, i, h), (d, h, i)):
            base = f"{spec.key}.{e}.{proj}"
            out += [OutTensor(f"{base}.{packed}", "U8", (n, k // 2)), OutTensor(f"{base}.{scale}", "U8", (n, k // 32))]
            if spec.has_bias:
                out.append(OutTensor(f"{base}.bias", bias_dtype, (n,)))
    return out


def moe_split_encode(unit: MoELayer) -> list[torch.Tensor]:
    e_num, two_i = unit.w13.packed.shape[0], unit.w13.packed.shape[1]
    i = two_i // 2
    out: list[torch.Tensor] = []
    for e in range(e_num):
        for w, b, rows in ((unit.w13, unit.w13_bias, slice(0, i)), (unit.w13, unit.w13_bias, slice(i, two_i)),
                           (unit.w2, unit.w2_bias, slice(None))):
            out += [w.packed[e, rows], w.scales[e, rows]]
            if b is not None:
                out.append(b[e, rows])
    return out


def moe_split_decode(spec: UnitSpec, ctx: WriterContext, get: Getter, packed: str, scale: str) -> MoELayer:
    import torch

    g, u, d = split_names(ctx)

    def stack(proj: str, suffix: str) -> torch.Tensor:
        import torch

        return torch.stack([get(f"{spec.key}.{e}.{proj}.{suffix}") for e in spec.experts])

    w13 = FP4Weight("mxfp4", torch.cat([stack(g, packed), stack(u, packed)], 1),
                    torch.cat([stack(g, scale), stack(u, scale)], 1))
    w2 = FP4Weight("mxfp4", stack(d, packed), stack(d, scale))
    b13 = torch.cat([stack(g, "bias"), stack(u, "bias")], 1) if spec.has_bias else None
    b2 = stack(d, "bias") if spec.has_bias else None
    return MoELayer(spec.key, w13, w2, b13, b2)


def dense_specs(spec: UnitSpec, packed: str, scale: str) -> list[OutTensor]:
    n, k = spec.dims
    out = [OutTensor(f"{spec.key}.{packed}", "U8", (n, k // 2)), OutTensor(f"{spec.key}.{scale}", "U8", (n, k // 32))]
    if spec.has_bias:
        out.append(OutTensor(f"{spec.key}.bias", spec.extra.get("bias_dtype", "BF16"), (n,)))
    return out


def dense_encode(unit: DenseFP4) -> list[torch.Tensor]:
    out = [unit.weight.packed, unit.weight.scales]
    return out + ([unit.bias] if unit.bias is not None else [])


def dense_decode(spec: UnitSpec, get: Getter, packed: str, scale: str) -> DenseFP4:
    bias = get(f"{spec.key}.bias") if spec.has_bias else None
    return DenseFP4(spec.key, FP4Weight("mxfp4", get(f"{spec.key}.{packed}"), get(f"{spec.key}.{scale}")), bias)


# Split MXFP4 layouts whose per-Linear tensors are the output's bytes: (packed, scale) suffixes.
_SPLIT_MXFP4 = {"ct-mxfp4": ("weight_packed", "weight_scale"), "quark-mxfp4": ("weight", "weight_scale")}


def split_direct_sources(spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
    """Output -> source names when a split MXFP4 unit is only renamed (per-expert or dense)."""
    if ctx.layout not in _SPLIT_MXFP4 or spec.extra.get("fused"):
        return None
    packed, scale = _SPLIT_MXFP4[ctx.layout]
    if spec.kind == "dense":
        return [f"{spec.key}.{packed}", f"{spec.key}.{scale}"] + ([f"{spec.key}.bias"] if spec.has_bias else [])
    if spec.kind != "moe":
        return None
    src = (spec.extra["gate"], spec.extra["up"], spec.extra["down"])
    out = []
    for e in spec.experts:
        for proj in src:
            base = f"{spec.key}.{e}.{proj}"
            out += [f"{base}.{packed}", f"{base}.{scale}"] + ([f"{base}.bias"] if spec.has_bias else [])
    return out


class SplitTarget(Target):
    """Per-expert split tensors ``<experts>.E.<proj>.{PACKED, weight_scale, bias}`` and dense
    ``<module>.{PACKED, weight_scale, bias}``: what compressed-tensors and Quark share."""

    PACKED = "weight_packed"
    SCALE = "weight_scale"
    ENCODES_ON_DEVICE = True  # per-expert row views
    EXPERT_MAJOR = True

    def direct_sources(self, spec: UnitSpec, ctx: WriterContext) -> list[str] | None:
        if spec.kind == "passthrough":
            return super().direct_sources(spec, ctx)
        return split_direct_sources(spec, ctx)

    def out_specs(self, spec: UnitSpec, ctx: WriterContext) -> list[OutTensor]:
        if spec.kind == "moe":
            return moe_split_specs(spec, ctx, self.PACKED, self.SCALE)
        if spec.kind == "dense":
            return dense_specs(spec, self.PACKED, self.SCALE)
        return super().out_specs(spec, ctx)

    def encode(self, unit: Canonical, spec: UnitSpec, ctx: WriterContext) -> list[torch.Tensor]:
        if isinstance(unit, MoELayer):
            return moe_split_encode(unit)
        if isinstance(unit, DenseFP4):
            return dense_encode(unit)
        return super().encode(unit, spec, ctx)

    def decode(self, spec: UnitSpec, ctx: WriterContext, get: Getter) -> Canonical:
        if spec.kind == "moe":
            return moe_split_decode(spec, ctx, get, self.PACKED, self.SCALE)
        if spec.kind == "dense":
            return dense_decode(spec, get, self.PACKED, self.SCALE)
        return super().decode(spec, ctx, get)
