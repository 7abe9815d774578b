"""mxfp4conv/run/staging.py: the staging folder's finished shards, reused only when their bytes still hash as
recorded, and the finisher that records a shard only once its digest is known."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Future
from pathlib import Path

import pytest

from mxfp4conv.errors import StagingError
from mxfp4conv.plan.job import ConvertOptions
from mxfp4conv.run.staging import ShardFinisher, prepare_staging, progress_file, reuse

FP: dict[str, object] = {"tool": "x", "source": {"a": 1}}


def _progress(staging: Path, shards: dict[str, dict[str, str]], fingerprint: dict[str, object] = FP,
              opts: ConvertOptions | None = None) -> None:
    staging.mkdir(exist_ok=True)
    progress_file(staging, opts or ConvertOptions(resume=True)).write_text(
        json.dumps({"fingerprint": fingerprint, "shards": shards}))


def test_a_fresh_run_starts_from_an_empty_folder(tmp_path: Path) -> None:
    staging = tmp_path / ".out.mxfp4conv-staging"
    _progress(staging, {"model.safetensors": {"sha256": "0" * 64}})
    (staging / "model.safetensors").write_bytes(b"old")
    assert prepare_staging(staging, FP, ConvertOptions()) == ({}, {})
    assert staging.is_dir() and not any(staging.iterdir())


def test_resume_takes_the_recorded_shards_of_the_same_conversion_only(tmp_path: Path) -> None:
    staging = tmp_path / "s"
    _progress(staging, {"model.safetensors": {"sha256": "ab"}})
    assert prepare_staging(staging, FP, ConvertOptions(resume=True)) == ({"model.safetensors": {"sha256": "ab"}}, {})
    # another conversion's record is ignored by --resume (the folder starts again) ...
    assert prepare_staging(staging, {"tool": "other"}, ConvertOptions(resume=True)) == ({}, {})
    # ... and refused by a partition, which may share the folder with other partitions of one conversion
    _progress(staging, {"a": {"sha256": "ab"}})
    with pytest.raises(StagingError, match="other inputs or options"):
        prepare_staging(staging, {"tool": "other"}, ConvertOptions(partition=(0, 2)))


def test_finish_needs_the_partitions_folder(tmp_path: Path) -> None:
    with pytest.raises(StagingError, match="nothing to finish"):
        prepare_staging(tmp_path / "missing", FP, ConvertOptions(finish=True))


def test_a_shard_is_reused_only_while_its_bytes_hash_as_recorded(tmp_path: Path) -> None:
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"shard bytes")
    rec = {"sha256": hashlib.sha256(b"shard bytes").hexdigest()}
    assert reuse(shard, rec)
    shard.write_bytes(b"shard byteS")
    assert not reuse(shard, rec)
    assert not reuse(tmp_path / "absent.safetensors", rec) and not reuse(shard, None)


def test_the_finisher_records_a_shard_once_its_digest_is_known(tmp_path: Path) -> None:
    outputs: dict[str, str] = {}
    path = tmp_path / ".mxfp4conv-progress.json"
    fin = ShardFinisher(path, FP, outputs)
    done: Future[str] = Future()
    later: Future[str] = Future()
    fin.pending += [("a.safetensors", done, {"s": 1}), ("b.safetensors", later, {})]
    done.set_result("d1")
    fin.settle(keep=1)  # the older one only: the newer is still hashing
    assert outputs == {"a.safetensors": "d1"} and len(fin.pending) == 1
    assert json.loads(path.read_text()) == {"fingerprint": FP, "shards": {"a.safetensors": {
        "sha256": "d1", "stats": {"s": 1}, "proven": False}}}
    later.set_result("d2")
    fin.settle()
    assert outputs == {"a.safetensors": "d1", "b.safetensors": "d2"} and not fin.pending


def test_a_shard_of_a_remote_source_is_recorded_with_its_sources_and_their_checks(tmp_path: Path) -> None:
    """A remote source's shard names the files it was made from; each file is recorded once checked, on
    the fetch's thread, whether before or after the shard; the record is what --resume reads."""
    path = tmp_path / ".mxfp4conv-progress.json"
    fin = ShardFinisher(path, FP, {}, proven=True)
    fin.sources["a.safetensors"] = ["s-1.safetensors", "s-2.safetensors"]
    done: Future[str] = Future()
    fin.pending.append(("a.safetensors", done, {}))
    fin.check_source("s-1.safetensors", "11")
    done.set_result("d1")
    fin.settle()
    fin.check_source("s-2.safetensors", "22")
    assert json.loads(path.read_text()) == {
        "fingerprint": FP, "checked": {"s-1.safetensors": "11", "s-2.safetensors": "22"},
        "shards": {"a.safetensors": {"sha256": "d1", "stats": {}, "proven": True,
                                     "sources": ["s-1.safetensors", "s-2.safetensors"]}}}
    staging = tmp_path
    assert prepare_staging(staging, FP, ConvertOptions(resume=True))[1] == {"s-1.safetensors": "11",
                                                                             "s-2.safetensors": "22"}
