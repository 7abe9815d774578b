"""``--to gguf`` outputs computed by llama.cpp itself (llama-cpp-python 0.3.36's llama.cpp on this CPU).

Per case (every input layout on a tiny Qwen3-MoE, AutoRound's Qwen3-MoE with FP4 attention, GPT-OSS,
DeepSeek-R1's NVFP4 and Quark MXFP4 replicas, Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next and Mixtral ModelOpt NVFP4
sources also kept as GGML NVFP4 with ``--keep-nvfp4``, GLM-4.5, GraniteMoE, Mixtral, Qwen3.5-MoE, Qwen3-Next, MiniMax-M2, Qwen3-VL-MoE's text model and Llama-4, an output split by
``--max-shard-size``): llama.cpp loads the GGUF; the prompt's logits agree with transformers' float32
model of the source; greedy generation produces tokens. The negative controls (gate and up swapped in one
layer, and each re-layout of a converter's done wrong: Q/K rows, Qwen3.5's norms and value heads,
Qwen3-Next's qkvz split) load and must fail the logits check.

Tolerance, as a mean |difference| relative to the RMS of the reference logits: llama.cpp's CPU matmuls
round their activations before the dot product, to Q8_0 for an MXFP4 weight (blocks of 32 with a float16
scale: a relative rounding of up to 2^-8 of the block's largest value) and to BF16 for a BF16 weight
(2^-9), and about ten rounded matmuls lie between the embedding and the logits of these 2-layer models:
measured 0.0036 to 0.0165 (FP4 attention adds Q8_0 rounding to every projection; Mixtral's is the largest). ``TOL`` =
0.02 stays far under the gate/up swap's 0.07 and Mixtral with its Q and K rows left in the checkpoint's order (0.22): both negative controls below.

Every MXFP4 tensor of each output, read and dequantized by the ``gguf`` package (llama.cpp's own Python
reader, not mxfp4conv's), is the source's values bit for bit (MXFP4 sources) or the oracle's
requantization of them (NVFP4), under names mapped by this test from llama.cpp's tensor table.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gguf_runtime import gguf_cases as C
from tests.gguf_runtime.conftest import (
    NEGATIVE,
    NEGATIVE_NORMS,
    NEGATIVE_QK,
    NEGATIVE_QKVZ,
    NEGATIVE_ROPE,
    NEGATIVE_V_HEADS,
    SHARDED,
    Ran,
)

pytestmark = pytest.mark.gguf

TOL = 0.02
CASES = ["qwen3_moe-ct-mxfp4", "qwen3_moe-modelopt-nvfp4", "qwen3_moe-ct-nvfp4", "qwen3_moe-quark-mxfp4",
         "qwen3_moe-quark-nvfp4",
         "qwen3_moe-autoround-mxfp4", "gpt_oss", "deepseek_v3-modelopt-nvfp4-r1", "deepseek_v3-quark-mxfp4-r1",
         "qwen3_moe-modelopt-nvfp4-h128", "qwen3_moe-modelopt-nvfp4-h128--keep-nvfp4", "glm4_moe-ct-nvfp4",
         "granitemoe-ct-mxfp4", "mixtral-ct-mxfp4", "mixtral-ct-nvfp4", "mixtral-modelopt-nvfp4",
         "mixtral-modelopt-nvfp4--keep-nvfp4", "qwen3_5_moe-modelopt-nvfp4--keep-nvfp4",
         "qwen3_next-modelopt-nvfp4--keep-nvfp4", "qwen3_5_moe-ct-mxfp4", "qwen3_5_moe-ct-nvfp4",
         "qwen3_5_moe-modelopt-nvfp4", "qwen3_next-ct-mxfp4", "qwen3_next-modelopt-nvfp4", "minimax_m2-ct-mxfp4",
         "minimax_m2-modelopt-nvfp4", "qwen3_vl_moe-ct-mxfp4", "qwen3_vl_moe-ct-nvfp4", "llama4-ct-mxfp4",
         "llama4-modelopt-nvfp4", "llama4-llama3-rope-ct-mxfp4", SHARDED]


def _result(ran: Ran, name: str) -> dict[str, Any]:
    assert name not in ran.convert_errors, f"{name}: convert failed: {ran.convert_errors[name]}"
    r = ran.results[name]
    assert "error" not in r, f"{name}: llama.cpp failed: {r['error']}\n{r.get('traceback', '')}"
    return r


def _rel(x: np.ndarray, y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(x - y).mean() / np.sqrt((ref**2).mean()))


@pytest.mark.parametrize("name", CASES)
def test_logits_agree_with_float32_references(llama_ran: Ran, name: str, record: Any) -> None:
    r = _result(llama_ran, name)
    refs = llama_ran.references[name]
    got = np.array(r["logits"])
    written, source = refs["reference_written"], refs["reference"]
    d, requant, vs_source = _rel(got, written, written), _rel(written, source, source), _rel(got, source, source)
    record("relative mean |d| logits", f"llama.cpp {d:.4f}, vs source {vs_source:.4f} (requant {requant:.4f}), "
           f"argmax {int((got.argmax(-1) == written.argmax(-1)).sum())}/{len(got)}")
    assert got.shape == written.shape
    assert d <= TOL
    case = llama_ran.cases[name]
    if case.nvfp4 and not case.keeps_nvfp4:
        assert vs_source <= requant + TOL
    else:
        assert requant == 0.0, "a lossless output's values must be the source's own"


@pytest.mark.parametrize("name", CASES)
def test_llama_cpp_generates(llama_ran: Ran, name: str) -> None:
    r = _result(llama_ran, name)
    assert r["generated_tokens"] > 0, r


@pytest.mark.parametrize("name", [NEGATIVE, NEGATIVE_QK, NEGATIVE_NORMS, NEGATIVE_V_HEADS, NEGATIVE_QKVZ, NEGATIVE_ROPE])
def test_the_negative_controls_fail_the_logits_check(llama_ran: Ran, record: Any, name: str) -> None:
    """Gate and up swapped in one layer; Mixtral's Q and K rows left in the checkpoint's order; Qwen3.5's
    RMSNorm weights without the 1 its (1 + weight) norms add, and its Gated DeltaNet value heads left grouped
    by key head; Qwen3-Next's in_proj_qkvz cut in the checkpoint's order; Llama-4's rope_freqs all 1 (its
    llama3 RoPE scaling dropped): llama.cpp loads each, and the logits say so."""
    r = _result(llama_ran, name)
    ref = llama_ran.references[name]["reference_written"]
    d = _rel(np.array(r["logits"]), ref, ref)
    record("relative mean |d| logits", f"{d:.4f}")
    assert d > TOL


def test_the_split_output_is_what_llama_gguf_split_writes(llama_ran: Ran) -> None:
    dst = llama_ran.cases[SHARDED].dst
    files = sorted(p.name for p in dst.glob("*.gguf"))
    assert len(files) > 1 and files == [f"model-{i + 1:05d}-of-{len(files):05d}.gguf" for i in range(len(files))]


# llama.cpp's names (its llama-arch.cpp tensor table) -> the source's module names, written for this test
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_DENSE = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", **{f"ffn_{p}": f"mlp.{p}_proj" for p in ("gate", "up", "down")},
          **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")}}


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two rotary halves for its NORM rope (row j of the first
    half, then row j of the second): put the rows back in the checkpoint's order."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_fp4(folder: Path, case: C.Case) -> dict[str, np.ndarray]:
    """Every FP4 matrix of a GGUF output, dequantized by the ``gguf`` package, by source module name; an NVFP4
    matrix times its ``<name>.scale`` (one per matrix: one per expert of a stack), as llama.cpp multiplies it;
    a permuted Q / K projection (GraniteMoE, Mixtral) with its rows put back."""
    import json

    cfg = json.loads((case.src / "config.json").read_text())
    layers = "model.language_model.layers" if case.model_type == "qwen3_vl_moe" else "model.layers"
    experts = "block_sparse_moe.experts" if case.model_type in ("granitemoe", "mixtral", "minimax_m2") else (
        "feed_forward.experts" if case.model_type == "llama4_text" else "mlp.experts")
    proj = {"gate": "w1", "up": "w3", "down": "w2"} if case.model_type in ("mixtral", "minimax_m2") else {
        p: f"{p}_proj" for p in ("gate", "up", "down")}
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    tensors = {t.name: t for f in sorted(folder.glob("*.gguf")) for t in GGUFReader(str(f)).tensors}
    for t in tensors.values():
        if t.tensor_type not in (GGMLQuantizationType.MXFP4, GGMLQuantizationType.NVFP4):
            continue
        values = dequantize(np.asarray(t.data), t.tensor_type)
        if t.tensor_type == GGMLQuantizationType.NVFP4:
            scale = np.asarray(tensors[t.name.replace(".weight", ".scale")].data, dtype=np.float32).reshape(-1)
            values = values * (scale[:, None, None] if values.ndim == 3 else scale[0])
        if (m := _EXPS.match(t.name)) is not None:
            for e in range(values.shape[0]):
                out[f"{layers}.{m[1]}.{experts}.{e}.{proj[m[2]]}"] = values[e]
            continue
        _blk, layer, kind, _ = t.name.split(".")
        if case.model_type in ("granitemoe", "mixtral") and kind in ("attn_q", "attn_k"):
            values = _unpermute(values, int(cfg["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]))
        out[f"{layers}.{layer}.{_DENSE[kind]}"] = values
    return out


@pytest.mark.parametrize("name", CASES)
def test_gguf_reads_every_fp4_weight_as_the_source_s(llama_ran: Ran, name: str) -> None:
    case = llama_ran.cases[name]
    got, want = gguf_fp4(case.dst, case), C.fp4_values(case, written=True)
    assert sorted(got) == sorted(want)
    bad = [m for m in want if not np.array_equal(got[m].astype(np.float32), want[m])]
    assert bad == [], f"{len(bad)} of {len(want)} FP4 Linears differ, first {bad[:3]}"
