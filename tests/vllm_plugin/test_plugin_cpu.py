"""The vLLM plugin in vLLM's own CPU build: model construction and weight loading of Marlin-ready outputs.

vllm_load.py runs in the vLLM venv ($MXFP4CONV_VLLM_PYTHON, else .venv-vllm/bin/python) with every
vLLM repack / Marlin preparation function made to raise. It builds the model with vLLM's config and
default loader and compares each plugin parameter with the shard bytes. The TP-2 rank-1 cases run in
one process with vLLM's TP group standing in for rank 1 of 2 (vLLM's CPU build would need two worker
processes otherwise). The forward pass needs CUDA Marlin kernels: test_plugin_gpu.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> str:
    env = os.environ.get("MXFP4CONV_VLLM_PYTHON")
    if env:
        return env
    local = ROOT / ".venv-vllm" / "bin" / "python"
    if local.exists():
        return str(local)
    if os.environ.get("MXFP4CONV_REQUIRE_VLLM"):
        pytest.fail("MXFP4CONV_REQUIRE_VLLM is set but no vLLM venv was found (make env-vllm)")
    pytest.skip("no vLLM venv (make env-vllm, or set MXFP4CONV_VLLM_PYTHON)")


def with_metadata(rank_dir: Path, dst: Path, **changes: str) -> Path:
    """A copy of a rank folder whose shards carry other ``mxfp4conv.*`` metadata values."""
    shutil.copytree(rank_dir, dst)
    for f in dst.glob("*.safetensors"):
        from safetensors import safe_open

        with safe_open(str(f), "pt") as fh:
            meta = dict(fh.metadata())
        meta.update({f"mxfp4conv.{k}": v for k, v in changes.items()})
        save_file(load_file(str(f)), str(f), metadata=meta)
    return dst


@pytest.fixture(scope="module")
def results(marlin_outputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    py = vllm_python()
    r = tmp_path_factory.mktemp("vllm_plugin")
    o = marlin_outputs
    q3_1, q3_2, go_1, go_2, nv, go_sgl = o["q3tp1"], o["q3tp2"], o["gotp1"], o["gotp2"], o["nv"], o["gosgl"]
    v1 = with_metadata(q3_1 / "rank-0", r / "layout_v1", marlin_layout="v1")
    misplaced = shutil.copytree(q3_2 / "rank-1", r / "misplaced" / "rank-0")  # rank 1's shards in a rank-0 folder
    cases: dict[str, dict[str, Any]] = {
        "qwen3_tp1": {"rank_dir": q3_1 / "rank-0"},
        "qwen3_tp2_rank1": {"rank_dir": q3_2 / "rank-0", "tp_size": 2, "tp_rank": 1},  # vllm serve DST/rank-0
        "gptoss_tp1": {"rank_dir": go_1 / "rank-0"},
        "gptoss_tp2_rank1": {"rank_dir": go_2 / "rank-0", "tp_size": 2, "tp_rank": 1},
        "nvfp4_kept": {"rank_dir": nv / "rank-0"},
        "fp8_attention": {"rank_dir": o["fp8"] / "rank-0"},
        "wrong_tp_size": {"rank_dir": q3_2 / "rank-1"},
        "wrong_tp_rank": {"rank_dir": misplaced, "tp_size": 2, "tp_rank": 0},
        "wrong_engine": {"rank_dir": go_sgl / "rank-0"},
        "wrong_layout": {"rank_dir": v1},
        "wrong_dtype": {"rank_dir": q3_1 / "rank-0", "engine_args": {"dtype": "float16"}},
        "wrong_act_dtype": {"rank_dir": q3_1 / "rank-0", "env": {"VLLM_MARLIN_INPUT_DTYPE": "fp8"}},
        "expert_parallel": {"rank_dir": go_1 / "rank-0", "engine_args": {"enable_expert_parallel": True}},
        "forced_moe_backend": {"rank_dir": go_1 / "rank-0", "engine_args": {"moe_backend": "triton"}},
        "untested_vllm": {"rank_dir": q3_1 / "rank-0", "vllm_version": "0.99.0"},
    }
    spec = r / "cases.json"
    spec.write_text(json.dumps([{**c, "rank_dir": str(c["rank_dir"])} for c in cases.values()]))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_MARLIN_INPUT_DTYPE", None)
    proc = subprocess.run([py, str(Path(__file__).parent / "vllm_load.py"), str(spec), str(r / "out.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((r / "out.json").read_text())
    return dict(zip(cases, out, strict=True))


@pytest.mark.parametrize(("case", "folder", "slots", "methods"), [
    ("qwen3_tp1", "q3tp1/rank-0", 24, {"MarlinReadyMoEMethod", "MarlinReadyLinearMethod"}),  # experts + q/k/v/o
    ("qwen3_tp2_rank1", "q3tp2/rank-1", 24, {"MarlinReadyMoEMethod", "MarlinReadyLinearMethod"}),
    ("gptoss_tp1", "gotp1/rank-0", 12, {"MarlinReadyMoEMethod"}),  # 2 layers x 4 weights/scales + 2 biases
    ("gptoss_tp2_rank1", "gotp2/rank-1", 12, {"MarlinReadyMoEMethod"}),
    ("nvfp4_kept", "nv/rank-0", 6, {"MarlinReadyMoEMethod"}),  # + w13/w2_weight_scale_2
])
def test_loads_shard_bytes_without_repack(results: dict[str, dict[str, Any]], case: str, folder: str, slots: int,
                                          methods: set[str]) -> None:
    res = results[case]
    assert "error" not in res, res.get("traceback")
    assert res["folder"].endswith(folder)  # served as DST/rank-0, TP rank 1 reads DST/rank-1
    assert res["slots"] == res["marlin_tensors"] == res["compared"] == slots
    assert res["differ"] == [] and res["not_loaded"] == []
    assert methods <= set(res["methods"])
    assert not {"Mxfp4MoEMethod", "GptOssMxfp4MoEMethod"} & set(res["methods"])
    assert res["repack_calls"] == []
    # BF16 tensors went through vLLM's own loaders (unsplit ones compared as they are)
    assert res["passthrough_differ"] == [] and res["passthrough_equal"] > 0
    # vLLM's CPU build has no Marlin kernel: the post-load step refuses in one line
    assert "run on vLLM's CUDA Marlin kernels; this platform is cpu" in res["after_loading"]
    assert "\n" not in res["after_loading"]


def test_non_fp4_layers_load_through_the_native_config(results: dict[str, dict[str, Any]]) -> None:
    """FP8 attention beside Marlin-ready experts: vLLM's compressed-tensors FP8 scheme builds and loads it
    (weight, weight_scale, input_scale byte for byte), the experts stay Marlin-ready."""
    res = results["fp8_attention"]
    assert "error" not in res, res.get("traceback")
    assert res["differ"] == [] and res["not_loaded"] == [] and res["repack_calls"] == []
    assert {"MarlinReadyMoEMethod", "CompressedTensorsLinearMethod"} <= set(res["methods"]), res["methods"]
    assert "UnquantizedLinearMethod" not in res["methods"] or res["passthrough_differ"] == []
    assert res["fp8_params"] and all(res["fp8_params"].values()), res["fp8_params"]


@pytest.mark.parametrize(("case", "message"), [
    ("wrong_tp_size", "mxfp4conv.tp_size is '2', the server needs '1'"),
    ("wrong_tp_rank", "mxfp4conv.tp_rank is '1', the server needs '0'"),
    ("wrong_engine", "mxfp4conv.engine is 'sglang', the server needs 'vllm'"),
    ("wrong_layout", "mxfp4conv.marlin_layout is 'v1', the server needs 'v2'"),
    ("wrong_dtype", "mxfp4conv.params_dtype is 'bfloat16', the server needs 'float16'"),
    ("wrong_act_dtype", "mxfp4conv.act_dtype is 'bf16', the server needs 'fp8_e4m3'"),
    ("expert_parallel", "expert parallelism is on"),
    ("forced_moe_backend", "MoE backend 'triton' is forced"),
    ("untested_vllm", "tested with vLLM 0.32-0.33, this is vLLM 0.99.0"),
])
def test_refuses_mismatch_in_one_line(results: dict[str, dict[str, Any]], case: str, message: str) -> None:
    res = results[case]
    assert "error" in res, f"{case} loaded: {res}"
    assert message in res["error"], res["traceback"]
    assert "\n" not in res["error"]
    assert res["repack_calls"] == []
