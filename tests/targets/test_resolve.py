"""The config proof (mxfp4conv/targets/resolve.py): every module of a real-family replica resolves, by the
runtime's matching rules, to the precision the source gave it; a config that mis-declares one layer,
drops an FP8 KV cache or excludes an Attention layer is caught, naming the layer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from mxfp4conv.plan.inspect import analyze, writer_context
from mxfp4conv.sources.checkpoint import open_checkpoint
from mxfp4conv.targets import get_target
from mxfp4conv.targets.base import WriterContext
from mxfp4conv.targets.resolve import config_proof, resolve_ct, resolve_quark
from tests.replicas import BUILDERS


def _planned(tmp_path: Path, family: str, target: str) -> tuple[dict[str, Any], WriterContext]:
    r = BUILDERS[family](tmp_path / family)
    ckpt = open_checkpoint(r.path)
    _, plan, _ = analyze(ckpt)
    ctx = writer_context(plan, ckpt, {"target": target})
    tgt = get_target(target)
    assert tgt.refuse(ctx) is None
    return tgt.config(ckpt.config, ctx), ctx


@pytest.mark.parametrize(("family", "target"), [
    ("modelopt-nvfp4-deepseek-r1", "ct"), ("modelopt-nvfp4-deepseek-r1", "quark"),
    ("modelopt-mixed-deepseek_v3", "ct"), ("modelopt-mixed-deepseek_v3", "quark"),
    ("modelopt-mixed-deepseek_v32", "marlin"), ("ct-mixed-nvfp4-fp8block-deepseek-r1", "ct"),
    ("ct-nvfp4-llama4", "quark"), ("quark-mxfp4-deepseek-r1", "ct"), ("autoround-mxfp4-qwen3-moe", "quark"),
])
def test_written_configs_resolve_as_the_source_meant(tmp_path: Path, family: str, target: str) -> None:
    cfg, ctx = _planned(tmp_path, family, target)
    assert config_proof(cfg, ctx) == []


def test_fp8_layer_declared_unquantized_is_caught(tmp_path: Path) -> None:
    cfg, ctx = _planned(tmp_path, "modelopt-mixed-deepseek_v3", "ct")
    fp8 = next(iter(ctx.precision.fp8))
    bad = copy.deepcopy(cfg)
    bad["quantization_config"]["ignore"].append(fp8)
    found = config_proof(bad, ctx)
    assert found and found[0]["tensor"] == fp8 and "fp8-tensor" in found[0]["message"], found


def test_dropped_fp8_group_falls_under_linear_and_is_caught(tmp_path: Path) -> None:
    cfg, ctx = _planned(tmp_path, "modelopt-mixed-deepseek_v3", "ct")
    bad = copy.deepcopy(cfg)
    groups = bad["quantization_config"]["config_groups"]
    for name in [n for n, g in groups.items() if g["format"] == "float-quantized"]:
        del groups[name]
    found = config_proof(bad, ctx)
    assert found and "gives it mxfp4, the source fp8-tensor" in found[0]["message"], found


def test_mtp_exclusion_as_exact_names_is_caught(tmp_path: Path) -> None:
    """Exact names of today's MTP modules do not match vLLM's ``mtp_block`` names: the FP4 scheme applies."""
    cfg, ctx = _planned(tmp_path, "modelopt-nvfp4-deepseek-r1", "ct")
    bad = copy.deepcopy(cfg)
    q = bad["quantization_config"]
    mtp = f"model.layers.{ctx.facts.num_layers}"
    q["ignore"] = [e for e in q["ignore"] if mtp.replace(".", "\\.") not in e] + \
        [m for m in ctx.precision.bf16 if m.startswith(mtp + ".")]
    found = config_proof(bad, ctx)
    assert found and ".mtp_block." in found[0]["tensor"], found


@pytest.mark.parametrize("target", ["ct", "quark"])
def test_lost_kv_cache_is_caught(tmp_path: Path, target: str) -> None:
    cfg, ctx = _planned(tmp_path, "ct-nvfp4-llama4", target)
    assert ctx.precision.kv_cache == "fp8"
    bad = copy.deepcopy(cfg)
    q = bad["quantization_config"]
    if target == "ct":
        q["kv_cache_scheme"] = None
    else:
        q["export"]["kv_cache_group"] = []
    found = config_proof(bad, ctx)
    assert found and "KV cache declared unquantized" in found[-1]["message"], found


def test_quark_exclude_reaching_attention_is_caught(tmp_path: Path) -> None:
    """vLLM's Quark loader asks ``exclude`` about Attention layers: one excluded loses its FP8 KV cache."""
    cfg, ctx = _planned(tmp_path, "ct-nvfp4-llama4", "quark")
    bad = copy.deepcopy(cfg)
    bad["quantization_config"]["exclude"].append("re:.*self_attn.*")
    found = config_proof(bad, ctx)
    assert found and found[-1]["tensor"].endswith("self_attn.attn"), found


def test_matching_rules_golden() -> None:
    q = {"ignore": ["lm_head", "re:.*mlp\\.gate$"],
         "config_groups": {"a": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 4, "group_size": 32}},
                           "b": {"targets": ["re:.*self_attn\\.o_proj$"],
                                 "weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}}}
    assert resolve_ct(q, "lm_head") == "bf16"
    assert resolve_ct(q, "model.layers.0.mlp.gate") == "bf16"
    assert resolve_ct(q, "model.layers.0.self_attn.o_proj") == "fp8-tensor"  # a name beats the class
    assert resolve_ct(q, "model.layers.0.self_attn.q_proj") == "mxfp4"
    mx = {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32}}
    fp8 = {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}}
    qq = {"exclude": ["model.layers.3.mlp.experts.0.gate_proj", "re:.*self_attn\\.q_proj$"],
          "layer_quant_config": {"model.layers.1.self_attn.o_proj": fp8, "model.layers.9.*o_proj": fp8},
          "global_quant_config": mx}
    assert resolve_quark(qq, "model.layers.3.mlp.experts", moe=True) == "bf16"  # a plain entry under the layer
    assert resolve_quark(qq, "model.layers.3.mlp.experts") == "mxfp4"
    assert resolve_quark(qq, "model.layers.0.self_attn.q_proj") == "bf16"
    assert resolve_quark(qq, "model.layers.1.self_attn.o_proj") == "fp8-tensor"
    assert resolve_quark(qq, "layers.1.self_attn.o_proj") == "fp8-tensor"  # a key without * matches as a substring
    assert resolve_quark(qq, "model.layers.9.mtp_block.self_attn.o_proj") == "fp8-tensor"
    assert resolve_quark(qq, "model.layers.2.self_attn.o_proj") == "mxfp4"


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_a_config_that_misdeclares_a_layer_is_never_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 command: str) -> None:
    """A writer that dropped the FP8 groups (the FP8 attention then falls under the FP4 ``Linear`` group):
    convert's proof fails with exit 3 and publishes nothing; verify of such an output fails the same way."""
    from click.testing import CliRunner

    from mxfp4conv.cli import cli
    from mxfp4conv.targets import ct

    src = BUILDERS["modelopt-mixed-deepseek_v3"](tmp_path / "src").path
    dst = tmp_path / "out"

    def no_fp8_groups(ctx: WriterContext) -> dict[str, Any]:
        q = real(ctx)
        q["config_groups"] = {"group_0": q["config_groups"]["group_0"]}
        return q

    real = ct.quantization_config
    if command == "verify":  # a correct output, then its config replaced by the broken writer's
        assert CliRunner().invoke(cli, ["convert", str(src), str(dst), "--to", "ct"]).exit_code == 0
        monkeypatch.setattr(ct, "quantization_config", no_fp8_groups)
        import json

        from mxfp4conv.plan.inspect import analyze, writer_context

        ckpt = open_checkpoint(src)
        _, plan, _ = analyze(ckpt)
        bad = ct.CtTarget().config(ckpt.config, writer_context(plan, ckpt, {"target": "ct"}))
        (dst / "config.json").write_text(json.dumps(bad))
        res = CliRunner().invoke(cli, ["verify", str(src), str(dst)])
    else:
        monkeypatch.setattr(ct, "quantization_config", no_fp8_groups)
        res = CliRunner().invoke(cli, ["convert", str(src), str(dst), "--to", "ct"])
        assert not dst.exists()
    assert res.exit_code == 3, res.output
    assert "gives it mxfp4, the source fp8-tensor" in res.stderr, res.stderr
