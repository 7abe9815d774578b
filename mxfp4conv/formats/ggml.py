"""GGML's MXFP4 block (``GGML_TYPE_MXFP4``, type 39) <-> the OCP packing every MXFP4 source uses.

A GGML block is 17 bytes for 32 consecutive elements along the contraction axis: the E8M0 scale byte,
then 16 bytes where byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high
nibble. The OCP packing (compressed-tensors ``weight_packed``, GPT-OSS ``_blocks``, Quark) puts elements
``2k`` and ``2k + 1`` in byte ``k``, low nibble first. The re-layout is a nibble permutation; the scale
byte is copied as it is (ggml doubles its E2M1 table and halves the scale, so the values are the same),
and every code keeps its bits (code 8, -0, decodes to +0 in ggml: the same value).

With OCP bytes ``a = p[0:8]`` (elements 0..15) and ``b = p[8:16]`` (elements 16..31) of one block::

    g[2m]     = (a[m] & 0x0F) | (b[m] & 0x0F) << 4      # elements 2m and 2m + 16
    g[2m + 1] = (a[m] >> 4)   | (b[m] & 0xF0)           # elements 2m + 1 and 2m + 17

and back: ``a[m] = (g[2m] & 0x0F) | (g[2m+1] & 0x0F) << 4``, ``b[m] = (g[2m] >> 4) | (g[2m+1] & 0xF0)``.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "BLOCK_BYTES", "NV_BLOCK", "NV_BLOCK_BYTES", "from_ggml_mxfp4", "from_ggml_nvfp4", "to_ggml_mxfp4",
           "to_ggml_nvfp4"]

BLOCK = 32  # elements per block
BLOCK_BYTES = 17  # one E8M0 byte + 16 bytes of codes


def to_ggml_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP codes ``[..., K/2]`` uint8 and E8M0 scales ``[..., K/32]`` uint8 -> GGML blocks
    ``[..., K/32 * 17]`` uint8 (rows stay rows)."""
    nb = scales.shape[-1]
    if packed.shape[-1] != nb * 16 or packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"codes {list(packed.shape)} and scales {list(scales.shape)} are not one MXFP4 tensor")
    lead = packed.shape[:-1]
    p = packed.reshape(*lead, nb, 16)
    a, b = p[..., :8], p[..., 8:]
    out = torch.empty((*lead, nb, BLOCK_BYTES), dtype=torch.uint8, device=packed.device)
    out[..., 0] = scales
    q = out[..., 1:].unflatten(-1, (8, 2))  # [..., nb, 8, 2]: (g[2m], g[2m+1])
    torch.bitwise_or(a & 0x0F, (b & 0x0F) << 4, out=q[..., 0])
    torch.bitwise_or(a >> 4, b & 0xF0, out=q[..., 1])
    return out.reshape(*lead, nb * BLOCK_BYTES)


def from_ggml_mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML blocks ``[..., K/32 * 17]`` uint8 -> (OCP codes ``[..., K/2]``, E8M0 scales ``[..., K/32]``)."""
    if blocks.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"a row of {blocks.shape[-1]} bytes is not a whole number of {BLOCK_BYTES}-byte MXFP4 blocks")
    lead = blocks.shape[:-1]
    nb = blocks.shape[-1] // BLOCK_BYTES
    g = blocks.reshape(*lead, nb, BLOCK_BYTES)
    scales = g[..., 0].contiguous()
    even, odd = g[..., 1::2], g[..., 2::2]
    packed = torch.empty((*lead, nb, 16), dtype=torch.uint8, device=blocks.device)
    torch.bitwise_or(even & 0x0F, (odd & 0x0F) << 4, out=packed[..., :8])
    torch.bitwise_or(even >> 4, odd & 0xF0, out=packed[..., 8:])
    return packed.reshape(*lead, nb * 16), scales


NV_BLOCK = 64  # elements per GGML NVFP4 block: four sub-blocks of 16, each with its UE4M3 scale
NV_BLOCK_BYTES = 36  # four scale bytes + 32 bytes of codes


def to_ggml_nvfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP codes ``[..., K/2]`` uint8 and E4M3 block scales ``[..., K/16]`` (their bytes, uint8) -> GGML NVFP4
    blocks ``[..., K/64 * 36]`` uint8 (``GGML_TYPE_NVFP4``, type 40): per 64 elements the four scale bytes,
    then for each sub-block of 16 eight bytes where byte ``j`` holds its element ``j`` (low nibble) and
    ``j + 8`` (high). ggml reads the scale as unsigned E4M3 (its sign bit ignored) with the half convention
    that cancels its doubled E2M1 table, so a non-negative scale's values are the source's; a scale with the
    sign bit set is refused (``ValueError``)."""
    nsub = scales.shape[-1]
    if packed.shape[-1] != nsub * 8 or packed.shape[:-1] != scales.shape[:-1] or nsub % 4:
        raise ValueError(f"codes {list(packed.shape)} and scales {list(scales.shape)} are not one NVFP4 tensor of "
                         f"whole {NV_BLOCK}-element blocks")
    if bool((scales & 0x80).any()):
        raise ValueError("an E4M3 block scale with its sign bit set has no GGML NVFP4 form")
    lead = packed.shape[:-1]
    nb = nsub // 4
    p = packed.reshape(*lead, nb, 4, 8)
    a, b = p[..., :4], p[..., 4:]
    out = torch.empty((*lead, nb, NV_BLOCK_BYTES), dtype=torch.uint8, device=packed.device)
    out[..., :4] = scales.reshape(*lead, nb, 4)
    q = out[..., 4:].unflatten(-1, (4, 4, 2))  # [..., nb, sub-block, m, (g[2m], g[2m+1])]
    torch.bitwise_or(a & 0x0F, (b & 0x0F) << 4, out=q[..., 0])
    torch.bitwise_or(a >> 4, b & 0xF0, out=q[..., 1])
    return out.reshape(*lead, nb * NV_BLOCK_BYTES)


def from_ggml_nvfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML NVFP4 blocks ``[..., K/64 * 36]`` -> (OCP codes ``[..., K/2]``, E4M3 scale bytes ``[..., K/16]``)."""
    if blocks.shape[-1] % NV_BLOCK_BYTES:
        raise ValueError(f"a row of {blocks.shape[-1]} bytes is not a whole number of {NV_BLOCK_BYTES}-byte NVFP4 blocks")
    lead = blocks.shape[:-1]
    nb = blocks.shape[-1] // NV_BLOCK_BYTES
    g = blocks.reshape(*lead, nb, NV_BLOCK_BYTES)
    scales = g[..., :4].reshape(*lead, nb * 4).contiguous()
    q = g[..., 4:].reshape(*lead, nb, 4, 8)
    even, odd = q[..., 0::2], q[..., 1::2]
    packed = torch.empty((*lead, nb, 4, 8), dtype=torch.uint8, device=blocks.device)
    torch.bitwise_or(even & 0x0F, (odd & 0x0F) << 4, out=packed[..., :4])
    torch.bitwise_or(even >> 4, odd & 0xF0, out=packed[..., 4:])
    return packed.reshape(*lead, nb * 32), scales
