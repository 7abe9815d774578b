"""Sources, ``--to mlx`` outputs and what MLX must compute from them (project venv side).

For each case: a tiny source checkpoint with a small word-level tokenizer (mlx_lm.load needs one), its
``--to mlx`` output, and two files of float32 tensors under mlx-lm's parameter names, made by the
test's own reading of the source (``tests/oracle.py``: numpy, no mxfp4conv code) and its own name
mapping (written from mlx-lm 0.32.2's ``sanitize`` methods, not from the writer):

* ``expected.safetensors``: every FP4 weight as ``mx.dequantize(..., mode="mxfp4")`` must give it:
  the source's values (MXFP4) or the oracle's MSE requantization of them (NVFP4), experts stacked;
* ``reference.safetensors``: the whole model in float32 as the source defines it (NVFP4 values not
  requantized), which mlx-lm's own model class runs unquantized as the logits reference.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from mxfp4conv.cli import cli
from tests import builders, oracle
from tests.producers.producers_lib import load_tensors

VOCAB = 256
PROMPT = [int(x) for x in np.random.default_rng(20261206).integers(3, VOCAB, 16)]
_EXPERT = re.compile(r"^(?P<c>.+)\.experts\.(?P<e>\d+)\.(?P<p>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# per-Linear tensors that are part of an FP4 encoding (scales), not parameters of their own
_QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_scale_2", "weight_global_scale", "input_scale",
                   "input_global_scale", "input_scale_2", "weight")


@dataclass
class Case:
    name: str
    src: Path
    dst: Path
    model_type: str
    nvfp4: bool


def add_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over tokens ``t0`` .. ``t255`` (ids = the model's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1", "eos_token": "t2",
        "model_max_length": 512}))


def sources(root: Path) -> list[Case]:
    """Every layout on a tiny Qwen3-MoE (GPT-OSS on its own), Mixtral, and the replicas (tests/replicas) of
    the families mlx-lm has a model for that convert: AutoRound's Qwen3-MoE (FP4 attention: dense FP4
    Linears), NVIDIA's Qwen3-MoE NVFP4 (FP4 attention, an FP8 KV cache), DeepSeek-R1 (NVIDIA's NVFP4 and
    AMD's Quark MXFP4, each with an MTP layer), GLM-4.5, GraniteMoE, Qwen3.5-MoE."""
    from tests.replicas import ct_families, deepseek, granitemoe, qwen35
    from tests.replicas.ct_families import autoround_mxfp4, glm45
    from tests.serving.serving_sources import build_moe

    out: dict[str, tuple[Path, str]] = {}
    for layout in ("ct-mxfp4", "gpt-oss", "modelopt-nvfp4", "ct-nvfp4"):
        out[f"{'gpt_oss' if layout == 'gpt-oss' else 'qwen3_moe-' + layout}"] = (
            builders.build(layout, root / layout), "gpt_oss" if layout == "gpt-oss" else "qwen3_moe")
    out["qwen3_moe-quark-mxfp4"] = (builders.quark_mxfp4(root / "quark-mxfp4"), "qwen3_moe")
    out["qwen3_moe-quark-nvfp4"] = (builders.quark_nvfp4(root / "quark-nvfp4"), "qwen3_moe")
    mixtral = build_moe("mixtral", root / "mixtral", seed=2)
    for layout in ("ct-mxfp4", "ct-nvfp4"):
        out[f"mixtral-{layout}"] = (mixtral.paths[layout], "mixtral")
    out["qwen3_moe-autoround-mxfp4"] = (autoround_mxfp4(root / "autoround").path, "qwen3_moe")
    out["glm4_moe-ct-nvfp4"] = (glm45(root / "glm45").path, "glm4_moe")
    out["granitemoe-ct-mxfp4"] = (granitemoe.llmcompressor_mxfp4(root / "granite").path, "granitemoe")
    out["qwen3_moe-modelopt-nvfp4-fp8kv"] = (ct_families.modelopt_nvfp4_qwen3(root / "qwen3-nvfp4").path, "qwen3_moe")
    out["deepseek_v3-modelopt-nvfp4-r1"] = (deepseek.modelopt_nvfp4_r1(root / "r1").path, "deepseek_v3")
    out["deepseek_v3-quark-mxfp4-r1"] = (deepseek.quark_mxfp4_r1(root / "r1-quark").path, "deepseek_v3")
    out["qwen3_5_moe-modelopt-nvfp4"] = (qwen35.modelopt_nvfp4_qwen35(root / "qwen35").path, "qwen3_5_moe")
    cases = []
    for name, (path, mt) in out.items():
        add_tokenizer(path)
        nv = any(isinstance(v, oracle.NV) for v in oracle.source_fp4(path).values())
        cases.append(Case(name, path, root / "out" / name, mt, nv))
    return cases


def convert(case: Case, *extra: str) -> str | None:
    """``mxfp4conv convert SRC DST --to mlx --device cpu``; None on success, else the CLI's error."""
    case.dst.parent.mkdir(parents=True, exist_ok=True)
    res = CliRunner().invoke(cli, ["convert", str(case.src), str(case.dst), "--to", "mlx", "--device", "cpu", *extra])
    return None if res.exit_code == 0 else f"exit {res.exit_code}: {res.stderr.strip() or res.output.strip()}"


def mlx_name(module: str, model_type: str) -> tuple[str, int | None]:
    """An FP4 Linear of the source -> (mlx-lm's module path, expert index or None)."""
    m = _EXPERT.match(module)
    if m is None:
        return module, None
    proj = _PROJ.get(m["p"], m["p"])
    if model_type == "gpt_oss":  # gpt_oss.sanitize: mlp.experts.{gate,up,down}_proj
        return f"{m['c']}.experts.{proj}", int(m["e"])
    return f"{m['c']}.switch_mlp.{proj}", int(m["e"])  # qwen3_moe / mixtral sanitize: switch_mlp


def _mtp(name: str, src: Path, model_type: str) -> bool:
    """A tensor of DeepSeek-V3's MTP layer (past num_hidden_layers): mlx-lm's model has none."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    if model_type != "deepseek_v3" or m is None:
        return False
    return int(m[1]) >= int(json.loads((src / "config.json").read_text())["num_hidden_layers"])


def _stack(parts: dict[str, dict[int | None, np.ndarray]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, by_e in parts.items():
        if None in by_e:
            out[name] = torch.from_numpy(np.ascontiguousarray(by_e[None]))
        else:
            out[name] = torch.from_numpy(np.stack([by_e[e] for e in range(len(by_e))]))
    return out


def _other_tensors(src: Path, fp4: set[str], model_type: str) -> dict[str, torch.Tensor]:
    """The source's non-FP4 tensors in float32 under mlx-lm's names (biases of FP4 Linears stacked)."""
    out: dict[str, torch.Tensor] = {}
    biases: dict[str, dict[int | None, np.ndarray]] = {}
    for name, t in load_tensors(src).items():
        module, _, suffix = name.rpartition(".")
        if _mtp(name, src, model_type):
            continue
        if name.endswith(("_blocks", "_scales", ".k_scale", ".v_scale")):  # KV-cache scales: no MLX parameter
            continue
        if name.endswith("gate_up_proj_bias"):  # GPT-OSS: gate on even rows, up on odd
            base = name[: -len("gate_up_proj_bias")]
            out[f"{base}gate_proj.bias"], out[f"{base}up_proj.bias"] = t[:, 0::2].float(), t[:, 1::2].float()
            continue
        if name.endswith("down_proj_bias"):
            out[f"{name[: -len('down_proj_bias')]}down_proj.bias"] = t.float()
            continue
        if module in fp4:
            if suffix == "bias":
                target, e = mlx_name(module, model_type)
                biases.setdefault(f"{target}.bias", {})[e] = t.float().numpy()
            elif suffix not in _QUANT_SUFFIXES:
                raise AssertionError(f"{name}: unexpected tensor of an FP4 Linear")
            continue
        out[name] = t.float()
    return {**out, **_stack(biases)}


def expect_dir(case: Case) -> Path:
    return case.dst.parent / f"{case.name}.expect"


def write_expectations(case: Case) -> None:
    """``expected.safetensors`` and ``reference.safetensors`` beside the output (see the module docstring)."""
    want: dict[str, dict[int | None, np.ndarray]] = {}
    ref: dict[str, dict[int | None, np.ndarray]] = {}
    fp4 = oracle.source_fp4(case.src)
    for module, w in fp4.items():
        if _mtp(module + ".", case.src, case.model_type):
            continue
        target, e = mlx_name(module, case.model_type)
        if isinstance(w, oracle.NV):
            ref.setdefault(f"{target}.weight", {})[e] = w.values
            want.setdefault(target, {})[e] = oracle.requantize(w.values).values().astype(np.float32)
        else:
            exact = w.values().astype(np.float32)  # E2M1 x 2^k: exact in float32
            ref.setdefault(f"{target}.weight", {})[e] = exact
            want.setdefault(target, {})[e] = exact
    folder = expect_dir(case)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_stack(want), str(folder / "expected.safetensors"))
    save_file({**_other_tensors(case.src, set(fp4), case.model_type), **_stack(ref)}, str(folder / "reference.safetensors"))


def swap_gate_up(dst: Path, out: Path) -> Path:
    """A copy of an MLX output whose first MoE layer has gate_proj and up_proj swapped (weights and
    scales): the negative control of the dequantization and logits checks."""
    from safetensors import safe_open

    shutil.copytree(dst, out)
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            t: dict[str, Any] = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
            meta = fh.metadata()
        gates = [k for k in t if ".layers.0." in k and ".gate_proj." in k and not k.endswith(".bias")]
        for k in gates:
            u = k.replace(".gate_proj.", ".up_proj.")
            t[k], t[u] = t[u], t[k]
        save_file(t, str(f), metadata=meta)
    return out
