"""``convert --ray ADDRESS`` on a real local Ray cluster: a head on 127.0.0.1 with two CPU slots.

Ray is part of the test install (``make test`` installs ``.[test,ray]``): a missing ``ray`` fails here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray  # noqa: F401 - the test install must have it (no skip)
from click.testing import CliRunner

from mxfp4conv.cli import cli
from tests.builders import build
from tests.ray_cluster import free_port, ray_head

SHARD = "30KB"  # 5 output shards for the tiny builders


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def local(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.stdout, res.stderr


def real_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mxfp4conv", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with ray_head() as address:
        yield address


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {layout: build(layout, root / layout, shards=3) for layout in ("ct-mxfp4", "modelopt-nvfp4")}


@pytest.mark.parametrize("layout", ["ct-mxfp4", "modelopt-nvfp4"])
def test_ray_output_is_byte_identical_to_a_local_run(ray_address: str, srcs: dict[str, Path], tmp_path: Path,
                                                     layout: str) -> None:
    """Copy path (MXFP4 -> ct) and requantization path (NVFP4 -> MXFP4 ct): same bytes, manifest included."""
    args = ["--to", "ct", "--max-shard-size", SHARD, "--device", "cpu"]
    code, _, err = local("convert", str(srcs[layout]), str(tmp_path / "local"), *args)
    assert code == 0, err
    res = real_cli("convert", str(srcs[layout]), str(tmp_path / "ray"), *args, "--ray", ray_address, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["status"] == "converted" and doc["verify"]["ok"]
    assert len(doc["shards"]) >= 3
    assert doc["ray"] == {"address": ray_address, "tasks": 2, "nodes": 1, "resource": "CPU"}
    # the manifest is compared too: --ray is not a fingerprinted option, so it is the same file
    assert tree_hashes(tmp_path / "ray") == tree_hashes(tmp_path / "local")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "ray"]  # no staging folder left


def _poison_scale(src: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of SRC with one E8M0 scale byte set to 0xFF: found only when that unit is converted."""
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    wmap = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in sorted(wmap) if n.startswith("model.layers.1.") and n.endswith("weight_scale"))
    shard = bad / wmap[name]
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8:8 + n])[name]["data_offsets"]
    raw[8 + n + begin] = 0xFF
    shard.write_bytes(bytes(raw))
    return bad, name


def test_a_failing_task_fails_like_a_local_run(ray_address: str, srcs: dict[str, Path], tmp_path: Path) -> None:
    bad, name = _poison_scale(srcs["ct-mxfp4"], tmp_path)
    args = [str(bad), "--to", "ct", "--max-shard-size", SHARD, "--device", "cpu"]
    code, _, err_local = local("convert", args[0], str(tmp_path / "local"), *args[1:])
    assert code == 1 and name in err_local
    res = real_cli("convert", args[0], str(tmp_path / "ray"), *args[1:], "--ray", ray_address)
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr
    assert err_local.strip() in res.stderr.splitlines()  # the task's own one-line error, not a Ray wrapper
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no DST, no staging folder


def test_unreachable_address_is_one_line_and_writes_nothing(srcs: dict[str, Path], tmp_path: Path) -> None:
    res = real_cli("convert", str(srcs["ct-mxfp4"]), str(tmp_path / "o"), "--device", "cpu",
                   "--ray", f"127.0.0.1:{free_port()}")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the Ray cluster at 127.0.0.1:"), res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra", [["--partition", "0/2"], ["--finish"], ["--dry-run"], ["--devices", "0"]])
def test_ray_refuses_options_it_plans_itself(srcs: dict[str, Path], tmp_path: Path, extra: list[str]) -> None:
    code, _, err = local("convert", str(srcs["ct-mxfp4"]), str(tmp_path / "o"), "--ray", "127.0.0.1:1", *extra)
    assert code == 2 and f"--ray cannot be combined with {extra[0]}" in err
    assert list(tmp_path.iterdir()) == []


def test_missing_ray_names_the_extra(srcs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    code, _, err = local("convert", str(srcs["ct-mxfp4"]), str(tmp_path / "o"), "--ray", "127.0.0.1:1")
    assert code == 1
    assert "pip install 'mxfp4conv[ray]'" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_progress_counts_finished_shards_across_workers(ray_address: str, srcs: dict[str, Path], tmp_path: Path) -> None:
    """The driver's progress (the CLI's GB/s and ETA bar) climbs with shards finished on any worker
    and ends at the total planned bytes."""
    from mxfp4conv.publish.ray_runner import convert_on_ray
    from mxfp4conv.run.pipeline import ConvertOptions

    calls: list[tuple[int, int]] = []
    report = convert_on_ray(srcs["ct-mxfp4"], tmp_path / "o", ConvertOptions(target="ct", max_shard_size=30_000),
                            ray_address, on_progress=lambda done, total: calls.append((done, total)))
    total = sum(int(s["bytes"]) for s in report.shards)
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert len(report.shards) >= 3
