"""Run in llama.cpp's venv (llama-cpp-python): load each case's GGUF, compute the prompt's logits, generate.

``python llama_run.py cases.json``; prints one line ``MARK <json>``: per case the logits of every prompt
position, the tokens generated greedily, or the error. Imports nothing from mxfp4conv or the tests.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

MARK = "MXFP4CONV-LLAMA-RESULT"


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=case["model"], n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=2,
                seed=0)
    prompt = case["prompt"]
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)], dtype=np.float64)
    out = {"name": case["name"], "logits": logits.tolist(), "n_vocab": llm.n_vocab()}
    llm.reset()
    tokens: list[int] = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy, past any end-of-generation token
        tokens.append(int(tok))
        if len(tokens) == 6:
            break
    out["generated"] = llm.detokenize(tokens).decode("utf-8", "replace")
    out["generated_ids"] = tokens
    out["generated_tokens"] = len(tokens)
    out["greedy"] = [int(i) for i in logits.argmax(-1)]
    return out


def main() -> None:
    import llama_cpp

    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = []
    for case in cases:
        try:
            results.append(run_case(case))
        except Exception as exc:  # one case's failure is reported, the others still run
            results.append({"name": case["name"], "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()})
    info = {"llama_cpp_python": llama_cpp.__version__,
            "system": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    print(MARK + json.dumps({"info": info, "results": results}), flush=True)


if __name__ == "__main__":
    main()
