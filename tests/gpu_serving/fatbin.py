"""Zero the GPU machine code of other architectures inside a shared library's ``.nv_fatbin`` section.

A CUDA fatbin holds one ELF (machine code, one architecture) or PTX entry per kernel image. vLLM's
wheel carries ELF images for every architecture it supports; an H200 runs only the sm_90 ones (or
PTX, compiled by the driver). Overwriting the other ELF payloads with zeros keeps every size and
offset (the library loads and links as before) and makes the file compress to about a third.
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KIND = {1: "PTX", 2: "ELF"}


def fatbin_section(path: Path) -> tuple[int, int]:
    """(file offset, size) of ``.nv_fatbin`` (readelf)."""
    out = subprocess.check_output(["readelf", "-S", "-W", str(path)], text=True)
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            f = line.split("]", 1)[1].split()
            return int(f[3], 16), int(f[4], 16)
    raise ValueError(f"{path}: no .nv_fatbin section")


def entries(data: bytes | bytearray, off: int, size: int) -> list[tuple[int, int, str, int]]:
    """(payload offset, payload size, kind, sm arch) of every entry of every fatbin in the section."""
    out: list[tuple[int, int, str, int]] = []
    p, end_sec = off, off + size
    while p < end_sec - 16:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8
            continue
        q, end = p + hsz, p + hsz + fsz
        while q < end:
            kind, _u, ehs, psz = struct.unpack_from("<HHIQ", data, q)
            arch = struct.unpack_from("<I", data, q + 28)[0]
            out.append((q + ehs, psz, KIND.get(kind, str(kind)), arch))
            q += ehs + psz
        p = end
    return out


def zero_foreign(src: Path, dst: Path, keep_arch: int = 90) -> dict[str, int]:
    """Write ``src`` to ``dst`` with every ELF image not for ``keep_arch`` zeroed; byte counts by kind."""
    off, size = fatbin_section(src)
    data = bytearray(src.read_bytes())
    stats: Counter[str] = Counter()
    for start, psz, kind, arch in entries(data, off, size):
        if kind == "ELF" and arch != keep_arch:
            data[start:start + psz] = bytes(psz)
            stats["zeroed"] += psz
        else:
            stats[f"kept {kind} sm_{arch}"] += psz
    dst.write_bytes(data)
    return dict(stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--keep-arch", type=int, default=90)
    a = ap.parse_args()
    print(zero_foreign(a.src, a.dst, a.keep_arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
