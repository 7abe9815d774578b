"""``--to mlx`` outputs computed by MLX itself (mlx 0.32.4 / mlx-lm 0.32.2 on this CPU, ``mlx[cpu]``).

Per case (every input layout on a tiny Qwen3-MoE, GPT-OSS, Mixtral MXFP4 / NVFP4, the replicas of
GLM-4.5, GraniteMoE, Qwen3.5-MoE, DeepSeek-R1 (NVFP4 and Quark MXFP4), NVIDIA's Qwen3-MoE NVFP4 and
AutoRound's Qwen3-MoE with FP4 attention, an output split by ``--max-shard-size``): ``mlx_lm.load`` in
strict mode; every FP4 module MLX builds dequantizes (``mx.dequantize(..., mode="mxfp4")``) bit for bit
to the source's values (MXFP4) or to the oracle's requantization of them (NVFP4), and no FP4 module is
left unchecked; the prompt's logits agree with float32 references; ``mlx_lm.generate`` produces tokens.

Tolerances, as a mean |difference| relative to the RMS of the reference logits:

* ``F32``: the loaded model with float32 activations against mlx-lm's model built unquantized in
  float32 from the values written. The weights are identical (checked bit for bit), so only the
  order of float32 accumulation differs: measured 2e-7 to 5e-7 (max 3e-6). 1e-5 leaves 20x; a
  gate/up swap in one layer gives 6e-2.
* ``BF16``: the model as mlx-lm runs it (bf16 activations) against the same float32 reference. bf16
  keeps 8 significant bits (a relative rounding of up to 2^-9 per rounded activation), and ~10
  rounded ops lie between the embedding and the logits of these 2-layer models: measured 0.006 to
  0.015. 0.03 leaves 2x and stays under the gate/up swap's 0.06.
* Against the source's own float32 values, the NVFP4 cases add what the requantization costs, measured
  in float32 (reference of the written values vs the source's): the bound is that plus ``BF16``
  (triangle inequality). MXFP4 sources are written losslessly: both references are the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.mlx_runtime.conftest import NEGATIVE, SHARDED, Ran

pytestmark = pytest.mark.mlx

F32 = 1e-5
BF16 = 0.03
# Qwen3.5 (measured 0.085): mlx-lm's sanitize adds 1 to its offset-stored RMSNorm weights in bf16 (rounding
# them to 8 significant bits, which the float32 reference does not), and its gated-delta attention carries a
# recurrent state across positions in bf16
BF16_BY_CASE = {"qwen3_5_moe-modelopt-nvfp4": 0.15}
CASES = ["qwen3_moe-ct-mxfp4", "gpt_oss", "qwen3_moe-modelopt-nvfp4", "qwen3_moe-ct-nvfp4", "qwen3_moe-quark-mxfp4",
         "qwen3_moe-quark-nvfp4", "mixtral-ct-mxfp4", "mixtral-ct-nvfp4", "qwen3_moe-autoround-mxfp4",
         "qwen3_moe-modelopt-nvfp4-fp8kv", "deepseek_v3-modelopt-nvfp4-r1", "deepseek_v3-quark-mxfp4-r1", "glm4_moe-ct-nvfp4", "granitemoe-ct-mxfp4", "qwen3_5_moe-modelopt-nvfp4", SHARDED]


def _result(ran: Ran, name: str) -> dict[str, Any]:
    assert name not in ran.convert_errors, f"{name}: convert failed: {ran.convert_errors[name]}"
    r = ran.results[name]
    assert "error" not in r, f"{name}: MLX failed: {r['error']}\n{r.get('traceback', '')}"
    return r


def _rel(r: dict[str, Any], a: str, b: str) -> float:
    x, y, ref = np.array(r[a]), np.array(r[b]), np.array(r["reference"])
    return float(np.abs(x - y).mean() / np.sqrt((ref**2).mean()))


@pytest.mark.parametrize("name", CASES)
def test_every_fp4_weight_mlx_dequantizes_is_the_source_s(mlx_ran: Ran, name: str) -> None:
    r = _result(mlx_ran, name)
    assert r["modes"] == ["mxfp4"]
    assert r["mismatched"] == [], r["mismatched"]
    assert r["uncovered"] == [], f"FP4 modules no expectation covers: {r['uncovered']}"
    assert r["exact"] == r["compared"] == r["fp4_modules"] > 0


@pytest.mark.parametrize("name", CASES)
def test_logits_agree_with_float32_references(mlx_ran: Ran, name: str, record: Any) -> None:
    r = _result(mlx_ran, name)
    f32, bf16 = _rel(r, "logits_f32", "reference_written"), _rel(r, "logits", "reference_written")
    requant, source = _rel(r, "reference_written", "reference"), _rel(r, "logits", "reference")
    record("relative mean |d| logits", f"float32 {f32:.1e}, bf16 {bf16:.4f}, vs source {source:.4f} (requant {requant:.4f})")
    tol = BF16_BY_CASE.get(name, BF16)
    assert f32 <= F32
    assert bf16 <= tol
    if mlx_ran.cases[name].nvfp4:
        assert source <= requant + tol
    else:
        assert requant == 0.0, "a lossless source's written values must be its own"


@pytest.mark.parametrize("name", CASES)
def test_mlx_lm_generates(mlx_ran: Ran, name: str) -> None:
    r = _result(mlx_ran, name)
    assert r["generated_tokens"] > 0, r["generated"]


def test_the_negative_control_fails_both_checks(mlx_ran: Ran) -> None:
    """Gate and up swapped in one layer: MLX loads it, and both the bytes and the logits say so."""
    r = _result(mlx_ran, NEGATIVE)
    assert r["exact"] < r["compared"]
    assert _rel(r, "logits_f32", "reference_written") > 100 * F32
    assert _rel(r, "logits", "reference_written") > BF16


def test_the_sharded_output_is_what_mlx_lm_writes(mlx_ran: Ran) -> None:
    import json

    dst = mlx_ran.cases[SHARDED].dst
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
