"""A source whose quantization config contradicts its tensors is refused at planning (README "Exit
codes"): exit 1, one line naming the module, what the config says and what the tensors are, for
``inspect``, ``convert`` and ``convert --no-verify``, and nothing written. The contradictions a
runtime resolves on its own are not refused: modules vLLM builds without the quantization config
(``mxfp4conv.model.runtime_built``: routers, the output head, Qwen3.5's ``mtp.fc`` under ModelOpt FP4, ...) and
an ignored parent module whose Linear sits under it. A BF16 module the runtime would build with the
config's FP4 scheme is refused, in those same checkpoints too."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mxfp4conv.cli import cli
from tests.builders import build
from tests.replicas import BUILDERS


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.stderr


def refusal(command: str, err: str) -> list[str]:
    """convert's refusal is its whole stderr, one line; inspect prints its report, then one problem line
    per contradicting module."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if command == "inspect":
        lines = [ln for ln in lines if ln.startswith(("error:", "problem:"))]
        assert lines, err
    else:
        assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def with_config(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def ct_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("ct-mxfp4", tmp_path_factory.mktemp("contra") / "src", shards=1)


def bf16_attention_claimed(q: dict[str, Any]) -> None:
    """The config's ``Linear`` group reaches the BF16 attention: its ignore entry is gone."""
    q["ignore"] = ["lm_head", "re:.*mlp.gate$"]


def fp4_experts_ignored(q: dict[str, Any]) -> None:
    """The config ignores layer 1's experts, whose tensors are MXFP4."""
    q["ignore"] = [*q["ignore"], "re:model\\.layers\\.1\\.mlp\\.experts\\..*"]


CASES = [
    (bf16_attention_claimed, "model.layers.0.self_attn.k_proj", "tensors are unquantized but config.json declares mxfp4"),
    (fp4_experts_ignored, "model.layers.1.mlp.experts.0.gate_proj",
     "tensors are FP4 but config.json declares the module unquantized"),
]


@pytest.mark.parametrize(("edit", "module", "message"), CASES, ids=["bf16-claimed-by-fp4", "fp4-ignored"])
@pytest.mark.parametrize("argv", [["inspect"], ["convert"], ["convert", "--no-verify"]], ids=" ".join)
def test_a_contradiction_is_refused_at_planning(ct_src: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None],
                                                module: str, message: str, argv: list[str]) -> None:
    src = with_config(ct_src, tmp_path / "src", edit)
    before = digest(src)
    dst = tmp_path / "out"
    args = [argv[0], str(src)] + ([str(dst), "--device", "cpu", *argv[1:]] if argv[0] == "convert" else [])
    code, err = run(*args)
    assert code == 1, err
    lines = refusal(argv[0], err)
    assert module in lines[0] and message in lines[0], err
    assert "report this" not in err and "Traceback" not in err
    assert not dst.exists() and not any(p.name.endswith("mxfp4conv-staging") for p in tmp_path.iterdir())
    assert digest(src) == before


def test_an_ignored_parent_module_covers_its_linear(ct_src: Path, tmp_path: Path) -> None:
    """llm-compressor's GraniteMoE saves ``...router`` in ignore while the Linear is ``...router.layer``:
    the source converts, and the output's ignore names the Linear itself for every reader."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(ct_src, src)
    f = src / "model.safetensors"
    t = load_file(str(f))
    for name in [n for n in t if n.endswith("self_attn.o_proj.weight")]:
        t[name.replace("o_proj.weight", "o_proj.layer.weight")] = t.pop(name)
    save_file(t, str(f), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.gate$", "re:.*self_attn\\.[qkv]_proj$",
                                            *(f"model.layers.{i}.self_attn.o_proj" for i in range(2))]
    (src / "config.json").write_text(json.dumps(cfg))
    assert run("inspect", str(src))[0] == 0
    code, err = run("convert", str(src), str(tmp_path / "out"), "--to", "ct", "--device", "cpu")
    assert code == 0, err
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {f"model.layers.{i}.self_attn.o_proj.layer" for i in range(2)} <= set(ignore)


def _refused(src: Path, module: str, message: str) -> None:
    for argv in (["inspect", str(src)], ["convert", str(src), str(src.parent / "out"), "--device", "cpu"]):
        code, err = run(*argv)
        lines = refusal(argv[0], err)
        assert code == 1 and module in lines[0] and message in lines[0], err
    assert not (src.parent / "out").exists()


def test_qwen35_nvfp4_mtp_layer_claimed_by_nvfp4_is_refused(tmp_path: Path) -> None:
    """NVIDIA's Qwen3.5 layout without its ``mtp.layers.0*`` exclusion: vLLM builds the MTP decoder layer
    with the ModelOpt config (only ``mtp.fc`` is forced unquantized), so its BF16 tensors contradict it."""
    src = BUILDERS["modelopt-nvfp4-qwen35-moe"](tmp_path / "src").path
    hq = json.loads((src / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"].remove("mtp.layers.0*")
    (src / "hf_quant_config.json").write_text(json.dumps(hq))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["ignore"].remove("mtp.layers.0*")
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(src, "mtp.layers.0.", "tensors are unquantized but hf_quant_config.json declares nvfp4")


def test_a_bf16_mtp_fc_under_compressed_tensors_is_refused(tmp_path: Path) -> None:
    """vLLM forces ``mtp.fc`` unquantized only for ``modelopt_fp4``: a compressed-tensors Qwen3-Next whose
    ``Linear`` group reaches a BF16 ``mtp.fc`` would have it built as NVFP4."""
    import torch
    from safetensors.torch import load_file, save_file

    src = BUILDERS["ct-nvfp4-qwen3-next"](tmp_path / "src").path
    shard = sorted(src.glob("model-*.safetensors"))[0]
    tensors = load_file(str(shard))
    tensors["mtp.fc.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)  # [H, 2H], as Qwen3-Next's MTP has it
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.fc.weight"] = shard.name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(src, "mtp.fc", "tensors are unquantized but config.json declares nvfp4")
