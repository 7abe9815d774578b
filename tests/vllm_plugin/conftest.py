"""Tiny Marlin-ready outputs for the plugin tests, made by the CLI from examples/tiny.py checkpoints (once per session)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mxfp4conv.cli import cli
from tests.builders import build, quant_mxfp4

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def qwen3_fp4_attention(root: Path) -> Path:
    """Qwen3-MoE, compressed-tensors MXFP4 experts *and* attention (q/k/v packed, o row-parallel)."""
    src = build("ct-mxfp4", root, layers=2, experts=4, hidden=256, inter=128, shards=1)
    shard = src / "model.safetensors"
    t = load_file(str(shard))
    for name in [n for n in t if n.endswith(".weight") and n.rsplit(".", 2)[-2] in ATTN]:
        m = name.removesuffix(".weight")
        t[f"{m}.weight_packed"], t[f"{m}.weight_scale"] = quant_mxfp4(t.pop(name).float())
    save_file(t, str(shard), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    (src / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return src


def qwen3_fp8_attention(root: Path) -> Path:
    """Qwen3-MoE, compressed-tensors MXFP4 experts beside FP8 per-tensor attention with static input scales
    (two config groups naming their modules): the Marlin rank's native config must still describe the
    FP8 layers, which vLLM's own compressed-tensors scheme loads."""
    import torch

    src = build("ct-mxfp4", root, layers=2, experts=4, hidden=256, inter=128, shards=1)
    shard = src / "model.safetensors"
    t = load_file(str(shard))
    for name in [n for n in t if n.endswith(".weight") and n.rsplit(".", 2)[-2] in ATTN]:
        m = name.removesuffix(".weight")
        w = t.pop(name).float()
        scale = w.abs().max() / 448.0
        t[f"{m}.weight"] = (w / scale).to(torch.float8_e4m3fn)
        t[f"{m}.weight_scale"] = scale.reshape(())
        t[f"{m}.input_scale"] = torch.tensor(0.05)
    save_file(t, str(shard), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    q = cfg["quantization_config"]
    mx = q["config_groups"]["group_0"]
    fp8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False,
           "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {},
           "scale_dtype": None, "zp_dtype": None}
    q["config_groups"] = {"group_0": {**mx, "targets": ["re:.*mlp\\.experts.*"]},
                          "group_1": {"format": "float-quantized", "targets": ["re:.*self_attn\\.[qkvo]_proj$"],
                                      "weights": fp8, "input_activations": fp8, "output_activations": None}}
    q["format"] = "mixed-precision"
    q["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    (src / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return src


def gpt_oss_padded(root: Path) -> Path:
    """GPT-OSS with sizes vLLM's Marlin path pads: H 128 -> 256, I 192 -> 256 (TP 1) / 96 -> 128 (TP 2)."""
    return build("gpt-oss", root, layers=2, experts=4, hidden=128, inter=192, shards=2)


def qwen3_nvfp4(root: Path) -> Path:
    """Qwen3-MoE, ModelOpt NVFP4 experts (kept as NVFP4 with --keep-nvfp4: global scales per expert)."""
    return build("modelopt-nvfp4", root, layers=1, experts=4, hidden=256, inter=128, shards=1)


def convert(src: Path, dst: Path, *extra: str) -> Path:
    res = CliRunner().invoke(cli, ["convert", str(src), str(dst), "--to", "marlin", "--device", "cpu", *extra])
    if res.exit_code != 0:
        raise RuntimeError(f"convert {src.name} {' '.join(extra)}: {res.stderr or res.output} {res.exception!r}")
    return dst


@pytest.fixture(scope="session")
def marlin_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    r = tmp_path_factory.mktemp("marlin_ready")
    q3, go, nv = qwen3_fp4_attention(r / "q3src"), gpt_oss_padded(r / "gosrc"), qwen3_nvfp4(r / "nvsrc")
    fp8 = qwen3_fp8_attention(r / "fp8src")
    return {"q3src": q3, "gosrc": go, "nvsrc": nv, "root": r, "fp8": convert(fp8, r / "fp8"),
            "q3tp1": convert(q3, r / "q3tp1"), "q3tp2": convert(q3, r / "q3tp2", "--tp-size", "2"),
            "gotp1": convert(go, r / "gotp1"), "gotp2": convert(go, r / "gotp2", "--tp-size", "2"),
            "nv": convert(nv, r / "nv", "--keep-nvfp4"), "gosgl": convert(go, r / "gosgl", "--engine", "sglang")}
