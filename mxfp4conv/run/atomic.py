"""Staging folders beside the destination, atomic publish, cleanup on failure."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
from pathlib import Path

from mxfp4conv.errors import OutputError

__all__ = ["check_destination", "publish", "remove_tree", "staging_path"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def staging_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.mxfp4conv-staging"


def check_destination(src: Path | None, dst: Path, *, overwrite: bool) -> None:
    """Refuse DST equal to, inside or holding SRC (None: SRC has no local files), DST paths through
    symlinks, an existing DST."""
    dst_abs = Path(os.path.abspath(dst))
    dst_r = dst_abs.resolve()
    if src is not None:
        src_r = src.resolve()
        if dst_r == src_r or src_r in dst_r.parents:
            raise OutputError("DST is inside (or equal to) SRC; mxfp4conv never writes into its input",
                              file=str(dst), hint="choose a destination outside the source folder")
        # Replacing a DST that holds SRC (or the files SRC links to, e.g. an HF cache's blobs/) deletes the input.
        for real in [src_r, *_resolved(src)]:
            if dst_r in real.parents:
                raise OutputError(f"DST contains the source ({real}); replacing it would delete the input",
                                  file=str(dst), hint="choose a destination outside the source folder")
    probe = dst_abs
    while probe != probe.parent:
        if probe.is_symlink():
            raise OutputError(f"DST path component {probe} is a symlink (to {probe.resolve()})",
                              file=str(dst), hint="pass the real destination path")
        probe = probe.parent
    if dst_abs.exists() and not overwrite:
        raise OutputError("DST already exists", file=str(dst),
                          hint="pass --overwrite to replace it, or choose a new folder")
    if not dst_abs.parent.is_dir():
        raise OutputError("the parent folder of DST does not exist", file=str(dst),
                          hint=f"create {dst_abs.parent} first")


def _resolved(folder: Path) -> list[Path]:
    out = []
    for p in folder.iterdir():
        try:
            out.append(p.resolve())
        except (RuntimeError, OSError):  # a symlink loop: it leads nowhere
            continue
    return out


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return bool(rc == 0)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: Path, dst: Path) -> None:
    """Make ``staging`` appear as ``dst`` in one step; an existing ``dst`` is replaced atomically."""
    _fsync_dir(staging)
    if dst.exists():
        if _exchange(staging, dst):  # staging now holds the old output
            remove_tree(staging)
        else:
            old = dst.parent / f".{dst.name}.mxfp4conv-old"
            remove_tree(old)
            os.replace(dst, old)
            os.replace(staging, dst)
            remove_tree(old)
    else:
        os.replace(staging, dst)
    _fsync_dir(dst.parent)


def remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
