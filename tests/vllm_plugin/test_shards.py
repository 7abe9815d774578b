"""The plugin's vLLM-free parts: reading a rank folder, the server checks, the version gate, packaging."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mxfp4conv.vllm_plugin import is_tested
from mxfp4conv.vllm_plugin.shards import MarlinReadyMismatch, Server, check_server, read_rank_folder

ROOT = Path(__file__).resolve().parents[2]
OK = Server(params_dtype="bfloat16", act_dtype="bf16", tp_size=2, tp_rank=1, expert_parallel=False, moe_backend="auto")


def test_reads_marlin_modules(marlin_outputs: dict[str, Path]) -> None:
    s = read_rank_folder(marlin_outputs["q3tp2"] / "rank-1")
    assert (s.tp_size, s.tp_rank, s.quant) == (2, 1, "mxfp4")
    assert sorted(s.moe) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert sorted(s.moe["model.layers.0.mlp.experts"]) == ["w13_weight", "w13_weight_scale", "w2_weight",
                                                             "w2_weight_scale"]
    assert len(s.dense) == 8 and "model.layers.1.self_attn.o_proj" in s.dense
    assert s.dense["model.layers.0.self_attn.q_proj"]["weight"].dtype == "I32"
    assert "model.embed_tokens.weight" not in s.marlin_names()  # BF16 tensors are not Marlin tensors
    assert check_server(s, OK) is None


@pytest.mark.parametrize(("change", "message"), [
    ({"tp_size": 4}, "mxfp4conv.tp_size is '2', the server needs '4'"),
    ({"tp_rank": 0}, "mxfp4conv.tp_rank is '1', the server needs '0'"),
    ({"params_dtype": "float16"}, "mxfp4conv.params_dtype is 'bfloat16', the server needs 'float16'"),
    ({"act_dtype": "fp8_e4m3"}, "mxfp4conv.act_dtype is 'bf16', the server needs 'fp8_e4m3'"),
    ({"expert_parallel": True}, "expert parallelism is on"),
    ({"moe_backend": "flashinfer_trtllm"}, "MoE backend 'flashinfer_trtllm' is forced"),
])
def test_server_mismatch_is_one_line(marlin_outputs: dict[str, Path], change: dict[str, object], message: str) -> None:
    s = read_rank_folder(marlin_outputs["q3tp2"] / "rank-1")
    why = check_server(s, Server(**{**OK.__dict__, **change}))
    assert why is not None and message in why and "\n" not in why


def test_shards_that_disagree_are_refused(marlin_outputs: dict[str, Path], tmp_path: Path) -> None:
    """A rank folder split into two shards whose metadata name different TP ranks."""
    src = marlin_outputs["gotp2"] / "rank-0" / "model.safetensors"
    with safe_open(str(src), "pt") as fh:
        meta = dict(fh.metadata())
    t = load_file(str(src))
    names = sorted(t)
    folder = tmp_path / "rank-0"
    folder.mkdir()
    save_file({n: t[n] for n in names[::2]}, str(folder / "model-00001-of-00002.safetensors"), metadata=meta)
    save_file({n: t[n] for n in names[1::2]}, str(folder / "model-00002-of-00002.safetensors"),
              metadata={**meta, "mxfp4conv.tp_rank": "1"})
    with pytest.raises(MarlinReadyMismatch, match=r"mxfp4conv\.tp_rank is '1' but '0'"):
        read_rank_folder(folder)


def test_not_a_marlin_folder(tmp_path: Path) -> None:
    with pytest.raises(MarlinReadyMismatch, match="no safetensors shards"):
        read_rank_folder(tmp_path)


@pytest.mark.parametrize(("version", "ok"), [("0.32.0", True), ("0.33.0", True), ("0.33.1+cpu", True),
                                              ("0.31.2", False), ("0.34.0", False), ("1.0.0", False), ("dev", False)])
def test_version_gate(version: str, ok: bool) -> None:
    assert is_tested(version) is ok


def test_extra_pulls_nothing_and_registers_the_entry_point() -> None:
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == []  # never the vllm distribution (its torch pin)
    assert project["entry-points"]["vllm.general_plugins"] == {"mxfp4conv_marlin": "mxfp4conv.vllm_plugin:register"}


def test_nothing_else_imports_the_plugin() -> None:
    for f in (ROOT / "mxfp4conv").rglob("*.py"):
        if "vllm_plugin" not in f.parts:
            assert "vllm_plugin" not in f.read_text(), f


@pytest.mark.parametrize("cut", [4096, 1])
def test_truncated_shard_is_refused_in_one_line(marlin_outputs: dict[str, Path], tmp_path: Path, cut: int) -> None:
    """An interrupted copy: the header is whole, the data is not."""
    import shutil

    folder = shutil.copytree(marlin_outputs["q3tp1"] / "rank-0", tmp_path / "rank-0")
    f = next(folder.glob("*.safetensors"))
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - cut)
    with pytest.raises(MarlinReadyMismatch) as e:
        read_rank_folder(folder)
    assert f"damaged: its header describes {size} bytes, the file holds {size - cut}" in str(e.value)
    assert "\n" not in str(e.value)


def test_garbage_header_is_refused_in_one_line(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes((20).to_bytes(8, "little") + b"{not json at all}   " + b"\0" * 64)
    with pytest.raises(MarlinReadyMismatch, match="safetensors header does not parse") as e:
        read_rank_folder(tmp_path)
    assert "\n" not in str(e.value)
