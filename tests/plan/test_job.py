"""mxfp4conv/plan/job.py: the planned job convert and verify both start from."""

from __future__ import annotations

from pathlib import Path

import pytest

from mxfp4conv.errors import InputError, UsageError
from mxfp4conv.plan.job import ConvertOptions, needs_device, prepare, resolve_device
from mxfp4conv.targets.base import TargetOptions
from tests.builders import build


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("job")
    return {layout: build(layout, root / layout, shards=2) for layout in ("ct-mxfp4", "gpt-oss", "modelopt-nvfp4")}


def test_auto_picks_the_native_layout_per_model(srcs: dict[str, Path]) -> None:
    assert prepare(srcs["gpt-oss"], ConvertOptions()).target.NAME == "gpt-oss"
    assert prepare(srcs["ct-mxfp4"], ConvertOptions()).target.NAME == "ct"


def test_a_target_that_cannot_express_the_source_is_an_input_error(srcs: dict[str, Path]) -> None:
    with pytest.raises(InputError, match=r"cannot convert gpt-oss .* to --to ct") as err:
        prepare(srcs["gpt-oss"], ConvertOptions(target="ct"))
    assert err.value.exit_code == 1


def test_the_plan_holds_each_rank(tmp_path: Path) -> None:
    src = build("gpt-oss", tmp_path / "g", hidden=128, inter=128, shards=1)  # I/tp a multiple of 32
    job = prepare(src, ConvertOptions(target="marlin", target_options=TargetOptions(tp_size=2)))
    ranks = job.output.ranks
    assert [(r.rank, r.folder) for r in ranks] == [(0, "rank-0"), (1, "rank-1")]
    assert [r.ctx.target_options.tp_rank for r in ranks] == [0, 1]
    assert all(r.ctx.target_options.tp_size == 2 for r in ranks)
    assert [s.rel for r in ranks for s in r.shards] == ["rank-0/model.safetensors", "rank-1/model.safetensors"]


def test_only_requantizing_jobs_need_a_device(srcs: dict[str, Path]) -> None:
    assert needs_device(prepare(srcs["modelopt-nvfp4"], ConvertOptions(target="ct")).ctx)
    assert not needs_device(prepare(srcs["ct-mxfp4"], ConvertOptions(target="quark")).ctx)
    keep = ConvertOptions(target="marlin", target_options=TargetOptions(keep_nvfp4=True))
    assert not needs_device(prepare(srcs["modelopt-nvfp4"], keep).ctx)


def test_lossless_units_are_byte_range_copies(srcs: dict[str, Path]) -> None:
    job = prepare(srcs["ct-mxfp4"], ConvertOptions(target="quark"))
    units = [u for _, s in job.output.shards() for u in s.units]
    assert {u.spec.kind: u.direct is not None for u in units} == {"moe": True, "passthrough": True}
    assert all(u.read_bytes == 0 for u in units)
    nv = prepare(srcs["modelopt-nvfp4"], ConvertOptions(target="ct"))
    moe = [u for _, s in nv.output.shards() for u in s.units if u.spec.kind == "moe"]
    assert moe and all(u.direct is None and u.read_bytes > 0 for u in moe)


def test_devices_resolve_without_a_gpu_or_refuse() -> None:
    torch = pytest.importorskip("torch")
    assert resolve_device("auto", needed=False) == "cpu"
    assert resolve_device("cuda", needed=False) == "cuda"  # nothing is requantized: never looked at
    if torch.cuda.is_available():
        assert resolve_device("auto") == "cuda"
        return
    assert resolve_device("auto") == "cpu"
    with pytest.raises(UsageError, match="no CUDA device is visible") as err:
        resolve_device("cuda:0")
    assert err.value.exit_code == 2
