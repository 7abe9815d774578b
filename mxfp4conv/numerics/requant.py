"""NVFP4 -> MXFP4 requantization (docs/NUMERICS.md) of a whole weight, chunked, with per-tensor statistics.

Its rows go through the CPU path (``requant_cpu.requant_rows_cpu``) or the GPU kernel
(``mxfp4conv.kernels.requant_triton``), which agree byte for byte on the row-level contract of
``requant_stats``; the statistics are folded in row order (``RequantStats``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from mxfp4conv.formats.fp4 import e4m3_bits
from mxfp4conv.formats.mxfp4 import MX_BLOCK, ScaleRule
from mxfp4conv.formats.nvfp4 import validate_nvfp4_scales
from mxfp4conv.model.canonical import FP4Weight
from mxfp4conv.numerics.requant_cpu import requant_rows_cpu
from mxfp4conv.numerics.requant_stats import RequantStats

__all__ = ["fits_on_device", "requant_nvfp4_to_mxfp4"]

# rows per chunk of a weight: the CPU's workers meet once per chunk (the statistics are folded
# there), the GPU's chunked driver streams at least GPU_MIN_CHUNK_ROWS at a time
DEFAULT_CHUNK_ROWS = 1 << 17


GPU_MIN_CHUNK_ROWS = 1 << 17


# A weight is requantized whole on the GPU when its bytes are at most 1/RESIDENT_SHARE of the device's
# memory: its input, its output, the output's copy gathered for the writer, the post-write check's
# second requantization, the next unit's read and the previous unit's output still being written
# (device/device_write) take six such shares at most; a larger one streams through in bounded row chunks.
RESIDENT_SHARE = 8


def fits_on_device(nbytes: int, device: str) -> bool:
    """Whether a weight of ``nbytes`` (packed codes and block scales) is requantized whole on ``device``."""
    if not torch.cuda.is_available():
        return False
    return nbytes * RESIDENT_SHARE <= torch.cuda.get_device_properties(torch.device(device)).total_memory


def _requant_resident(w: FP4Weight, rule: ScaleRule, device: str, keep: bool = False,
                      keep_rows: bool = False) -> tuple[FP4Weight, RequantStats]:
    """The GPU path for a weight that fits on the device: moved there unless read there already,
    requantized in one launch. With ``keep`` the results stay on the device (the shard writer copies
    them back a few MB at a time: ``device.device_write``); else they are copied back into one exact-size
    page-locked buffer of the pool (``device.pinned.HostSlabs``). The scales are validated from the row
    maxima computed on the device, before anything is returned."""
    from mxfp4conv.device.pinned import host_slabs
    from mxfp4conv.kernels.requant_triton import requant_rows

    assert w.global_rows is not None
    lead, kh = tuple(w.packed.shape[:-1]), int(w.packed.shape[-1])
    k = 2 * kh
    dev = torch.device(device)
    with torch.cuda.device(dev):
        p = w.packed.reshape(-1, kh).to(dev)
        sc = e4m3_bits(w.scales).reshape(-1, k // 16).to(dev)
        g = w.global_rows.reshape(-1).float().to(dev)
        po, so, st = requant_rows(p, sc, g, w.global_is_divisor, rule)
        row_max = torch.amax(torch.bitwise_and(sc, 0x7F), dim=1).cpu().view(lead)
        if keep:
            host_st = st.cpu()
            problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor, row_max=row_max)
            if problem is not None:
                raise ValueError(f"invalid NVFP4 input: {problem}")
            stats = RequantStats.from_row_stats(host_st, k // MX_BLOCK, keep_rows)
            return FP4Weight("mxfp4", po.view(*lead, kh), so.view(*lead, k // MX_BLOCK)), stats
        # one buffer: row statistics first (8-byte aligned), then codes, then scales
        n_st, n_p, n_s = st.numel() * 8, po.numel(), so.numel()
        slab = host_slabs().take(n_st + n_p + n_s)
        host_st = slab[:n_st].view(torch.float64).view(st.shape)
        host_p = slab[n_st:n_st + n_p].view(po.shape)
        host_s = slab[n_st + n_p:].view(so.shape)
        for dst, src in ((host_st, st), (host_p, po), (host_s, so)):
            dst.copy_(src)
    problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor, row_max=row_max)
    if problem is not None:
        raise ValueError(f"invalid NVFP4 input: {problem}")
    stats = RequantStats.from_row_stats(host_st, k // MX_BLOCK, keep_rows)
    return FP4Weight("mxfp4", host_p.view(*lead, kh), host_s.view(*lead, k // MX_BLOCK)), stats


def requant_nvfp4_to_mxfp4(
    w: FP4Weight,
    rule: ScaleRule = ScaleRule.MSE,
    device: str = "cpu",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    keep_on_device: bool = False,
    keep_rows: bool = False,
) -> tuple[FP4Weight, RequantStats]:
    """Requantize an NVFP4 weight ``[..., N, K]`` to MXFP4, ``chunk_rows`` rows at a time.

    Leading dims and N are flattened into rows; each chunk goes through ``requant_rows_cpu`` or, when
    ``device`` starts with "cuda", on the GPU: whole when it fits there (``fits_on_device``; the input
    may already be on the device), else ``mxfp4conv.kernels.requant_triton.requant_nvfp4_gpu_chunks``
    (chunks of at least ``GPU_MIN_CHUNK_ROWS`` rows stream through the device; results in pinned host memory). Raises ``ValueError`` on invalid input. Returns the MXFP4 weight
    (uint8 packed ``[..., N, K/2]``, E8M0 scales ``[..., N, K/32]``, on the CPU) and the statistics.
    ``keep_on_device``: a
    weight requantized whole on a GPU returns its results there (the same bytes, not copied back).
    ``keep_rows``: the statistics keep their rows, so that an earlier group of the same weight's experts
    can be continued with them (``RequantStats.then``).
    """
    if w.quant != "nvfp4" or w.global_rows is None:
        raise ValueError("requant_nvfp4_to_mxfp4 needs an NVFP4 weight with global_rows")
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be >= 1")
    rule = ScaleRule(rule)
    k = 2 * int(w.packed.shape[-1])
    if k % MX_BLOCK:
        raise ValueError(f"K={k} is not a multiple of {MX_BLOCK}")
    if device.startswith("cuda"):
        if w.packed.numel() and fits_on_device(w.packed.numel() + w.scales.numel(), device):
            return _requant_resident(w, rule, device, keep_on_device, keep_rows)
        return _requant_gpu_chunked(w, rule, device, chunk_rows, keep_rows)
    return _requant_cpu(w, rule, chunk_rows, keep_rows)


def _requant_gpu_chunked(w: FP4Weight, rule: ScaleRule, device: str, chunk_rows: int,
                         keep_rows: bool) -> tuple[FP4Weight, RequantStats]:
    """A weight too large for the device whole: row chunks streamed through it."""
    from mxfp4conv.kernels.requant_triton import requant_nvfp4_gpu_chunks

    assert w.global_rows is not None
    k = 2 * int(w.packed.shape[-1])
    # H2D, kernel and D2H of row chunks overlap on three streams; outputs land in pinned memory.
    # The scales are validated after the run from the row maxima the device computed (the
    # kernel is harmless on invalid input; nothing is returned before the check)
    row_max = torch.empty(tuple(w.scales.shape[:-1]), dtype=torch.uint8)
    p, sc, st = requant_nvfp4_gpu_chunks(w.packed.contiguous(), w.scales.contiguous(),
                                         w.global_rows.float().contiguous(), w.global_is_divisor, rule,
                                         device=device, chunk_rows=max(chunk_rows, GPU_MIN_CHUNK_ROWS),
                                         scale_row_max=row_max)
    problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor, row_max=row_max)
    if problem is not None:
        raise ValueError(f"invalid NVFP4 input: {problem}")
    stats = RequantStats.from_row_stats(st.reshape(-1, st.shape[-1]), k // MX_BLOCK, keep_rows)
    return FP4Weight("mxfp4", p, sc), stats


def _requant_cpu(w: FP4Weight, rule: ScaleRule, chunk_rows: int, keep_rows: bool) -> tuple[FP4Weight, RequantStats]:
    """On the CPU: row chunks on one pool of workers, written straight into the weight's outputs."""
    assert w.global_rows is not None
    lead, kh = tuple(w.packed.shape[:-1]), int(w.packed.shape[-1])
    k = 2 * kh
    problem = validate_nvfp4_scales(w.scales, w.global_rows, divisor=w.global_is_divisor)
    if problem is not None:
        raise ValueError(f"invalid NVFP4 input: {problem}")
    packed = w.packed.reshape(-1, kh)
    scales = w.scales.reshape(-1, k // 16)
    grows = w.global_rows.reshape(-1).float()
    r = packed.shape[0]
    stats = RequantStats(keep_rows=keep_rows)
    out = torch.empty(r, kh, dtype=torch.uint8)
    scales_out = torch.empty(r, k // MX_BLOCK, dtype=torch.uint8)
    n_threads = int(os.environ.get("MXFP4CONV_CPU_THREADS", "0")) or torch.get_num_threads()
    with ThreadPoolExecutor(max(1, n_threads)) as pool:
        for r0 in range(0, r, chunk_rows):
            r1 = min(r, r0 + chunk_rows)
            st = torch.zeros(r1 - r0, 5, dtype=torch.float64)
            requant_rows_cpu(packed[r0:r1], scales[r0:r1], grows[r0:r1], w.global_is_divisor, rule,
                             threads=n_threads, into=(out[r0:r1], scales_out[r0:r1], st), pool=pool)
            stats.add_rows(st, k // MX_BLOCK)
    mx = FP4Weight("mxfp4", out.view(*lead, kh), scales_out.view(*lead, k // MX_BLOCK))
    return mx, stats
