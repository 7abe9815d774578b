"""Run inside vLLM's venv: build a vLLM model from one Marlin-ready rank folder and load its weights.

    python vllm_load.py CASES_JSON OUT_JSON

vLLM's own config, model construction and default loader run on the CPU, with the plugin loaded
through the ``vllm.general_plugins`` entry point. Every repack / Marlin preparation function of vLLM
is replaced by one that records the call and raises. For a TP rank other than 0 of a single process,
vLLM's tensor-parallel group is replaced by a stand-in that reports that size and rank (the layers
then allocate that rank's partition). After loading, every tensor of the rank folder is compared byte
for byte with the parameter (slice) the plugin loaded it into, and the plugin's post-load step is run
(on the CPU it must refuse: there is no Marlin kernel). Several cases run in one process (vLLM's
import dominates the time); one JSON result per case goes into OUT_JSON (vLLM logs to stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from pathlib import Path

REPACK_FUNCTIONS = {
    "vllm._custom_ops": ["gptq_marlin_repack", "awq_marlin_repack"],
    "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4": [
        "prepare_fp4_layer_for_marlin", "prepare_moe_fp4_layer_for_marlin", "prepare_moe_mxfp4_layer_for_marlin",
        "prepare_nvfp4_moe_layer_for_marlin", "nvfp4_marlin_process_scales", "mxfp4_marlin_process_scales"],
    "vllm.model_executor.layers.quantization.utils.marlin_utils": ["marlin_permute_scales", "marlin_permute_bias"],
}
CALLS: list[str] = []


def block_repacks() -> None:
    import importlib

    for mod_name, names in REPACK_FUNCTIONS.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            if not hasattr(mod, name):
                continue

            def boom(*_a: object, _n: str = f"{mod_name}.{name}", **_k: object) -> None:
                CALLS.append(_n)
                raise RuntimeError(f"{_n} was called")

            setattr(mod, name, boom)


class FakeTP:
    """Stands in for vLLM's TP GroupCoordinator: the size and rank the layers read, nothing else."""

    def __init__(self, real: object, size: int, rank: int) -> None:
        self._real, self.world_size, self.rank_in_group = real, size, rank

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(rank_dir: str, tp_size: int, tp_rank: int, engine_args: dict[str, object]) -> tuple[object, object]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins
    from vllm.utils.torch_utils import set_default_torch_dtype

    load_general_plugins()
    kw: dict[str, object] = {"dtype": "bfloat16", "load_format": "auto", **engine_args}
    args = EngineArgs(model=rank_dir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=64, **kw)
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        if ps._TP is None:
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                            distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo")
            ps.ensure_model_parallel_initialized(1, 1)
        real = getattr(ps._TP, "_real", ps._TP)
        ps._TP = FakeTP(real, tp_size, tp_rank) if tp_size > 1 else real
        vllm_config.parallel_config.tensor_parallel_size = tp_size
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
            loader.load_weights(model, vllm_config.model_config)
    return model, vllm_config


def compare(model: object) -> dict[str, object]:
    import torch
    from safetensors import safe_open

    from mxfp4conv.vllm_plugin.loading import plugin_slots

    slots, names, folder = plugin_slots(model)  # type: ignore[arg-type]
    rank_dir = str(folder)
    params = dict(model.named_parameters())  # type: ignore[attr-defined]
    out: dict[str, object] = {"folder": rank_dir, "slots": len(slots), "marlin_tensors": len(names), "compared": 0, "differ": [],
                              "passthrough_equal": 0, "passthrough_differ": [],
                              "not_loaded": sorted(n for n, s in slots.items() if not s.loaded)}
    for f in sorted(Path(rank_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                if name not in slots:
                    p = params.get(name)
                    if p is not None and tuple(p.shape) == tuple(fh.get_slice(name).get_shape()):
                        ok = torch.equal(p.data, fh.get_tensor(name).to(p.dtype))
                        key = "passthrough_equal" if ok else "passthrough_differ"
                        if ok:
                            out[key] = int(out[key]) + 1  # type: ignore[call-overload]
                        else:
                            out[key].append(name)  # type: ignore[attr-defined]
                    continue
                want = fh.get_tensor(name)
                got = slots[name].view()
                same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(
                    got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
                out["compared"] = int(out["compared"]) + 1  # type: ignore[call-overload]
                if not same:
                    out["differ"].append(name)  # type: ignore[attr-defined]
    return out


def fp8_params(model: object, rank_dir: str) -> dict[str, bool]:
    """qkv_proj's FP8 weight (the q/k/v shards concatenated) and o_proj's, each equal to the rank's bytes."""
    import torch
    from safetensors import safe_open

    params = dict(model.named_parameters())  # type: ignore[attr-defined]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(rank_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            tensors.update({n: fh.get_tensor(n) for n in fh.keys() if n.endswith("proj.weight")})  # noqa: SIM118
    out: dict[str, bool] = {}
    for name, p in params.items():
        if p.dtype != torch.float8_e4m3fn:
            continue
        module = name.removesuffix(".weight")
        parts = [f"{module.removesuffix('qkv_proj')}{s}.weight" for s in ("q_proj", "k_proj", "v_proj")] \
            if module.endswith("qkv_proj") else [name]
        want = torch.cat([tensors[n] for n in parts]) if all(n in tensors for n in parts) else None
        out[name] = want is not None and torch.equal(p.data.view(torch.uint8), want.view(torch.uint8))
    return out


def run_case(case: dict[str, object]) -> dict[str, object]:
    """One case: {"rank_dir", "tp_size", "tp_rank", "engine_args", "env", "vllm_version"}."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    env = dict(case.get("env") or {})  # type: ignore[call-overload]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if case.get("vllm_version"):  # what an untested release sees: the plugin registers its refusal only
        from mxfp4conv import vllm_plugin

        vllm_plugin._register_refusal(str(case["vllm_version"]))
    CALLS.clear()
    doc: dict[str, object] = {}
    try:
        model, vllm_config = build(str(case["rank_dir"]), int(case.get("tp_size", 1)),  # type: ignore[call-overload]
                                   int(case.get("tp_rank", 0)), dict(case.get("engine_args") or {}))  # type: ignore[call-overload]
    except Exception as e:  # the refusal under test, or a failure to report
        doc.update(error=str(e), error_type=type(e).__name__, traceback=traceback.format_exc(), repack_calls=list(CALLS))
        return doc
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if case.get("vllm_version"):
            from mxfp4conv.vllm_plugin import config

            config.register()
    doc.update(compare(model))
    doc["methods"] = sorted({type(m.quant_method).__name__ for m in model.modules()  # type: ignore[attr-defined]
                             if getattr(m, "quant_method", None) is not None})
    doc["fp8_params"] = fp8_params(model, str(case["rank_dir"]))
    try:
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))  # type: ignore[attr-defined]
        doc["after_loading"] = "ok"
    except Exception as e:
        doc["after_loading"] = f"{type(e).__name__}: {e}"
    doc["repack_calls"] = list(CALLS)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", help="JSON file: a list of cases (see run_case)")
    ap.add_argument("out", help="JSON file written with one result per case")
    a = ap.parse_args()
    block_repacks()
    cases = json.loads(Path(a.cases).read_text())
    results = [run_case(c) for c in cases]
    Path(a.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
