"""The one internal model every input layout reads into and every writer encodes from.

Conventions (FORMATS.md §0, §2.1):

* A Linear weight is ``[N, K]`` (out x in); K is the packed axis. FP4 codes are packed two per
  byte along K, element ``2i`` in the low nibble.
* MoE experts are fused per layer: ``w13`` is ``[E, 2I, H/2]`` with **gate rows first, then up
  rows** (vLLM's w1/w3 shard order, never interleaved here); ``w2`` is ``[E, H, I/2]``.
  Readers of interleaved layouts (GPT-OSS) de-interleave; writers of interleaved layouts
  re-interleave.
* MXFP4 scales are raw E8M0 bytes (uint8). NVFP4 block scales are float8_e4m3fn and the
  per-tensor second-level scale is kept **per row** (``global_rows``, float32 ``[..., N]``), so
  gate and up halves keep their own value, with ``global_is_divisor`` telling how it is applied
  (compressed-tensors divides, ModelOpt multiplies: FORMATS.md §1.2).

Nothing here does I/O or numerics beyond shape checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "DenseFP4",
    "FP4Weight",
    "MoELayer",
    "ModelFacts",
    "Passthrough",
    "Unit",
    "UnitSpec",
]

Quant = Literal["mxfp4", "nvfp4"]


@dataclass
class FP4Weight:
    """One FP4 matrix (or a stack of them along leading dims) in MXFP4 or NVFP4.

    Shapes, for a ``[..., N, K]`` weight:
      * ``packed``: uint8 ``[..., N, K/2]``
      * ``scales``: MXFP4 uint8 ``[..., N, K/32]`` (E8M0); NVFP4 float8_e4m3fn ``[..., N, K/16]``
      * ``global_rows`` (NVFP4 only): float32 ``[..., N]``
      * ``input_scale`` (NVFP4 W4A4 only, informational): float32 ``[...]`` per row group
    """

    quant: Quant
    packed: torch.Tensor
    scales: torch.Tensor
    global_rows: torch.Tensor | None = None
    global_is_divisor: bool = False

    @property
    def n(self) -> int:
        return int(self.packed.shape[-2])

    @property
    def k(self) -> int:
        return int(self.packed.shape[-1]) * 2


@dataclass
class MoELayer:
    """A layer's routed experts, fused: ``w13`` gate-then-up rows, ``w2`` down."""

    prefix: str  # source module path of the experts container, e.g. "model.layers.0.mlp.experts"
    w13: FP4Weight  # [E, 2I, H/2]
    w2: FP4Weight  # [E, H, I/2]
    w13_bias: torch.Tensor | None = None  # [E, 2I], gate then up, source dtype
    w2_bias: torch.Tensor | None = None  # [E, H]


@dataclass
class DenseFP4:
    """An FP4 Linear that is not a routed expert (attention projection, dense MLP, shared expert)."""

    module: str  # e.g. "model.layers.0.self_attn.q_proj"
    weight: FP4Weight  # [N, K/2]
    bias: torch.Tensor | None = None


@dataclass
class Passthrough:
    """A tensor copied byte for byte (norms, router, embeddings, lm_head, bf16 layers)."""

    name: str
    tensor: torch.Tensor


Canonical = MoELayer | DenseFP4 | Passthrough


@dataclass(frozen=True)
class ModelFacts:
    """What a writer needs to know about the model beyond the tensors."""

    model_type: str
    architecture: str
    scheme: str  # "w4a16" | "w4a4"
    source_quant: Quant
    num_layers: int
    num_experts: int
    hidden_size: int
    intermediate_size: int
    # Names of the per-expert projections in the source: (gate, up, down), e.g. ("gate_proj",
    # "up_proj", "down_proj") or ("w1", "w3", "w2"); ("gate_up_proj", "gate_up_proj", "down_proj")
    # for fused sources.
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    activation: str = "silu"  # "silu" | "swigluoai" (GPT-OSS)
    ignore: tuple[str, ...] = ()  # modules the source left unquantized, as module names / patterns


@dataclass(frozen=True)
class UnitSpec:
    """A unit of work, declared from headers alone: what it reads and what kind it is.

    ``sources`` maps a role (e.g. "e3.gate.packed", "w13.scales", "tensor") to the source tensor
    name; the layout that made the spec knows how to read it.
    """

    kind: Literal["moe", "dense", "passthrough"]
    key: str  # moe: experts prefix; dense: module name; passthrough: tensor name
    sources: tuple[str, ...]
    # For moe: E, H, I; for dense: N, K; for passthrough: ().
    dims: tuple[int, ...] = ()
    has_bias: bool = False
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    # For moe: the first of its dims[0] experts (a group of a layer's experts: ``experts``)
    first: int = 0

    @property
    def experts(self) -> range:
        """A moe spec's expert ids."""
        return range(self.first, self.first + self.dims[0])


Unit = tuple[UnitSpec, Canonical]
