"""Run ``--to mlx`` outputs with MLX itself (the .venv-mlx python; imports only mlx, mlx_lm, numpy).

    python mlx_run.py CASES.json   # prints one line: MARK + JSON list of results

Each case: ``{"name", "model", "expect", "prompt"}``; ``expect`` holds ``expected.safetensors`` (the
float32 weight every FP4 module must dequantize to) and ``reference.safetensors`` (the source in
float32 under mlx-lm's names). Per case: ``mlx_lm.load`` (strict: every tensor consumed, every parameter
given); every quantized module's ``mx.dequantize(weight, scales, mode=...)`` compared bit for bit with
the expected weight; the prompt's logits of the loaded model and of mlx-lm's same model class built
unquantized in float32 from the source's values and from the values written, and of the loaded
model with float32 activations;
``mlx_lm.generate`` for a few tokens.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

MARK = "MXFP4CONV-MLX-RESULT"


def _dequantized(model: nn.Module, expected: dict[str, mx.array]) -> dict[str, Any]:
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "scales") and hasattr(m, "mode")}
    exact, mismatched, modes = 0, [], sorted({m.mode for m in quantized.values()})
    for name, want in expected.items():
        m = quantized.get(name)
        if m is None:
            mismatched.append(f"{name}: not a quantized module of the loaded model")
            continue
        got = mx.dequantize(m.weight, m.scales, group_size=m.group_size, bits=m.bits, mode=m.mode, dtype=mx.float32)
        a, b = np.array(got).view(np.uint32), np.array(want).view(np.uint32)
        if a.shape == b.shape and np.array_equal(a, b):
            exact += 1
        else:
            bad = int((a != b).sum()) if a.shape == b.shape else -1
            mismatched.append(f"{name}: {bad} of {b.size} values differ" if bad >= 0 else f"{name}: shape {a.shape} != {b.shape}")
    return {"fp4_modules": len(quantized), "compared": len(expected), "exact": exact, "mismatched": mismatched[:8],
            "uncovered": sorted(set(quantized) - set(expected))[:8], "modes": modes}


def _renamed(model: nn.Module, by_module: dict[str, mx.array]) -> dict[str, mx.array]:
    """Module paths as the model's ``sanitize`` renames their weights (Qwen3.5: ``model.language_model`` ->
    ``language_model.model``); the identity for the other models."""
    if not hasattr(model, "sanitize"):
        return by_module
    names = model.sanitize({f"{k}.weight": mx.array([i]) for i, k in enumerate(by_module)})
    order = list(by_module.values())
    return {k.removesuffix(".weight"): order[int(v.item())] for k, v in names.items()}


def _logits(model_dir: Path, weights: dict[str, mx.array], prompt: list[int], dtype: mx.Dtype) -> np.ndarray:
    """The prompt's logits from mlx-lm's model class of ``model_dir`` built unquantized, ``weights`` in ``dtype``."""
    from mlx_lm.utils import _get_classes

    config = json.loads((model_dir / "config.json").read_text())
    for k in ("quantization", "quantization_config"):
        config.pop(k, None)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):  # as mlx_lm.load does (Qwen3.5: prefixes renamed, conv1d axes, norms)
        weights = model.sanitize(dict(weights))
    model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return np.array(model(mx.array([prompt])).astype(mx.float32))[0]


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    from mlx_lm import generate, load

    t0 = time.perf_counter()
    model_dir, expect = Path(case["model"]), Path(case["expect"])
    model, tokenizer = load(str(model_dir))
    expected = mx.load(str(expect / "expected.safetensors"))
    out: dict[str, Any] = {"name": case["name"], **_dequantized(model, _renamed(model, expected))}
    prompt = case["prompt"]
    out["logits"] = np.array(model(mx.array([prompt])).astype(mx.float32))[0].tolist()
    source = mx.load(str(expect / "reference.safetensors"))
    written = {**source, **{f"{n}.weight": w for n, w in expected.items()}}  # the values the output holds
    out["reference"] = _logits(model_dir, source, prompt, mx.float32).tolist()
    out["reference_written"] = _logits(model_dir, written, prompt, mx.float32).tolist()
    # the loaded model with its unquantized parameters in float32: MLX's FP4 kernels on float32 activations
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()))
    out["logits_f32"] = np.array(model(mx.array([prompt])))[0].tolist()
    model, tokenizer = load(str(model_dir))
    text = generate(model, tokenizer, prompt=prompt, max_tokens=6, verbose=False)
    out["generated"] = text
    out["generated_tokens"] = len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = []
    for case in cases:
        try:
            results.append(run_case(case))
        except Exception as exc:  # one case's failure is its result, not the others'
            results.append({"name": case["name"], "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-2000:]})
    info = {"mlx": mx.__version__, "device": str(mx.default_device())}
    print(MARK + json.dumps({"info": info, "results": results}), flush=True)


if __name__ == "__main__":
    main()
