"""Run inside vLLM's CPU venv: serve checkpoints with vLLM's offline ``LLM`` and report prompt logprobs.

    python vllm_serve.py CASES_JSON

CASES_JSON holds a list of cases ``{"name", "model", "prompts": [[token ids], ...], "params": bool}``.
Each checkpoint is served in turn in this one process (vLLM's import and CPU platform set-up dominate
the time): ``LLM(model=..., skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
max_model_len=64)``, one ``TokensPrompt`` per prompt, ``SamplingParams(max_tokens=1,
prompt_logprobs=20, detokenize=False)``. With ``"params": true`` the case also returns, through
``LLM.apply_model``, the sha256 of every parameter and buffer of the loaded model (after vLLM's
post-load processing) with its dtype and shape.

vLLM 0.32 offers its CPU MXFP4 MoE experts (``CPUExpertsMxfp4``: VNNI-prepacked weights,
``fused_experts_cpu`` through oneDNN brgemm) only where ``torch.cpu._is_amx_tile_supported()``; on
an x86 CPU without AMX (AVX512-BF16 only, e.g. the AMD EPYC these tests run on) no MXFP4 MoE backend
is left and every MXFP4 MoE checkpoint is refused. There, and only there, this script lifts that one
device gate (``_supports_current_device``) so the same backend, weight processing and kernel run;
every result says so (``"mxfp4_moe_gate"``). Whether that kernel computes the right thing on such a
CPU is what the tests' lossless comparison with the float32 reference checks.

stdout: vLLM logs, then one line ``MXFP4CONV-SERVING-RESULT <json>`` holding one result per case:
``{"name", "prompt_logprobs": [[{token id: logprob} per position (position 0 has none)] per
prompt], "seconds", "params"?}`` or ``{"name", "error", "traceback"}`` when vLLM refused the
checkpoint (the other cases still run).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
MARK = "MXFP4CONV-SERVING-RESULT"
TOP = 20


def lift_amx_gate() -> str:
    """"amx" when the CPU has AMX tiles (nothing changed), else "lifted (no AMX)" after lifting the gate."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "amx"
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cpu_moe.CPUExpertsMxfp4._supports_current_device = staticmethod(lambda: True)
    return "lifted (no AMX)"


def param_digests(model: object) -> dict[str, list[object]]:
    import torch

    out: dict[str, list[object]] = {}
    tensors = list(model.named_parameters()) + list(model.named_buffers())  # type: ignore[attr-defined]
    for name, t in tensors:
        data = t.detach().contiguous().cpu()
        raw = data.reshape(-1).view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
        out[name] = [str(data.dtype), list(data.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()]
    return out


def serve(case: dict[str, object]) -> dict[str, object]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=str(case["model"]), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=64, seed=0, kv_cache_memory_bytes=64 << 20)
    try:
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in case["prompts"]]  # type: ignore[attr-defined]
        sp = SamplingParams(max_tokens=1, prompt_logprobs=TOP, detokenize=False, temperature=0.0)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        doc: dict[str, object] = {"name": case["name"], "prompt_logprobs": [
            [None if pos is None else {str(tok): float(lp.logprob) for tok, lp in pos.items()}
             for pos in o.prompt_logprobs] for o in outs]}
        if case.get("params"):
            doc["params"] = llm.apply_model(param_digests)[0]
    finally:
        del llm
        gc.collect()
    doc["seconds"] = time.perf_counter() - t0
    return doc


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    gate = lift_amx_gate()
    results = []
    for case in cases:
        try:
            results.append({**serve(case), "mxfp4_moe_gate": gate})
        except Exception as e:  # a refusal is a result: the test reports it
            results.append({"name": case["name"], "error": f"{type(e).__name__}: {e}", "mxfp4_moe_gate": gate,
                            "traceback": traceback.format_exc()[-4000:]})
    sys.stdout.flush()
    print(f"{MARK} {json.dumps(results)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
