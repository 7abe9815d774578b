"""Real published FP4 MoE checkpoint families (tests/replicas): ``inspect`` names them, and every
(family, target) pair either converts into an output a runtime serves as the source meant it
(each module's precision resolved from the output config by vLLM's rules, the KV cache carried,
non-FP4 bytes unchanged) or is refused with one line and no output."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mxfp4conv.cli import cli
from tests.oracle import compare, output_fp4, source_fp4
from tests.replicas import BUILDERS, PURE_NVFP4, Replica
from tests.replicas.common import ROUTED_EXPERT_RE
from tests.replicas.resolver import kv_cache, kv_cache_declared, resolve

TARGETS = ("ct", "quark", "marlin")
FAMILIES = list(BUILDERS)
FP4 = ("mxfp4", "nvfp4")


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Replica]:
    """Each family built once per module, on first use."""
    root = tmp_path_factory.mktemp("replicas")
    built: dict[str, Replica] = {}

    def get(family: str) -> Replica:
        if family not in built:
            built[family] = BUILDERS[family](root / family)
        return built[family]

    return get


@pytest.fixture(scope="module")
def converted(replica: Callable[[str], Replica], tmp_path_factory: pytest.TempPathFactory,
              ) -> Callable[[str, str], tuple[Replica, Path, int, str]]:
    """(replica, DST, exit code, stderr) of ``convert --to target``, each pair run once."""
    root = tmp_path_factory.mktemp("converted")
    done: dict[tuple[str, str], tuple[Replica, Path, int, str]] = {}

    def get(family: str, target: str) -> tuple[Replica, Path, int, str]:
        if (family, target) not in done:
            r = replica(family)
            dst = root / f"{family}--{target}"
            code, _, err = run("convert", str(r.path), str(dst), "--to", target, "--device", "cpu")
            done[family, target] = (r, dst, code, err)
        return done[family, target]

    return get


def raw_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, bytes) of every tensor in a folder's safetensors files, from the headers."""
    out: dict[str, tuple[str, list[int], bytes]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        blob = f.read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + n])
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            b, e = meta["data_offsets"]
            out[name] = (meta["dtype"], meta["shape"], blob[8 + n + b:8 + n + e])
    return out


def output_dir(dst: Path, target: str) -> Path:
    return dst / "rank-0" if target == "marlin" else dst


def accepted(expect: str, err: str) -> bool:
    return any(alt.strip().lower() in err.lower() for alt in expect.split("|"))


# inspect -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_names_layout_scheme_and_precisions(replica: Callable[[str], Replica], family: str) -> None:
    r = replica(family)
    code, out, err = run("inspect", str(r.path), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["problems"] == []
    assert (doc["layout"], doc["scheme"]) == (r.layout, r.scheme)
    assert doc.get("precision") == r.precision_counts()
    assert bool(doc.get("inferred_layout")) is r.inferred_layout
    offered = {t for t in doc["targets"] if t in TARGETS}
    assert offered == {t for t, why in r.expected_targets.items() if why is None}


def test_inspect_infers_the_layout_without_any_quantization_config(replica: Callable[[str], Replica],
                                                                   tmp_path: Path) -> None:
    """DeepSeek-R1-FP4 shards and config.json without hf_quant_config.json: the layout comes from
    the tensors alone, and inspect says so."""
    r = replica("modelopt-nvfp4-deepseek-r1")
    src = tmp_path / "r1-no-quant-config"
    shutil.copytree(r.path, src, ignore=shutil.ignore_patterns("hf_quant_config.json"))
    _, out, err = run("inspect", str(src), "--json")
    doc = json.loads(out)
    assert doc["layout"] == "modelopt-nvfp4" and doc["inferred_layout"] is True, err


def test_precision_counts_cover_every_linear_module(replica: Callable[[str], Replica]) -> None:
    """The oracle itself: routed-expert entries are one per projection, and V4's MTP experts count
    as FP4 experts while DeepSeek-R1's BF16 MTP experts count as BF16."""
    r1 = replica("modelopt-nvfp4-deepseek-r1")
    counts = r1.precision_counts()
    mtp_experts = [m for m in r1.modules if m.startswith("model.layers.3.") and ROUTED_EXPERT_RE.search(m)]
    assert len(mtp_experts) == 12 and all(r1.modules[m] == "bf16" for m in mtp_experts)
    assert counts["fp4_experts"] == 2 * 4 * 3 and counts["fp8_tensor"] == counts["fp8_block"] == 0
    v4 = replica("deepseek-v4-native-mxfp4")
    assert v4.precision_counts()["fp4_experts"] == 3 * 4 * 3


# convert -----------------------------------------------------------------------------------------
PAIRS = [(f, t) for f in FAMILIES for t in TARGETS]


@pytest.mark.parametrize(("family", "target"), PAIRS)
def test_convert_serves_as_the_source_meant(converted: Callable[[str, str], tuple[Replica, Path, int, str]],
                                           family: str, target: str) -> None:
    r, dst, code, err = converted(family, target)
    expect = r.expected_targets[target]
    if expect is not None:
        assert code == 1, f"expected a refusal containing {expect!r}, got exit {code}: {err}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and accepted(expect, lines[0]), err
        assert not dst.exists()
        assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]  # no staging left
        return
    assert code == 0, err
    vcode, vout, verr = run("verify", str(r.path), str(dst))
    assert vcode == 0, verr or vout
    out = output_dir(dst, target)
    cfg = json.loads((out / "config.json").read_text())
    if target == "marlin":
        assert "mxfp4conv_marlin" in cfg["quantization_config"]
    _check_resolution(r, cfg)
    _check_kv_cache(r, cfg)
    _check_bytes(r, target, out)


def _check_resolution(r: Replica, cfg: dict[str, Any]) -> None:
    """(b) every source module, under each of its runtime names, gets the precision it must have."""
    wrong = []
    for module, precision in r.modules.items():
        want = "mxfp4" if precision in FP4 else precision
        for name in r.runtime_names(module):
            try:
                got = resolve(cfg, name, fused=r.fused, prefix_map=r.config_prefix_map, expert_projs=r.expert_projs)
            except AssertionError as exc:
                got = f"vLLM refuses: {exc}"
            if got != want:
                wrong.append(f"{module} as {name}: {got}, expected {want}")
    assert not wrong, f"{len(wrong)} modules resolve wrongly, e.g.:\n" + "\n".join(wrong[:12])


def _check_kv_cache(r: Replica, cfg: dict[str, Any]) -> None:
    """(c) FP8 KV-cache quantization is declared when the source has it (and not invented), and
    every attention layer the runtime builds as ``Attention`` gets it (DeepSeek's MLAAttention gets
    no KV-cache method from a compressed-tensors or Quark config in vLLM 0.32)."""
    assert kv_cache_declared(cfg) == r.kv_cache
    for layer in r.attention_layers:
        got = kv_cache(cfg, layer, fused=r.fused, prefix_map=r.config_prefix_map, mla=r.mla)
        want = None if r.mla else r.kv_cache
        assert got == want, f"{layer}: KV cache {got}, source {r.kv_cache}"


FP4_OWN = frozenset({"weight", "weight_packed", "weight_scale", "weight_scale_2", "weight_global_scale", "scale",
                     "input_scale", "input_scale_2", "input_global_scale"})


def _carried_name(r: Replica, target: str, name: str) -> str | None:
    """The output name of a source tensor that must arrive unchanged; None for an FP4 module's own
    tensors (a KV-cache scale stored under an FP4 ``k_proj`` is not one of them)."""
    module, _, suffix = name.rpartition(".")
    if r.modules.get(module) in FP4 and suffix in FP4_OWN:
        return None
    renames = r.renames.get(target, {})
    return f"{module}.{renames[suffix]}" if suffix in renames and r.modules.get(module) == "fp8-block" else name


def _check_bytes(r: Replica, target: str, out: Path) -> None:
    """(d) non-FP4 tensors byte-identical (under the target's documented renames), nothing else in
    the output but each FP4 module's MXFP4 pair; MXFP4 sources' FP4 codes and scales bit-exact."""
    src, dst = raw_tensors(r.path), raw_tensors(out)
    fp4 = r.fp4_modules()
    problems = []
    carried = set()
    for name, entry in src.items():
        out_name = _carried_name(r, target, name)
        if out_name is None:
            continue
        carried.add(out_name)
        got = dst.get(out_name)
        if got is None:
            problems.append(f"{name}: missing from the output (as {out_name})")
        elif got != entry:
            problems.append(f"{name} -> {out_name}: {got[0]}{got[1]} differs from {entry[0]}{entry[1]}")
    if target != "marlin":  # Marlin repacks FP4 tensors under its own names; verify re-encodes those
        packed_out = "weight_packed" if target == "ct" else "weight"
        fp4_out = {f"{m}.{s}" for m in fp4 for s in (packed_out, "weight_scale")}
        problems += [f"{n}: in the output but neither carried nor an MXFP4 tensor of an FP4 module"
                     for n in sorted(set(dst) - fp4_out - carried)]
        problems += [f"{n}: MXFP4 tensor missing" for n in sorted(fp4_out - set(dst))]
        if r.source_quant() == "mxfp4":
            for module in fp4:
                packed_src = "weight_packed" if f"{module}.weight_packed" in src else "weight"
                scale_src = "weight_scale" if f"{module}.weight_scale" in src else "scale"  # DeepSeek-V4
                for s_name, o_name in ((f"{module}.{packed_src}", f"{module}.{packed_out}"),
                                       (f"{module}.{scale_src}", f"{module}.weight_scale")):
                    got = dst.get(o_name)
                    if got is not None and got[2] != src[s_name][2]:
                        problems.append(f"{s_name} -> {o_name}: FP4 bytes not bit-exact")
    assert not problems, f"{len(problems)} tensors differ, e.g.:\n" + "\n".join(problems[:12])


# exit codes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_exits_0_with_no_problems(replica: Callable[[str], Replica], family: str) -> None:
    """Every published family is a checkpoint its runtime serves: inspect reports no problem."""
    code, out, err = run("inspect", str(replica(family).path), "--json")
    assert code == 0, err
    assert json.loads(out)["problems"] == []


@pytest.mark.parametrize(("family", "target"), PAIRS)
def test_convert_never_exits_3(converted: Callable[[str, str], tuple[Replica, Path, int, str]],
                               family: str, target: str) -> None:
    """Exit 3 is reserved for converter faults: a source or target limit is found at planning (exit 1),
    and only where the family expects a refusal; every other pair converts (exit 0)."""
    r, _, code, err = converted(family, target)
    assert code in (0, 1), f"exit {code}: {err}"
    assert code == (0 if r.expected_targets[target] is None else 1), f"exit {code}: {err}"


# the values: an oracle that shares no code with mxfp4conv (tests/oracle.py) ----------------------
VALUE_PAIRS = [(f, t) for f in FAMILIES for t in ("ct", "quark")]


@pytest.mark.parametrize(("family", "target"), VALUE_PAIRS)
def test_convert_keeps_the_values_the_source_means(converted: Callable[[str, str], tuple[Replica, Path, int, str]],
                                                  family: str, target: str) -> None:
    """Every FP4 Linear of the output against the source read independently: MXFP4 sources bit for bit;
    NVFP4 sources within one MXFP4 rounding of their dequantized values (ModelOpt's and Quark's
    ``weight_scale_2`` a multiplier, compressed-tensors' ``weight_global_scale`` a divisor) and bit for
    bit with the float64 model of the MSE rule. The proof cannot see a misread source; this can."""
    r, dst, code, err = converted(family, target)
    if r.expected_targets[target] is not None:
        pytest.skip(f"{family} --to {target} is refused by design")
    assert code == 0, err
    want = source_fp4(r.path)
    assert set(want) >= set(r.fp4_modules()), sorted(set(r.fp4_modules()) - set(want))[:5]
    problems = compare(want, output_fp4(dst))
    assert not problems, f"{family} --to {target}:\n" + "\n".join(problems)


# the families that converted before FP8 support keep converting -----------------------------------
@pytest.mark.parametrize("family", PURE_NVFP4)
@pytest.mark.parametrize("target", ["ct", "quark"])
def test_pure_nvfp4_families_keep_converting(converted: Callable[[str, str], tuple[Replica, Path, int, str]],
                                             family: str, target: str) -> None:
    r, dst, code, err = converted(family, target)
    assert code == 0, err
    assert run("verify", str(r.path), str(dst))[0] == 0
    cfg = json.loads((dst / "config.json").read_text())
    _check_resolution(r, cfg)
    _check_bytes(r, target, dst)


# the resolver itself: vLLM 0.32's matching rules that the checks above rely on -------------------
def _ct_cfg(ignore: list[str], groups: dict[str, Any] | None = None) -> dict[str, Any]:
    mx = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True, "dynamic": False}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                    "config_groups": groups or {"g": {"targets": ["Linear"], "weights": mx}},
                                    "ignore": ignore}}


def _quark_cfg(exclude: list[str], **extra: Any) -> dict[str, Any]:
    w = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "is_dynamic": False, "scale_format": "e8m0"}
    return {"quantization_config": {"quant_method": "quark", "exclude": exclude, "layer_quant_config": {},
                                    "layer_type_quant_config": {}, "export": {"kv_cache_group": []},
                                    "global_quant_config": {"weight": w, "input_tensors": None, "output_tensors": None,
                                                            "bias": None}, **extra}}


def test_resolver_quark_exclude_matches_exactly_or_by_regex_never_by_glob() -> None:
    m = "model.layers.3.self_attn.o_proj"
    assert resolve(_quark_cfg(["model.layers.3*"]), m) == "mxfp4"
    assert resolve(_quark_cfg([r"re:model\.layers\.3\..*"]), m) == "bf16"
    assert resolve(_quark_cfg([m]), m) == "bf16"


def test_resolver_quark_experts_are_excluded_by_their_prefix_or_an_exact_child() -> None:
    experts = "model.layers.3.mlp.experts"
    assert resolve(_quark_cfg([rf"re:model\.layers\.3\.mlp\.experts\.{e}\.gate_proj$" for e in range(4)]),
                   experts) == "mxfp4"
    assert resolve(_quark_cfg([f"{experts}.0.gate_proj"]), experts) == "bf16"
    assert resolve(_quark_cfg([r"re:model\.layers\.3\..*"]), experts) == "bf16"


def test_resolver_ct_experts_follow_expert_zero_and_all_three_projections() -> None:
    experts = "model.layers.1.mlp.experts"
    assert resolve(_ct_cfg([r"re:.*experts\.0\..*"]), experts) == "bf16"
    assert resolve(_ct_cfg([r"re:.*experts\.1\..*"]), experts) == "mxfp4"  # vLLM probes expert 0 only
    with pytest.raises(AssertionError, match="different schemes"):
        resolve(_ct_cfg([r"re:.*experts\.0\.down_proj$"]), experts)


def test_resolver_ct_renames_exact_names_not_regexes() -> None:
    pmap = {"model.language_model.": "language_model.model."}
    qkv = "language_model.model.layers.0.self_attn.qkv_proj"
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    exact = [f"model.language_model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert resolve(_ct_cfg(exact), qkv, fused=fused, prefix_map=pmap) == "bf16"
    regex = [r"re:model\.language_model\.layers\.0\.self_attn\..*"]
    assert resolve(_ct_cfg(regex), qkv, fused=fused, prefix_map=pmap) == "mxfp4"
    with pytest.raises(AssertionError, match="not all shards"):
        resolve(_ct_cfg(exact[:1]), qkv, fused=fused, prefix_map=pmap)


def test_resolver_lm_head_is_quantized_only_by_name() -> None:
    assert resolve(_ct_cfg([]), "lm_head") == "bf16"
    assert resolve(_quark_cfg([]), "lm_head") == "bf16"


def test_resolver_kv_cache_needs_an_attention_layer_the_config_does_not_exclude() -> None:
    fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}
    kv = {"*k_proj": {"weight": None, "input_tensors": None, "output_tensors": fp8, "bias": None},
          "*v_proj": {"weight": None, "input_tensors": None, "output_tensors": fp8, "bias": None}}
    layer = "model.layers.0.self_attn.attn"
    for exclude, want in (([], "fp8"), ([r"re:.*self_attn.*"], None), (["model.layers.0.self_attn.o_proj"], "fp8")):
        cfg = _quark_cfg(exclude, layer_quant_config=kv, export={"kv_cache_group": ["*k_proj", "*v_proj"]})
        assert kv_cache_declared(cfg) == "fp8"
        assert kv_cache(cfg, layer) == want, exclude
        assert kv_cache(cfg, layer, mla=True) is None
