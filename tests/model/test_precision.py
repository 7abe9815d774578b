"""mxfp4conv/model/precision.py: pattern normalisation, vLLM's matching rule, MTP names, and the precision model
built from headers (FP8 per-tensor / 128x128 blocks, unquantized Linears, foreign FP4) with its cross-check
against what the source config declares."""

from __future__ import annotations

import fnmatch

import pytest

from mxfp4conv.model.precision import (
    EMBEDDINGS,
    Declared,
    Fp8Linear,
    Precision,
    build_precision,
    ct_group_precision,
    expert_container,
    fnmatch_to_re,
    matches,
    mtp_runtime_name,
    quark_spec_precision,
    runtime_pattern,
)

Header = dict[str, tuple[str, tuple[int, ...]]]

# ---------------------------------------------------------------------------------------------- fnmatch_to_re


@pytest.mark.parametrize(("pattern", "children", "want"), [
    ("lm_head", False, "lm_head"),  # a plain name stays an exact name
    ("re:.*self_attn.*", False, "re:.*self_attn.*"),  # re: passes through
    ("re:.*self_attn.*", True, "re:.*self_attn.*"),
    ("model.layers.*.mlp.gate", False, r"re:model\.layers\..*\.mlp\.gate$"),
    ("model.layers.61*", False, r"re:model\.layers\.61.*$"),
    ("model.layers.?.mlp", False, r"re:model\.layers\..\.mlp$"),
    ("*", False, "re:.*$"),
    ("lm_head", True, r"re:lm_head(\..*)?$"),  # a module and everything under it
    ("model.layers.*.self_attn", True, r"re:model\.layers\..*\.self_attn(\..*)?$"),
    ("a+b(c)", False, "a+b(c)"),  # no wildcard: regex metacharacters are part of the exact name
    ("a+b(c)*", False, r"re:a\+b\(c\).*$"),
])
def test_fnmatch_to_re_golden(pattern: str, children: bool, want: str) -> None:
    assert fnmatch_to_re(pattern, children=children) == want


@pytest.mark.parametrize("pattern", ["model.layers.*.mlp.gate", "model.layers.61*", "*.self_attn.?_proj", "lm_*"])
@pytest.mark.parametrize("name", ["model.layers.0.mlp.gate", "model.layers.12.mlp.gate", "model.layers.0.mlp.gate_x",
                                  "model.layers.61.mtp_block.x", "model.layers.610", "model.layers.6",
                                  "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.qq_proj", "lm_head",
                                  "xlm_head"])
def test_fnmatch_wildcards_keep_fnmatch_meaning(pattern: str, name: str) -> None:
    got = fnmatch_to_re(pattern)
    assert got.startswith("re:")
    assert matches(got, name) == fnmatch.fnmatchcase(name, pattern)


@pytest.mark.parametrize(("name", "want"), [
    ("lm_head", True), ("lm_head.weight", True), ("lm_headx", False), ("model.lm_head", False),
])
def test_fnmatch_children_cover_the_module_and_what_is_under_it(name: str, want: bool) -> None:
    assert matches(fnmatch_to_re("lm_head", children=True), name) is want


# ---------------------------------------------------------------------------------------------- matches


@pytest.mark.parametrize(("pattern", "name", "want"), [
    ("lm_head", "lm_head", True),
    ("lm_head", "lm_head.weight", False),  # exact: no prefix matching
    ("lm_head", "model.lm_head", False),
    ("model.layers.*.mlp.gate", "model.layers.0.mlp.gate", False),  # a wildcard without re: is a name
    ("re:.*mlp.gate$", "model.layers.0.mlp.gate", True),
    ("re:.*mlp.gate$", "model.layers.0.mlp.gate_up", False),
    ("re:mlp", "model.layers.0.mlp.gate", False),  # re.match anchors at the start
    ("re:model", "model.layers.0.mlp.gate", True),  # ... but not at the end
    ("re:model$", "model.layers.0", False),
    ("re:[", "[", False),  # an invalid regex matches nothing
])
def test_matches_is_vllms_rule(pattern: str, name: str, want: bool) -> None:
    assert matches(pattern, name) is want


# ---------------------------------------------------------------------------------------------- runtime_pattern


def test_runtime_pattern_mtp_layer_also_matches_the_renamed_module() -> None:
    got = runtime_pattern("model.layers.61.self_attn.q_a_proj", 61)
    assert got == r"re:model\.layers\.61\.(mtp_block\.)?self_attn\.q_a_proj$"
    assert matches(got, "model.layers.61.self_attn.q_a_proj")
    assert matches(got, "model.layers.61.mtp_block.self_attn.q_a_proj")
    assert not matches(got, "model.layers.61.self_attn.q_a_proj_x")
    assert not matches(got, "model.layers.61.other.self_attn.q_a_proj")
    assert not matches(got, "model.layers.6.self_attn.q_a_proj")


@pytest.mark.parametrize(("module", "layers", "want"), [
    ("model.layers.60.self_attn.q_proj", 61, "model.layers.60.self_attn.q_proj"),  # a decoder layer
    ("model.layers.0.mlp.gate", 0, "model.layers.0.mlp.gate"),
    ("model.layers.1.mlp.gate", 1, r"re:model\.layers\.1\.(mtp_block\.)?mlp\.gate$"),
    ("model.layers.5.mlp.gate", 0, "model.layers.5.mlp.gate"),  # num_hidden_layers unknown (0): unchanged
    ("lm_head", 2, "lm_head"),
    ("mtp.0.ffn.experts.0.w1", 2, "mtp.0.ffn.experts.0.w1"),  # no "layers.N." part
    ("layers.2.attn.wq_a", 2, r"re:layers\.2\.(mtp_block\.)?attn\.wq_a$"),
    ("model.language_model.layers.3.mlp.gate", 3, r"re:model\.language_model\.layers\.3\.(mtp_block\.)?mlp\.gate$"),
])
def test_runtime_pattern_golden(module: str, layers: int, want: str) -> None:
    assert runtime_pattern(module, layers) == want


def test_runtime_pattern_past_the_last_layer_by_more_than_one() -> None:
    got = runtime_pattern("model.layers.63.mlp.experts.0.w1", 61)
    assert matches(got, "model.layers.63.mtp_block.mlp.experts.0.w1") and matches(got, "model.layers.63.mlp.experts.0.w1")


@pytest.mark.parametrize(("module", "layers", "want"), [
    ("model.layers.3.mlp.experts", 3, r"re:model\.layers\.3\.(mtp_block\.)?mlp\.experts(\..*)?$"),
    ("model.layers.2.mlp.experts", 3, r"re:model\.layers\.2\.mlp\.experts(\..*)?$"),
    ("lm_head", 3, r"re:lm_head(\..*)?$"),
])
def test_runtime_pattern_with_children(module: str, layers: int, want: str) -> None:
    got = runtime_pattern(module, layers, children=True)
    assert got == want
    assert matches(got, module) and matches(got, module + ".0.gate_proj") and not matches(got, module + "_x")


@pytest.mark.parametrize(("module", "layers", "want"), [
    ("model.layers.61.self_attn.q_a_proj", 61, "model.layers.61.mtp_block.self_attn.q_a_proj"),
    ("model.layers.60.self_attn.q_a_proj", 61, None),
    ("model.layers.61.self_attn.q_a_proj", 0, None),
    ("mtp.0.ffn.experts.0.w1", 2, None),
])
def test_mtp_runtime_name(module: str, layers: int, want: str | None) -> None:
    assert mtp_runtime_name(module, layers) == want


@pytest.mark.parametrize(("module", "want"), [
    ("model.layers.3.mlp.experts.0.gate_proj", "model.layers.3.mlp.experts"),
    ("layers.0.ffn.experts.12.w1", "layers.0.ffn.experts"),
    ("model.layers.3.mlp.experts.gate_up_proj", None),
    ("model.layers.3.mlp.shared_experts.gate_proj", None),
    ("model.layers.3.mlp.experts.0.gate_proj.weight_packed", None),
])
def test_expert_container(module: str, want: str | None) -> None:
    assert expert_container(module) == want


FP8_SPEC = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}


@pytest.mark.parametrize(("spec", "want"), [
    ({"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32}}, "mxfp4"),
    ({"weight": [{"dtype": "fp4", "qscheme": "per_group", "group_size": 16}, FP8_SPEC]}, "nvfp4"),
    ({"weight": FP8_SPEC}, "fp8-tensor"),
    ({"weight": {"dtype": "fp8_e4m3", "qscheme": "per_block", "block_size": [128, 128]}}, "fp8-block"),
    ({"weight": {"dtype": "fp8_e4m3", "qscheme": "per_block", "block_size": [1, 128]}}, None),
    ({"weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel"}}, None),
    ({"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 64}}, None),
    ({"weight": None}, None),
    ({"weight": []}, None),
    ("not a dict", None),
])
def test_quark_spec_precision(spec: object, want: str | None) -> None:
    assert quark_spec_precision(spec) == want


@pytest.mark.parametrize(("weights", "want"), [
    ({"type": "float", "num_bits": 4, "group_size": 32}, "mxfp4"),
    ({"type": "float", "num_bits": 4, "group_size": 16}, "nvfp4"),
    ({"type": "float", "num_bits": 8, "strategy": "tensor"}, "fp8-tensor"),
    ({"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]}, "fp8-block"),
    ({"type": "float", "num_bits": 8, "strategy": "channel"}, None),
    ({"type": "int", "num_bits": 4, "group_size": 32}, None),
    (None, None),
])
def test_ct_group_precision(weights: dict[str, object] | None, want: str | None) -> None:
    assert ct_group_precision({"weights": weights, "targets": ["Linear"]}) == want


# ---------------------------------------------------------------------------------------------- build_precision

OPROJ, QPROJ, KPROJ, GATE = ("model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
              "model.layers.0.mlp.gate")


Spec = tuple[str, tuple[int, ...], dict[str, tuple[str, tuple[int, ...]]]]


def _header(modules: dict[str, Spec]) -> tuple[Header, Header]:
    """(linears, tensors) for module -> (weight dtype, weight shape, {partner suffix: (dtype, shape)})."""
    linears: Header = {}
    tensors: Header = {}
    for module, (dtype, shape, partners) in modules.items():
        linears[module] = (dtype, shape)
        tensors[f"{module}.weight"] = (dtype, shape)
        for suffix, ref in partners.items():
            tensors[f"{module}.{suffix}"] = ref
    return linears, tensors


def _one(dtype: str, shape: tuple[int, ...], partners: dict[str, tuple[str, tuple[int, ...]]],
         declared: Declared | None = None) -> tuple[Fp8Linear | None, list[tuple[str, str]]]:
    linears, tensors = _header({"m": (dtype, shape, partners)})
    model, problems = build_precision(linears, tensors, [], declared or Declared())
    return model.fp8.get("m"), problems


@pytest.mark.parametrize(("partners", "want"), [
    ({"weight_scale": ("F32", ()), "input_scale": ("F32", ())}, Fp8Linear("m", "fp8-tensor", "weight_scale", "F32", True)),
    ({"weight_scale": ("F32", (1,))}, Fp8Linear("m", "fp8-tensor", "weight_scale", "F32", False)),
    ({"weight_scale": ("F32", ()), "input_scale": ("F32", (1,))}, Fp8Linear("m", "fp8-tensor", "weight_scale", "F32", True)),
    # an input scale that is not one value is not a static per-tensor activation scale
    ({"weight_scale": ("F32", ()), "input_scale": ("F32", (4,))}, Fp8Linear("m", "fp8-tensor", "weight_scale", "F32", False)),
    # 128x128 blocks of a [200, 300] weight: [ceil(200/128), ceil(300/128)] = [2, 3]
    ({"weight_scale_inv": ("F32", (2, 3))}, Fp8Linear("m", "fp8-block", "weight_scale_inv", "F32")),
    ({"weight_scale": ("BF16", (2, 3))}, Fp8Linear("m", "fp8-block", "weight_scale", "BF16")),
    ({"scale": ("F8_E8M0", (2, 3))}, Fp8Linear("m", "fp8-block", "scale", "F8_E8M0")),
    # DeepSeek's name wins when a file holds both spellings
    ({"weight_scale_inv": ("F32", (2, 3)), "weight_scale": ("F32", ())}, Fp8Linear("m", "fp8-block", "weight_scale_inv", "F32")),
], ids=["tensor+input", "tensor-1", "tensor-input-1", "tensor-input-vector", "block-inv", "block-ct-bf16",
        "block-v4-e8m0", "inv-first"])
def test_fp8_linears_are_classified(partners: dict[str, tuple[str, tuple[int, ...]]], want: Fp8Linear) -> None:
    got, problems = _one("F8_E4M3", (200, 300), partners)
    assert problems == []
    assert got == want


def test_fp8_block_of_an_exact_multiple_and_of_a_smaller_weight() -> None:
    assert _one("F8_E4M3", (256, 512), {"weight_scale_inv": ("F32", (2, 4))})[0] is not None
    got, _ = _one("F8_E4M3", (64, 64), {"weight_scale_inv": ("F32", (1, 1))})
    assert got is not None and got.kind == "fp8-block"  # [1, 1] is one block, not a per-tensor scale


@pytest.mark.parametrize(("partners", "tensor", "message"), [
    ({"weight_scale_inv": ("F32", (3, 3))}, "m.weight_scale_inv",
     "FP8 scale shape [3, 3] is neither per-tensor nor [128x128] blocks of weight [200, 300]"),
    ({"weight_scale": ("F32", (200,))}, "m.weight_scale", "FP8 scale shape [200] is neither per-tensor"),
    ({"weight_scale": ("U8", ())}, "m.weight_scale", "FP8 scale dtype U8 is not a float scale"),
    ({}, "m.weight", "FP8 weight without a scale tensor (weight_scale, weight_scale_inv or scale)"),
])
def test_fp8_problems_name_the_tensor(partners: dict[str, tuple[str, tuple[int, ...]]], tensor: str,
                                      message: str) -> None:
    got, problems = _one("F8_E4M3", (200, 300), partners)
    assert got is None
    assert len(problems) == 1
    assert problems[0][0] == tensor and problems[0][1].startswith(message), problems


def test_unquantized_linears_embeddings_and_foreign_fp4() -> None:
    linears, tensors = _header({
        "model.embed_tokens": ("BF16", (256, 64), {}),
        "transformer.wte": ("BF16", (256, 64), {}),
        "vision_model.patch_embedding.linear": ("BF16", (64, 48), {}),  # an nn.Linear inside an embedding block
        "model.embed_tokens_proj": ("BF16", (64, 64), {}),
        "lm_head": ("BF16", (256, 64), {}),
        "model.layers.0.mlp.gate": ("F32", (4, 64), {}),
        # packed FP4 in a naming the layout does not convert (DeepSeek-V4 scale, ct/Quark weight_scale)
        "model.layers.0.mlp.shared.w1": ("I8", (64, 32), {"scale": ("F8_E8M0", (64, 2))}),
        "model.layers.0.mlp.shared.w2": ("U8", (64, 32), {"weight_scale": ("U8", (64, 2))}),
        "model.layers.0.mlp.shared.w3": ("U8", (64, 32), {"weight_scale": ("F8_E4M3", (64, 4))}),
        # one-byte weights without a 2-D block scale are not FP4
        "model.layers.0.mlp.odd": ("U8", (64, 32), {"weight_scale": ("U8", (64,))}),
        "model.layers.0.mlp.bare": ("I8", (64, 32), {}),
    })
    model, problems = build_precision(linears, tensors, [], Declared())
    assert problems == []
    assert model.fp8 == {}
    assert model.foreign_fp4 == ("model.layers.0.mlp.shared.w1", "model.layers.0.mlp.shared.w2",
                                 "model.layers.0.mlp.shared.w3")
    assert model.bf16 == ("lm_head", "model.embed_tokens_proj", "model.layers.0.mlp.bare", "model.layers.0.mlp.gate",
                          "model.layers.0.mlp.odd", "vision_model.patch_embedding.linear")
    assert {"embed_tokens", "wte"} <= EMBEDDINGS and "patch_embedding" not in EMBEDDINGS


def test_model_carries_the_declaration() -> None:
    linears, tensors = _header({"o": ("F8_E4M3", (64, 64), {"weight_scale": ("F32", ())}),
                                "q": ("F8_E4M3", (64, 64), {"weight_scale_inv": ("F32", (1, 1))}),
                                "k": ("BF16", (64, 64), {})})
    declared = Declared(unquantized=("model.layers.61*", "lm_head", "re:.*k$"), kv_cache="fp8")
    model, problems = build_precision(linears, tensors, ["experts.0.w1"], declared, inferred=True)
    assert problems == []
    assert model.kv_cache == "fp8" and model.inferred is True
    assert model.unquantized_patterns == (r"re:model\.layers\.61.*$", "lm_head", "re:.*k$")
    assert list(model.fp8) == ["o", "q"] and model.bf16 == ("k",)
    assert model.counts(fp4_experts=24, fp4_dense=2) == {"fp4_experts": 24, "fp4_dense": 2, "fp8_tensor": 1,
                                                          "fp8_block": 1, "bf16": 1}


def test_counts_include_foreign_fp4_modules() -> None:
    linears, tensors = _header({
        "model.layers.0.mlp.experts.0.w1": ("I8", (64, 32), {"scale": ("F8_E8M0", (64, 2))}),
        "model.layers.0.mlp.experts.1.w1": ("I8", (64, 32), {"scale": ("F8_E8M0", (64, 2))}),
        "model.layers.0.mlp.shared.w1": ("I8", (64, 32), {"scale": ("F8_E8M0", (64, 2))}),
    })
    model, _ = build_precision(linears, tensors, [], Declared())
    assert model.counts(fp4_experts=6, fp4_dense=0) == {"fp4_experts": 8, "fp4_dense": 1, "fp8_tensor": 0,
                                                         "fp8_block": 0, "bf16": 0}


# ---------------------------------------------------------------------------------------------- cross-check


def _mixed() -> tuple[Header, Header, list[str]]:
    linears, tensors = _header({
        OPROJ: ("F8_E4M3", (64, 64), {"weight_scale": ("F32", ()), "input_scale": ("F32", ())}),
        QPROJ: ("F8_E4M3", (64, 64), {"weight_scale_inv": ("F32", (1, 1))}),
        KPROJ: ("BF16", (32, 64), {}),
        GATE: ("BF16", (4, 64), {}),
    })
    fp4 = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    return linears, tensors, fp4


def _problems(declared: Declared) -> dict[str, str]:
    linears, tensors, fp4 = _mixed()
    _, problems = build_precision(linears, tensors, fp4, declared)
    return dict(problems)


def test_consistent_declarations_raise_nothing() -> None:
    assert _problems(Declared(unquantized=("re:.*k_proj$", "model.layers.*.mlp.gate"))) == {}
    # MIXED_PRECISION: every quantized module listed, the rest unquantized
    listed: dict[str, Precision] = {OPROJ: "fp8-tensor", QPROJ: "fp8-block", "model.layers.0.mlp.experts.*": "nvfp4"}
    assert _problems(Declared(listed=listed, exhaustive=True)) == {}


def test_fp8_tensors_declared_unquantized() -> None:
    got = _problems(Declared(unquantized=("model.layers.*.self_attn*",), source="hf_quant_config.json"))
    assert got == {OPROJ: "tensors are fp8-tensor but hf_quant_config.json declares the module unquantized",
                   QPROJ: "tensors are fp8-block but hf_quant_config.json declares the module unquantized"}


def test_fp8_declared_with_another_scheme() -> None:
    got = _problems(Declared(listed={OPROJ: "fp8-block", "re:.*q_proj$": "fp8-tensor"}))
    assert got == {OPROJ: "tensors are fp8-tensor but config.json declares fp8-block",
                   QPROJ: "tensors are fp8-block but config.json declares fp8-tensor"}


def test_mixed_precision_lists_are_exhaustive() -> None:
    """ModelOpt MIXED_PRECISION: a module the list does not name is unquantized, so unlisted FP8 is a problem
    and unlisted BF16 is not; a BF16 module the list calls FP8 is a problem too."""
    listed: dict[str, Precision] = {QPROJ: "fp8-block", KPROJ: "fp8-tensor", "model.layers.0.mlp.experts.*": "nvfp4"}
    got = _problems(Declared(listed=listed, exhaustive=True))
    assert got == {OPROJ: "tensors are fp8-tensor but config.json declares the module unquantized",
                   KPROJ: "tensors are unquantized but config.json declares fp8-tensor"}


def test_non_exhaustive_lists_leave_unlisted_modules_alone() -> None:
    assert _problems(Declared(listed={QPROJ: "fp8-block"})) == {}


def test_fp4_modules_declared_otherwise() -> None:
    got = _problems(Declared(listed={"model.layers.0.mlp.experts.1.*": "fp8-tensor", OPROJ: "fp8-tensor"}))
    assert set(got) == {f"model.layers.0.mlp.experts.1.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert all(m == "tensors are FP4 but config.json declares fp8-tensor" for m in got.values())


def test_an_invalid_regex_in_the_declaration_matches_nothing() -> None:
    got = _problems(Declared(unquantized=("re:[", "re:.*o_proj$")))
    assert got == {OPROJ: "tensors are fp8-tensor but config.json declares the module unquantized"}


def test_source_wildcards_become_patterns_that_match_runtime_names() -> None:
    declared = Declared(unquantized=("model.layers.*.self_attn.k_proj", "re:.*mlp\\.gate$"))
    linears, tensors, fp4 = _mixed()
    model, problems = build_precision(linears, tensors, fp4, declared)
    assert problems == []
    assert model.unquantized_patterns == (r"re:model\.layers\..*\.self_attn\.k_proj$", r"re:.*mlp\.gate$")
    k_pattern = model.unquantized_patterns[0]
    assert matches(k_pattern, KPROJ) and matches(k_pattern, "model.layers.61.mtp_block.self_attn.k_proj")
    assert not matches(k_pattern, "model.layers.0.self_attn.k_proj_a")
