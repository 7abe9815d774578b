"""The row-level requant contract (docs/NUMERICS.md): its statistics, their fold, and the plain reference.

Row-level contract shared by the CPU path (``requant_rows_cpu``) and the GPU kernel
(``mxfp4conv.kernels.requant_triton.requant_rows``), which must agree byte for byte::

    requant_rows(packed [R, K/2] uint8, scales_e4m3 [R, K/16] float8_e4m3fn (or uint8 bits),
                 global_rows [R] float32, divisor: bool, rule: ScaleRule)
        -> (packed_out [R, K/2] uint8, scales_out [R, K/32] uint8 (E8M0),
            row_stats [R, 5] float64 = (sq_err, signal, max_abs_err, clipped_blocks, exact_blocks))

i.e. ``quantize_mxfp4_with_stats(dequantize_nvfp4(...), rule, requant_groups(packed))`` with the block
statistics folded per row: float32 block sums in group order (NUMERICS.md "Block statistics"), sq_err /
signal summed in the 8 lanes of "Row sums", max_abs_err the max, the two counts; MSE's choice is exact
("MSE decision").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from mxfp4conv.formats.fp4 import unpack_nibbles
from mxfp4conv.formats.mxfp4 import MX_BLOCK, ScaleRule, quantize_mxfp4_with_stats
from mxfp4conv.formats.nvfp4 import dequantize_nvfp4

__all__ = [
    "ROW_LANES",
    "ROW_STATS",
    "RequantStats",
    "check_rows",
    "requant_groups",
    "requant_rows_reference",
    "row_stats",
]

ROW_STATS = ("sq_err", "signal", "max_abs_err", "clipped_blocks", "exact_blocks")  # row_stats columns


def _seq_fold(acc: float, vals: torch.Tensor) -> float:
    """``acc + v0 + v1 + ...`` in float64, strictly in order (CPU cumsum is a sequential scan)."""
    if vals.numel() == 0:
        return acc
    return float(torch.cat((vals.new_tensor([acc]), vals.double().cpu())).cumsum(0)[-1])


@dataclass
class RequantStats:
    """Requantization statistics of one tensor (or several, merged). See NUMERICS.md."""

    blocks: int = 0
    clipped_blocks: int = 0
    exact_blocks: int = 0
    sq_err: float = 0.0
    signal: float = 0.0
    max_abs_err: float = 0.0
    # with ``keep_rows``, the row statistics added, with their blocks per row: what ``then`` folds on
    keep_rows: bool = field(default=False, repr=False, compare=False)
    rows: list[tuple[torch.Tensor, int]] = field(default_factory=list, repr=False, compare=False)

    @property
    def sqnr_db(self) -> float | None:
        """``10 log10(signal / sq_err)``; None when sq_err == 0 (exact)."""
        if self.sq_err == 0:
            return None
        if self.signal == 0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.sq_err)

    @classmethod
    def from_row_stats(cls, row_stats: torch.Tensor, blocks_per_row: int, keep_rows: bool = False) -> RequantStats:
        """Fold ``[R, 5]`` row statistics in row order."""
        out = cls(keep_rows=keep_rows)
        out.add_rows(row_stats, blocks_per_row)
        return out

    def add_rows(self, row_stats: torch.Tensor, blocks_per_row: int) -> None:
        """Continue the fold with more rows ``[R, 5]`` (in row order, after those already added)."""
        rs = row_stats.double().cpu()
        if self.keep_rows:
            self.rows.append((rs.clone(), blocks_per_row))  # ``row_stats`` may be a reused buffer's view
        self.blocks += int(rs.shape[0]) * blocks_per_row
        self.sq_err = _seq_fold(self.sq_err, rs[:, 0])
        self.signal = _seq_fold(self.signal, rs[:, 1])
        if rs.shape[0]:
            self.max_abs_err = max(self.max_abs_err, float(rs[:, 2].max()))
        self.clipped_blocks += int(rs[:, 3].sum())
        self.exact_blocks += int(rs[:, 4].sum())

    def then(self, later: RequantStats) -> RequantStats:
        """These statistics continued with the rows of ``later`` (made with ``keep_rows``), the next rows
        of the same weight: bit for bit the fold of all of them in order (``merge`` adds two totals)."""
        out = dataclasses.replace(self, keep_rows=False, rows=[])
        for rs, per in later.rows:
            out.add_rows(rs, per)
        return out

    def merge(self, other: RequantStats) -> RequantStats:
        """Statistics of self followed by other (sums in that order)."""
        return RequantStats(
            blocks=self.blocks + other.blocks,
            clipped_blocks=self.clipped_blocks + other.clipped_blocks,
            exact_blocks=self.exact_blocks + other.exact_blocks,
            sq_err=self.sq_err + other.sq_err,
            signal=self.signal + other.signal,
            max_abs_err=max(self.max_abs_err, other.max_abs_err),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats become None)."""

        def fin(v: float | None) -> float | None:
            return v if v is not None and math.isfinite(v) else None

        return {
            "blocks": self.blocks,
            "clipped_blocks": self.clipped_blocks,
            "exact_blocks": self.exact_blocks,
            "sq_err": fin(self.sq_err),
            "signal": fin(self.signal),
            "max_abs_err": fin(self.max_abs_err),
            "sqnr_db": fin(self.sqnr_db),
        }


def check_rows(packed: torch.Tensor, scales: torch.Tensor, global_rows: torch.Tensor) -> int:
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 [R, K/2], got {packed.dtype} {tuple(packed.shape)}")
    r, kh = packed.shape
    k = 2 * kh
    if k % MX_BLOCK:
        raise ValueError(f"K={k} is not a multiple of {MX_BLOCK}")
    if tuple(scales.shape) != (r, k // 16) or tuple(global_rows.shape) != (r,):
        raise ValueError(
            f"scales {tuple(scales.shape)} / global_rows {tuple(global_rows.shape)} do not match "
            f"packed {tuple(packed.shape)}"
        )
    return k


ROW_LANES = 8  # row sums: block j of a row is summed in lane j % 8 (NUMERICS.md "Row sums")


def _lane_sum(v: torch.Tensor) -> torch.Tensor:
    """[r, NB] float64 -> [r]: lane t (blocks t, t + 8, t + 16, ...) summed in block order from 0,
    then the 8 lane sums added in lane order from 0 (CPU cumsum of float64 is a sequential scan)."""
    r, nb = v.shape
    pad = -nb % ROW_LANES
    if pad:
        v = torch.cat((v, v.new_zeros(r, pad)), 1)  # adding +0 to a lane sum changes nothing
    lanes = torch.cat((v.new_zeros(r, 1, ROW_LANES), v.view(r, -1, ROW_LANES)), 1).cumsum(1)[:, -1]
    return torch.cat((v.new_zeros(r, 1), lanes), 1).cumsum(1)[:, -1]


def row_stats(
    err: torch.Tensor, sig: torch.Tensor, mx: torch.Tensor, clipped: torch.Tensor, exact: torch.Tensor
) -> torch.Tensor:
    """Per-block [r, NB] -> [r, 5] float64: sq_err and signal by ``_lane_sum``, the max, the counts."""
    return torch.stack(
        (
            _lane_sum(err),
            _lane_sum(sig),
            mx.amax(1),
            clipped.sum(1, dtype=torch.float64),
            exact.sum(1, dtype=torch.float64),
        ),
        dim=1,
    )


def requant_rows_reference(
    packed: torch.Tensor,
    scales_e4m3: torch.Tensor,
    global_rows: torch.Tensor,
    divisor: bool,
    rule: ScaleRule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row-level contract written as the plain composition (slow; CPU tensors): dequantize the
    whole ``[R, K]`` slab to float32, quantize it elementwise. Same signature and results as
    ``requant_rows_cpu``; the tests and the benchmark use it as the reference."""
    k = check_rows(packed, scales_e4m3, global_rows)
    x = dequantize_nvfp4(packed, scales_e4m3, global_rows, divisor=divisor)
    out, scales, st = quantize_mxfp4_with_stats(x, rule, requant_groups(packed))
    if k == 0:
        return out, scales, torch.zeros(packed.shape[0], 5, dtype=torch.float64)
    return out, scales, row_stats(st.sq_err, st.signal, st.max_abs_err, st.clipped, st.exact)


def requant_groups(packed: torch.Tensor) -> torch.Tensor:
    """Group id of every element of NVFP4 rows ``[R, K/2]`` -> uint8 ``[R, K]``: ``half * 8 +
    magnitude code``, half = which 16-element NVFP4 block of its 32-block (``block_sum``)."""
    mag = unpack_nibbles(packed) & 7
    half = (torch.arange(mag.shape[-1]) % MX_BLOCK >= 16).to(torch.uint8) * 8
    return mag | half
