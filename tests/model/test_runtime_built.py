"""Modules vLLM builds unquantized whatever the config says (``mxfp4conv.model.runtime_built``): a BF16 one is
accepted at planning and declared unquantized by name in the output's config, so every runtime reading
the output agrees; the same module under another architecture or quantization method is still a
contradiction. NVIDIA's Qwen3.5 NVFP4 layout (BF16 ``mtp.fc`` outside ``exclude_modules``) converts to
every target, each output declaring ``mtp.fc`` unquantized by the target's own matching rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mxfp4conv.cli import cli
from mxfp4conv.model.precision import Declared, build_precision
from mxfp4conv.model.runtime_built import EXEMPTIONS
from mxfp4conv.targets.resolve import resolve_ct, resolve_quark
from tests.replicas import BUILDERS, Replica

QWEN35 = "modelopt-nvfp4-qwen35-moe"


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Replica:
    return BUILDERS[QWEN35](tmp_path_factory.mktemp("qwen35") / "src")


@pytest.mark.parametrize("target", ["ct", "quark", "marlin"])
def test_qwen35_nvfp4_converts_with_mtp_fc_declared_unquantized(qwen35: Replica, tmp_path: Path, target: str) -> None:
    dst = tmp_path / "out"
    res = CliRunner().invoke(cli, ["convert", str(qwen35.path), str(dst), "--to", target, "--device", "cpu"])
    assert res.exit_code == 0, res.stderr
    q = json.loads(((dst / "rank-0") if target == "marlin" else dst).joinpath("config.json").read_text())[
        "quantization_config"]
    if target == "quark":
        assert "mtp.fc" in q["exclude"] and resolve_quark(q, "mtp.fc") == "bf16"
    else:
        assert "mtp.fc" in q["ignore"] and resolve_ct(q, "mtp.fc") == "bf16"


def _bf16(module: str, *, architecture: str, method: str | None = "modelopt_fp4",
          moe: str = "model.layers.0.mlp") -> list[tuple[str, str]]:
    """Problems of a BF16 ``module`` beside one FP4 MoE layer, under a main NVFP4 scheme that excludes nothing."""
    linears = {module: ("BF16", (64, 128))}
    fp4 = [f"{moe}.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    declared = Declared(main="nvfp4", method=method, source="hf_quant_config.json")
    return build_precision(linears, {f"{module}.weight": linears[module]}, fp4, declared, architecture=architecture)[1]


# (module, an architecture whose vLLM model code builds it unquantized)
BY_ARCHITECTURE = [
    ("mtp.fc", "Qwen3_5MoeForConditionalGeneration"),
    ("mtp.fc", "Qwen3NextForCausalLM"),
    ("model.layers.61.eh_proj", "DeepseekV3ForCausalLM"),
    ("model.layers.92.eh_proj", "Glm4MoeForCausalLM"),
    ("model.layers.0.self_attn.indexer.wk", "DeepseekV32ForCausalLM"),
    ("model.layers.0.self_attn.indexer.weights_proj", "DeepseekV32ForCausalLM"),
    ("vision_model.model.layers.0.self_attn.q_proj", "Llama4ForConditionalGeneration"),
    ("multi_modal_projector.linear_1", "Llama4ForConditionalGeneration"),
]
EVERY_MOE = ["model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", "lm_head"]


@pytest.mark.parametrize(("module", "architecture"), [*BY_ARCHITECTURE, *((m, "Qwen3MoeForCausalLM") for m in EVERY_MOE)])
def test_a_module_the_runtime_builds_unquantized_is_accepted(module: str, architecture: str) -> None:
    assert _bf16(module, architecture=architecture) == []


@pytest.mark.parametrize(("module", "architecture"), BY_ARCHITECTURE)
def test_the_same_module_of_another_architecture_is_a_contradiction(module: str, architecture: str) -> None:
    got = _bf16(module, architecture="Qwen3MoeForCausalLM")
    assert got == [(module, "tensors are unquantized but hf_quant_config.json declares nvfp4")], architecture


def test_mtp_fc_is_exempt_only_where_vllm_loads_the_source_as_modelopt_fp4() -> None:
    """vLLM's workaround asks ``quant_config.get_name() == "modelopt_fp4"``: under compressed-tensors the
    main scheme builds ``mtp.fc`` as FP4, so BF16 tensors there are a contradiction."""
    arch = "Qwen3_5MoeForConditionalGeneration"
    assert _bf16("mtp.fc", architecture=arch, method="compressed-tensors") != []
    assert _bf16("mtp.fc", architecture=arch, method=None) != []


def test_a_router_outside_a_moe_block_is_not_exempt() -> None:
    """A dense model's ``mlp.gate`` (no experts beside it) is not a router: the main scheme reaches it."""
    assert _bf16("model.layers.0.mlp.gate", architecture="Qwen3MoeForCausalLM", moe="model.layers.1.mlp") != []


def test_every_exemption_cites_the_runtime_code() -> None:
    for e in EXEMPTIONS:
        assert e.where.startswith("model_executor/") and ".py" in e.where and e.what, e
