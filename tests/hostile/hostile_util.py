"""Helpers shared by the hostile-input tests: CLI subprocesses, tree hashes, raw safetensors surgery."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.builders import tiny as tiny  # re-exported: the builders (examples/tiny.py)

REPO = Path(__file__).resolve().parents[2]

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
CLI_TIMEOUT = 300


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MXFP4CONV_DEBUG", "PYTHONWARNINGS")}
    env["HF_HUB_OFFLINE"] = "1"  # a repo-id-looking SRC must never reach the network
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # keep parallel subprocesses from oversubscribing 2 cores
    return env


def cli_cmd(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, "-m", "mxfp4conv", *(str(a) for a in args)]


def run_cli(*args: str | os.PathLike[str], timeout: float = CLI_TIMEOUT, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_cmd(*args), capture_output=True, text=True, timeout=timeout, env=cli_env(),
                          cwd=str(REPO), **kw)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def staging_of(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.mxfp4conv-staging"


def leftovers(dst: Path) -> list[str]:
    """DST, its staging folder and the publish fallback's old folder, where they exist."""
    cands = [dst, staging_of(dst), dst.parent / f".{dst.name}.mxfp4conv-old"]
    return [str(p) for p in cands if os.path.lexists(p)]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_state(root: Path) -> dict[str, tuple[str, ...]]:
    """Every entry under ``root`` (not following symlinks): files by sha256, links by target, dirs, modes."""
    out: dict[str, tuple[str, ...]] = {}
    if os.path.islink(root) or root.is_file():
        return {".": _entry(root)}
    if not root.exists():
        return {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        out[str(d.relative_to(root))] = ("dir", oct(d.lstat().st_mode))
        for name in sorted(dirnames + filenames):
            p = d / name
            if p.is_symlink() or not p.is_dir():
                out[str(p.relative_to(root))] = _entry(p)
    return out


def _entry(p: Path) -> tuple[str, ...]:
    st = p.lstat()
    if p.is_symlink():
        return ("link", os.readlink(p))
    if p.is_file():
        return ("file", sha256_file(p), str(st.st_size), oct(st.st_mode), str(st.st_mtime_ns))
    return ("other", oct(st.st_mode))


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root``, by relative path (for output comparisons)."""
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


# ---- raw safetensors surgery ---------------------------------------------------------------------


@dataclass
class RawShard:
    n: int  # declared header length
    header: dict[str, Any]  # parsed header, insertion order kept
    header_raw: bytes
    data: bytes  # everything after the header

    @property
    def data_len(self) -> int:
        return len(self.data)


def read_raw(path: Path) -> RawShard:
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    raw = blob[8 : 8 + n]
    return RawShard(n, json.loads(raw), raw, blob[8 + n :])


def header_text(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def write_raw(path: Path, header_raw: bytes, data: bytes, n: int | None = None) -> None:
    """Write a shard from raw header bytes (padded to 8) and data; ``n`` overrides the length field."""
    header_raw = header_raw + b" " * (-len(header_raw) % 8)
    length = len(header_raw) if n is None else n
    path.write_bytes(length.to_bytes(8, "little") + header_raw + data)


def write_header(path: Path, header: dict[str, Any], data: bytes | None = None) -> None:
    """Replace a shard's header (keeping its data area unless ``data`` is given)."""
    old = read_raw(path)
    write_raw(path, header_text(header), old.data if data is None else data)


def patch_bytes(path: Path, tensor: str, offset: int, payload: bytes) -> None:
    """Overwrite ``payload`` at byte ``offset`` inside ``tensor``'s data (the header is untouched)."""
    raw = read_raw(path)
    b, e = raw.header[tensor]["data_offsets"]
    assert b + offset + len(payload) <= e, (tensor, offset, len(payload), b, e)
    start = 8 + raw.n + b + offset
    blob = bytearray(path.read_bytes())
    blob[start : start + len(payload)] = payload
    path.write_bytes(bytes(blob))


def load_index(root: Path) -> dict[str, Any]:
    return json.loads((root / INDEX).read_text())


def save_index(root: Path, index: dict[str, Any]) -> None:
    (root / INDEX).write_text(json.dumps(index, indent=2))


def shard_of(root: Path, tensor: str) -> Path:
    return root / load_index(root)["weight_map"][tensor]


def names_in(path: Path) -> list[str]:
    return [k for k in read_raw(path).header if k != "__metadata__"]


def edit_tensors(root: Path, shard: str, *, drop: tuple[str, ...] = (), put: dict[str, Any] | None = None) -> None:
    """Rewrite one shard with tensors dropped / added / replaced, and keep the index in step."""
    import torch  # noqa: F401  (safetensors.torch needs it)
    from safetensors.torch import load_file, save_file

    path = root / shard
    tensors = load_file(str(path))
    for name in drop:
        del tensors[name]
    for name, t in (put or {}).items():
        tensors[name] = t.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    if (root / INDEX).exists():
        index = load_index(root)
        wmap = index["weight_map"]
        for name in drop:
            if wmap.get(name) == shard:
                del wmap[name]
        for name in put or {}:
            wmap.setdefault(name, shard)
        save_index(root, index)


# ---- output inspection ---------------------------------------------------------------------------

_TIMESTAMP = re.compile(rb"(19|20)\d\d-[01]\d-[0-3]\d([T ][0-2]\d:[0-5]\d)?|\b1[6-9]\d{8}(\.\d+)?\b")


def timestamp_like(blob: bytes) -> list[bytes]:
    return [m.group(0) for m in _TIMESTAMP.finditer(blob)]


def inspectable_text(path: Path) -> bytes:
    """The parts of an output file that are text: a safetensors header, or the whole (JSON/text) file."""
    if path.suffix == ".safetensors":
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            return fh.read(n)
    return path.read_bytes()
