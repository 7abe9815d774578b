"""Value tables of the FP8 scale formats, in plain Python (no torch): ``formats/fp4.py`` builds its
tensors from them."""

from __future__ import annotations

__all__ = ["E4M3_BIAS", "E4M3_VALUES"]

E4M3_BIAS = 7


def _e4m3_table() -> list[float]:
    out: list[float] = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            out.append(float("nan"))
        elif e == 0:
            out.append(sign * m * 2.0 ** (1 - E4M3_BIAS - 3))  # subnormal: m/8 * 2^-6
        else:
            out.append(sign * (1.0 + m / 8.0) * 2.0 ** (e - E4M3_BIAS))
    return out


E4M3_VALUES: tuple[float, ...] = tuple(_e4m3_table())  # the value of each E4M3 bit pattern (exact in float32)
