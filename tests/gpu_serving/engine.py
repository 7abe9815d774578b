"""The engine's process of the GPU serving test: serve checkpoints with vLLM's offline ``LLM``, in turn.

    python engine.py CASES_JSON RESULTS_JSONL

Runs under the GPU machine's python3 with the unpacked bundle first on ``PYTHONPATH`` (vLLM 0.33.0
and the mxfp4conv wheel, whose ``vllm.general_plugins`` entry point vLLM loads). The engine core runs
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so what is counted here is what the engine did.

Before the first case, every function of vLLM that prepares or repacks weights for Marlin is
wrapped, in its module and in every module that imported it by name, by one that counts its calls
and then runs it. Each case: ``LLM(model, dtype=bfloat16, enforce_eager, Triton attention,
max_model_len=64, ...)`` with the case's engine arguments and environment, then two token prompts
with ``prompt_logprobs`` over the whole vocabulary and four greedy tokens. Written per case, one JSON
line each (so that a later crash loses nothing before it): the prompt logprobs, the generated
tokens, the calls counted during that case (and the process id that made them), the seconds of
``LLM()`` and of ``generate``, the quantization methods and MoE / Linear kernels the model holds, the
sha256 of every parameter and buffer after loading, or the exception (its type, message, the chain of
causes, the traceback) when vLLM refused the checkpoint.

``"vllm_version"`` in a case makes ``vllm.__version__`` read that version while the plugins are
loaded again for it (what an untested release looks like to the plugin's entry point); the real
version is restored after it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)

# vLLM's Marlin weight preparation: repacks of the FP4 codes, scale / bias permutations and conversions
COUNTED = {
    "vllm._custom_ops": ["gptq_marlin_repack", "awq_marlin_repack", "gptq_marlin_moe_repack", "awq_marlin_moe_repack"],
    "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4": [
        "prepare_fp4_layer_for_marlin", "prepare_moe_fp4_layer_for_marlin", "prepare_moe_mxfp4_layer_for_marlin",
        "prepare_nvfp4_moe_layer_for_marlin", "nvfp4_marlin_process_scales", "mxfp4_marlin_process_scales",
        "nvfp4_marlin_process_global_scale"],
    "vllm.model_executor.layers.quantization.utils.marlin_utils": ["marlin_permute_scales", "marlin_permute_bias"],
}
CALLS: Counter[str] = Counter()
CALL_PIDS: set[int] = set()


def count_marlin_preparation() -> dict[str, int]:
    """Wrap every COUNTED function where it is defined and wherever a loaded module holds it by name."""
    import importlib

    wrapped: dict[str, int] = {}
    originals: dict[int, tuple[str, Any]] = {}
    for mod_name, names in COUNTED.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            real = getattr(mod, name, None)
            if real is None:
                continue
            key = f"{mod_name.rsplit('.', 1)[-1]}.{name}"

            def counted(*a: Any, _key: str = key, _real: Any = real, **k: Any) -> Any:
                CALLS[_key] += 1
                CALL_PIDS.add(os.getpid())
                return _real(*a, **k)

            originals[id(real)] = (key, counted)
            wrapped[key] = 0
    for mod in list(sys.modules.values()):
        for attr, value in list(getattr(mod, "__dict__", {}).items()):
            hit = originals.get(id(value))
            if hit is not None:
                setattr(mod, attr, hit[1])
                wrapped[hit[0]] += 1  # modules holding it: 1 is its own module
    return wrapped


def describe(model: Any) -> dict[str, list[str]]:
    out: dict[str, set[str]] = {"methods": set(), "moe_kernels": set(), "linear_schemes": set()}
    for _, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        out["methods"].add(type(qm).__name__)
        mk = getattr(qm, "moe_kernel", None)
        if mk is not None:
            fe = getattr(mk, "fused_experts", None)
            out["moe_kernels"].add(f"{type(mk).__name__}/{type(fe).__name__ if fe is not None else '-'}")
        scheme = getattr(m, "scheme", None)
        if scheme is not None:
            kernel = getattr(scheme, "kernel", None)
            out["linear_schemes"].add(type(scheme).__name__ + (f"/{type(kernel).__name__}" if kernel is not None else ""))
    return {k: sorted(v) for k, v in out.items()}


def digests(model: Any) -> dict[str, list[Any]]:
    import torch

    out: dict[str, list[Any]] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        data = t.detach().contiguous().cpu()
        raw = data.reshape(-1).view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
        out[name] = [str(data.dtype), list(data.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()]
    return out


def causes(e: BaseException) -> list[list[str]]:
    chain, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append([type(cur).__name__, str(cur)])
        cur = cur.__cause__ or cur.__context__
    return chain


def serve(case: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = int(case["vocab"])
    kw: dict[str, Any] = {"model": case["model"], "skip_tokenizer_init": True, "enforce_eager": True,
                          "dtype": "bfloat16", "max_model_len": 64, "seed": 0, "max_num_seqs": 4,
                          "max_num_batched_tokens": 256, "kv_cache_memory_bytes": 256 << 20, "max_logprobs": vocab,
                          "attention_backend": "TRITON_ATTN", **case.get("engine_args", {})}
    doc: dict[str, Any] = {"name": case["name"], "engine_args": {k: v for k, v in kw.items() if k != "model"}}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    doc["t_init"] = round(time.perf_counter() - t0, 3)
    try:
        doc["engine_core"] = type(llm.llm_engine.engine_core).__name__
        doc["model"] = llm.apply_model(describe)[0]
        if case.get("params", True):
            doc["params"] = llm.apply_model(digests)[0]
        prompts = case.get("prompts") or []
        if prompts:
            sp = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=vocab, logprobs=1, detokenize=False)
            t1 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
            doc["t_generate"] = round(time.perf_counter() - t1, 3)
            doc["generated"] = [list(o.outputs[0].token_ids) for o in outs]
            doc["prompt_logprobs"] = [[None if pos is None else [pos[t].logprob if t in pos else None for t in range(vocab)]
                                       for pos in o.prompt_logprobs] for o in outs]
    finally:
        del llm
    return doc


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import plugins
    from vllm.distributed import cleanup_dist_env_and_memory

    env = dict(case.get("env") or {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    real_version = vllm.__version__
    if case.get("vllm_version"):
        vllm.__version__ = str(case["vllm_version"])
        plugins.plugins_loaded = False
    CALLS.clear()
    CALL_PIDS.clear()
    t0 = time.perf_counter()
    try:
        doc = serve(case)
    except Exception as e:  # a refusal is a result: the test judges it
        doc = {"name": case["name"], "error": str(e), "error_type": type(e).__name__, "causes": causes(e),
               "traceback": traceback.format_exc()[-6000:]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if case.get("vllm_version"):
            vllm.__version__ = real_version
            plugins.plugins_loaded = False  # the next case loads the plugin as the real release
        gc.collect()
        cleanup_dist_env_and_memory()
    doc["seconds"] = round(time.perf_counter() - t0, 3)
    doc["calls"] = dict(CALLS)
    doc["call_pids"] = sorted(CALL_PIDS)
    doc["engine_pid"] = os.getpid()
    return doc


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    done = {json.loads(ln)["name"] for ln in out.read_text().splitlines() if ln.strip()} if out.exists() else set()
    t0 = time.perf_counter()
    import vllm

    header = {"name": "_process", "vllm": vllm.__version__, "vllm_file": vllm.__file__,
              "t_import": round(time.perf_counter() - t0, 3), "pid": os.getpid()}
    header["wrapped"] = count_marlin_preparation()
    with open(out, "a") as fh:
        fh.write(json.dumps(header) + "\n")
    for case in cases:
        if case["name"] in done:
            continue
        print(f"==== engine case {case['name']}", flush=True)
        doc = run_case(case)
        print(f"==== engine case {case['name']}: {doc.get('error_type', 'ok')} {doc.get('t_init', '')} s "
              f"calls {doc['calls']}", flush=True)
        with open(out, "a") as fh:
            fh.write(json.dumps(doc) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
