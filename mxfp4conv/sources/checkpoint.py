"""Open a checkpoint folder (or a Hugging Face repo id) from headers and JSON files only.

A repo id (``org/model`` or ``org/model@revision``) is downloaded into huggingface_hub's cache and
read there, each file checked against the Hub's sha256 as the conversion reads it
(mxfp4conv/sources/hub_cache.py), or read remotely with ``open_checkpoint(..., stream=True)`` (``inspect``,
``--stream``): headers by range, small files only (mxfp4conv/sources/hub.py).
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxfp4conv.errors import InputError
from mxfp4conv.files.safetensors import TensorRef, load_json, parse_header, read_header
from mxfp4conv.sources import hub, hub_cache
from mxfp4conv.sources.hub_cache import PICKLE_SUFFIXES
from mxfp4conv.sources.source import HubSource, LocalSource, Source

__all__ = ["PICKLE_SUFFIXES", "Checkpoint", "open_checkpoint"]

INDEX_NAME = "model.safetensors.index.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Checkpoint:
    """Everything known about a checkpoint without reading tensor data."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, TensorRef]
    shard_files: list[Path]
    hf_quant_config: dict[str, Any] | None = None
    shard_metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    repo_id: str | None = None
    revision: str | None = None
    # a repo read remotely (inspect): the files' sizes and sha256 as the Hub lists them
    remote: hub.RemoteRepo | None = field(default=None, repr=False, compare=False)
    _rel: dict[Path, str] = field(default_factory=dict, repr=False, compare=False)
    _extra: dict[str, bytes | None] = field(default_factory=dict, repr=False, compare=False)
    _source: Source | None = field(default=None, repr=False, compare=False)

    @property
    def source(self) -> Source:
        """What the conversion asks of SRC, whatever kind it is (mxfp4conv/sources/source.py): the one
        place that looks at which kind it is."""
        if self._source is None:
            self._source = HubSource(self.remote) if self.remote is not None else LocalSource(self.root)
        return self._source

    def read_extra(self, name: str) -> bytes | None:
        """A small top-level file of the checkpoint (tokenizer files) by name, None when it has none; a Hub
        repo's is downloaded (checked as every file is)."""
        if name not in self._extra:
            got: bytes | None = None
            if "/" not in name and not name.startswith("."):
                path = self.source.file(name)
                got = path.read_bytes() if path is not None else None
            self._extra[name] = got
        return self._extra[name]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def rel(self, path: Path) -> str:
        """``path`` relative to the checkpoint folder (as given when it lies outside), cached: plans
        and error messages ask for the same few shard files thousands of times."""
        got = self._rel.get(path)
        if got is None:
            try:
                got = str(path.relative_to(self.root))
            except ValueError:
                got = str(path)
            self._rel[path] = got
        return got


def _repo_id(src: str, revision: str | None) -> tuple[str, str | None]:
    """``org/model[@rev]`` (not a local path) -> (repo id, revision)."""
    repo_id, revision = hub.split_revision(src, revision)
    if not _REPO_ID.match(repo_id):
        raise InputError("no such file or folder", file=src,
                         hint="pass a checkpoint folder or a Hugging Face repo id like org/name or org/name@revision")
    return repo_id, revision


def _inside(root: Path, rel_name: str, what: str, named_by: Path | None = None) -> Path:
    """Resolve a file named by the index (``named_by``) or found in the folder; refuse paths that leave it."""
    src = str(named_by or root / rel_name)
    if not rel_name or "\x00" in rel_name or os.path.isabs(rel_name) or "\\" in rel_name or any(
            part == ".." for part in Path(rel_name).parts):
        raise InputError(f"{what} names {rel_name!r}, a path outside the checkpoint folder",
                         file=src, hint="the index must name shard files inside the folder")
    path = root / rel_name
    try:
        real, real_root = path.resolve(), root.resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise InputError(f"{what} {rel_name!r} cannot be resolved ({exc})", file=src,
                         hint="replace the link with the real file") from exc
    if real_root in real.parents:
        return path
    if _is_hf_blob(root, path, real):
        return path
    raise InputError(f"{what} {rel_name!r} is a symlink leading outside the checkpoint folder ({real})",
                     file=src, hint="copy the real file into the folder")


def _refuse_outside_links(root: Path) -> None:
    """Every file convert may read or copy (config, tokenizer, extras) must live in the folder.

    A link such as ``tokenizer.json -> ~/.ssh/id_rsa`` would otherwise be copied into DST.
    Hugging Face cache snapshots (links into the repo's own ``blobs/``) are accepted.
    """
    for p in sorted(root.iterdir()):
        if p.is_symlink() and p.is_file():  # what convert reads or copies; dangling links and folders are not
            _inside(root, p.name, "file")


def _is_hf_blob(root: Path, path: Path, real: Path) -> bool:
    """A Hugging Face cache snapshot links files to ``<repo>/blobs/<hash>`` of its own repo."""
    snap = root.resolve() if not root.is_symlink() else root.absolute()
    if snap.parent.name != "snapshots":
        return False
    repo_dir = snap.parent.parent
    return real.parent == repo_dir / "blobs" and path.is_symlink()


def _refuse_pickles(root: Path) -> None:
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InputError(f"only pickle weights found ({', '.join(pickles[:3])}); mxfp4conv never unpickles "
                         "files, as loading a pickle can run arbitrary code", file=str(root / pickles[0]),
                         hint="convert the weights to safetensors with a trusted tool first")
    raise InputError("no *.safetensors files and no model.safetensors.index.json", file=str(root),
                     hint="point SRC at the folder holding the checkpoint's safetensors shards")


def _shard_names(root: Path) -> tuple[list[str], dict[str, str] | None]:
    index_path = root / INDEX_NAME
    if index_path.exists():
        index = load_json(index_path, what="shard index")
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not wmap or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
            raise InputError("weight_map is missing, empty or not a map of tensor name to file name",
                             file=str(index_path), hint="restore the index from the original release")
        return sorted(set(wmap.values())), wmap
    names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        _refuse_pickles(root)
    return names, None


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic collector paused while headers are parsed: they allocate ~5 objects per tensor
    (74K tensors in a Qwen3-30B-A3B, 190K in a DeepSeek-V3) and hold no cycles, but every allocation
    burst triggers collections that walk every live object again (~40% of ``open_checkpoint``, more
    the larger the process)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def open_checkpoint(src: str | Path, revision: str | None = None, *, stream: bool = False) -> Checkpoint:
    """Enumerate a checkpoint from its headers, config.json and (if present) hf_quant_config.json.

    ``stream``: a repo id is read on the Hub (headers by range, small files only) instead of being
    downloaded; its tensors' files are ``org/model@sha/<file>`` paths that hold no data. In
    huggingface_hub's offline mode a repo id is read from its cache, as without ``stream``."""
    if not Path(str(src)).exists():
        repo_id, rev = _repo_id(str(src), revision)
        if stream and not hub.offline():
            return _open_repo(hub.open_repo(repo_id, rev))
        return _open_repo(hub_cache.cached_repo(repo_id, rev))
    root = Path(str(src))
    if not root.is_dir():
        raise InputError("SRC is not a folder", file=str(root),
                         hint="pass the folder that holds config.json and the safetensors shards")
    if not any(root.iterdir()):
        raise InputError("the folder is empty", file=str(root), hint="download the checkpoint into it first")
    _refuse_outside_links(root)
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise InputError("config.json is missing", file=str(cfg_path),
                         hint="copy config.json from the original release next to the shards")
    config = load_json(cfg_path, what="config.json")
    hqc_path = root / "hf_quant_config.json"
    hqc = load_json(hqc_path, what="hf_quant_config.json") if hqc_path.exists() else None

    with _gc_paused():  # the index and every shard header
        names, wmap = _shard_names(root)
        tensors: dict[str, TensorRef] = {}
        files: list[Path] = []
        metas: dict[str, dict[str, str]] = {}
        for name in names:
            path = _inside(root, name, "shard", root / INDEX_NAME if wmap is not None else None)
            try:
                is_file = path.is_file()
            except OSError as exc:  # e.g. ENAMETOOLONG: Path.is_file() only swallows "not found" errors
                raise InputError(f"cannot read shard {name!r}: {exc.strerror}", file=str(path)) from exc
            if not is_file:
                if wmap is None:
                    raise InputError(f"shard {name!r} is not a regular file", file=str(path),
                                     hint="replace it with the real shard file")
                raise InputError(f"shard {name!r} listed in the index does not exist", file=str(path),
                                 hint="download the missing shard")
            files.append(path)
            shard, meta = read_header(path)
            metas[name] = meta
            _add_shard(tensors, shard, wmap, name, path)
        if wmap is not None:
            _all_mapped(tensors, wmap, root)
    return Checkpoint(root=root, config=config, tensors=tensors, shard_files=files, hf_quant_config=hqc,
                      shard_metadata=metas)


def _add_shard(tensors: dict[str, TensorRef], shard: dict[str, TensorRef], wmap: dict[str, str] | None,
               name: str, path: Path) -> None:
    for tname, ref in shard.items():
        if tname in tensors:
            raise InputError(f"tensor also stored in {tensors[tname].file.name}", file=str(path),
                             tensor=tname, hint="remove the duplicate shard")
        if wmap is not None and wmap.get(tname) != name:
            raise InputError(f"tensor is in this shard but the index maps it to {wmap.get(tname)!r}",
                             file=str(path), tensor=tname, hint="regenerate model.safetensors.index.json")
        tensors[tname] = ref


def _all_mapped(tensors: dict[str, TensorRef], wmap: dict[str, str], root: Path) -> None:
    missing = sorted(set(wmap) - set(tensors))
    if missing:
        raise InputError(f"index lists the tensor in {wmap[missing[0]]} but the shard does not hold it"
                         f" ({len(missing)} missing)", file=str(root / wmap[missing[0]]),
                         tensor=missing[0], hint="download the shard again")


def _open_repo(repo: hub.RemoteRepo) -> Checkpoint:
    """A repo at one pinned commit, read on the Hub (the small JSON files downloaded, every shard's
    header read by range, mxfp4conv/sources/hub.py) or in huggingface_hub's cache (sources/hub_cache.py); no
    tensor data."""
    root = repo.root
    top = {n for n in repo.files if "/" not in n}
    if "config.json" not in top:
        raise InputError("config.json is missing", file=str(root / "config.json"),
                         hint="the repo must hold config.json beside the safetensors shards")
    config = load_json(repo.download("config.json"), what="config.json")
    hqc = (load_json(repo.download("hf_quant_config.json"), what="hf_quant_config.json")
           if "hf_quant_config.json" in top else None)
    with _gc_paused():
        wmap: dict[str, str] | None = None
        if INDEX_NAME in top:
            index = load_json(repo.download(INDEX_NAME), what="shard index")
            got = index.get("weight_map")
            if not isinstance(got, dict) or not got or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in got.items()):
                raise InputError("weight_map is missing, empty or not a map of tensor name to file name",
                                 file=str(root / INDEX_NAME), hint="restore the index from the original release")
            wmap = got
            names = sorted(set(wmap.values()))
        else:
            names = sorted(n for n in top if n.endswith(".safetensors"))
            if not names:
                pickles = sorted(n for n in top if n.endswith(PICKLE_SUFFIXES))
                if pickles:
                    raise InputError(f"only pickle weights found ({', '.join(pickles[:3])}); mxfp4conv never "
                                     "unpickles files, as loading a pickle can run arbitrary code",
                                     file=str(root / pickles[0]),
                                     hint="convert the weights to safetensors with a trusted tool first")
                raise InputError("no *.safetensors files and no model.safetensors.index.json", file=str(root),
                                 hint="the repo must hold the checkpoint's safetensors shards at its top level")
        tensors: dict[str, TensorRef] = {}
        files: list[Path] = []
        metas: dict[str, dict[str, str]] = {}
        for name in names:
            if (not name or "\x00" in name or name.startswith("/") or "\\" in name
                    or any(part in ("..", ".", "") for part in name.split("/"))):
                raise InputError(f"shard {name!r} named by the index is not a file path inside the repo",
                                 file=str(root / INDEX_NAME), hint="the index must name shard files of the repo")
            path = repo.path(name)
            if name not in repo.files:
                raise InputError(f"shard {name!r} listed in the index does not exist", file=str(path),
                                 hint="the repo lacks the shard; check the index")
            shard, meta = parse_header(repo.read_header_bytes(name), repo.files[name].size, path, repo)
            files.append(path)
            metas[name] = meta
            _add_shard(tensors, shard, wmap, name, path)
        if wmap is not None:
            _all_mapped(tensors, wmap, root)
    return Checkpoint(root=root, config=config, tensors=tensors, shard_files=files, hf_quant_config=hqc,
                      shard_metadata=metas, repo_id=repo.repo_id, revision=repo.commit, remote=repo)
