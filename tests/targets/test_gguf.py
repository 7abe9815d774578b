"""``--to gguf`` through the CLI, each output read back by the third-party ``gguf`` package (llama.cpp's own
Python reader, ``gguf.GGUFReader``), not by mxfp4conv's reader.

Sources: the tiny Qwen3-MoE (compressed-tensors MXFP4, ModelOpt NVFP4), GPT-OSS (native MXFP4, biases, sinks,
sliding window), AutoRound's Qwen3-MoE with MXFP4 attention, NVIDIA's NVFP4 Qwen3-MoE with an FP8 KV cache and
DeepSeek-R1's ModelOpt NVFP4 replica (MLA, a dense FP4 MLP, shared experts, an MTP layer, an FP8 KV cache),
each given a byte-level BPE tokenizer. What is checked against the sources (tests/oracle.py reads them; names
are mapped by this test's own table of llama.cpp's tensor names): the metadata llama.cpp needs, every tensor's
GGML type, dims and values, the data alignment, the split layout of ``--max-shard-size``, ``verify``'s
verdicts on intact and altered outputs, and the refusals at planning. llama.cpp itself runs the outputs in
tests/gguf_runtime.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from mxfp4conv.cli import cli
from mxfp4conv.errors import EXIT_INVALID, EXIT_OK, EXIT_VERIFY
from tests import builders, oracle
from tests.gguf_runtime.gguf_cases import add_bpe_tokenizer
from tests.replicas import ct_families, deepseek, deepseek_v4
from tests.serving.serving_sources import build_moe

MXFP4, F32, BF16 = GGMLQuantizationType.MXFP4, GGMLQuantizationType.F32, GGMLQuantizationType.BF16
ARCH = {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "deepseek_v3": "deepseek2"}
CONVERTED = ["ct-mxfp4", "gpt-oss", "modelopt-nvfp4", "autoround", "modelopt-qwen3-kv", "r1"]
EXPERT = "blk.1.ffn_down_exps.weight"

# llama.cpp's tensor names (llama-arch.cpp, convert_hf_to_gguf.py's tensor map) -> the source's, written here
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
_ATTN = {**{f"attn_{g}.{p}": f"self_attn.{h}_proj.{p}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                     ("output", "o")) for p in ("weight", "bias")},
         "attn_norm.weight": "input_layernorm.weight"}
_FFN = {**{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
        **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}}
BLK: dict[str, dict[str, str]] = {
    "qwen3moe": {**_ATTN, "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
                 "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
    "gpt-oss": {**_ATTN, "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
                "attn_sinks.weight": "self_attn.sinks"},
    "deepseek2": {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                  "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                  "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                  "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
                  "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
                  "exp_probs_b.bias": "mlp.gate.e_score_correction_bias", **_FFN},
}
F32_BEYOND_1D = ("ffn_gate_inp.weight", "attn_sinks.weight")  # what llama.cpp's converter keeps in F32
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")


@dataclass
class Src:
    path: Path
    cfg: dict[str, Any]

    @property
    def arch(self) -> str:
        return ARCH[self.cfg["model_type"]]


def _tokenized(path: Path) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    add_bpe_tokenizer(path, int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]))
    return path


def _convert(src: Path, dst: Path, *extra: str) -> Result:
    return CliRunner().invoke(cli, ["convert", str(src), str(dst), "--to", "gguf", "--device", "cpu", *extra])


def _qwen35(root: Path) -> Path:
    src = build_moe("qwen3_5_moe_text", root, 1).paths["ct-mxfp4"]
    return _tokenized(src)


def _qwen35_head_dims(root: Path) -> Path:
    """Gated DeltaNet value heads wider than its key heads (llama.cpp's qwen35moe sizes both from one key)."""
    src = _qwen35(root)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "linear_value_head_dim": 2 * cfg["linear_key_head_dim"]}))
    return src


def _qwen3_vl_without_sections(root: Path) -> Path:
    """Qwen3-VL-MoE whose text_config gives no MRoPE sections (llama.cpp's qwen3vlmoe requires them)."""
    src = _tokenized(ct_families.qwen3_vl_moe(root).path)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["rope_scaling"]
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def _glm45_mtp_unlisted(root: Path) -> Path:
    """GLM-4.5 with its MTP layer on disk but ``num_nextn_predict_layers`` 0: llama.cpp would find tensors of a
    block its header does not count."""
    src = _tokenized(ct_families.glm45(root).path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    return src


def _llama4_chunked(root: Path, chunk: int) -> Path:
    """Llama-4 with another attention chunk than the 8192 llama.cpp's llama4 fixes."""
    src = _tokenized(ct_families.llama4(root).path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["attention_chunk_size"] = chunk
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def _qwen35_fp4_out_proj(root: Path) -> Path:
    """A Qwen3.5 MXFP4 source whose Gated DeltaNet ``out_proj`` is MXFP4 too: llama.cpp's converter reorders
    that Linear's input columns (value heads grouped -> tiled)."""
    from safetensors.torch import load_file, save_file

    from tests.builders import quant_mxfp4

    src = _qwen35(root)
    name = "model.layers.0.linear_attn.out_proj"
    t = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    for f in src.glob("model*.safetensors*"):
        f.unlink()
    t[f"{name}.weight_packed"], t[f"{name}.weight_scale"] = quant_mxfp4(t.pop(f"{name}.weight").float())
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    q = cfg["quantization_config"]
    q["ignore"] = [i for i in q["ignore"] if "linear_attn" not in i] + ["re:.*linear_attn.(in_proj|conv1d).*"]
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Src]:
    root = tmp_path_factory.mktemp("gguf-src")
    paths = {
        "ct-mxfp4": _tokenized(builders.build("ct-mxfp4", root / "ct-mxfp4")),
        "gpt-oss": _tokenized(builders.build("gpt-oss", root / "gpt-oss")),
        "modelopt-nvfp4": _tokenized(builders.build("modelopt-nvfp4", root / "modelopt-nvfp4")),
        "autoround": _tokenized(ct_families.autoround_mxfp4(root / "autoround").path),
        "modelopt-qwen3-kv": _tokenized(ct_families.modelopt_nvfp4_qwen3(root / "modelopt-qwen3-kv").path),
        "r1": _tokenized(deepseek.modelopt_nvfp4_r1(root / "r1").path),
        # refused
        "no-tokenizer": builders.build("ct-mxfp4", root / "no-tokenizer", shards=1),
        "mixtral": _tokenized(build_moe("mixtral", root / "mixtral", 0).paths["ct-mxfp4"]),
        "deepseek-v4": _tokenized(deepseek_v4.native_mxfp4_v4(root / "deepseek-v4").path),
        "fp8-block": _tokenized(deepseek.ct_mixed_nvfp4_fp8block(root / "fp8-block").path),
        "qwen35-kv-dims": _qwen35_head_dims(root / "qwen35-kv-dims"),
        "qwen3-vl-no-sections": _qwen3_vl_without_sections(root / "qwen3-vl-no-sections"),
        "llama4-chunk-256": _llama4_chunked(root / "llama4-chunk-256", 256),
        "glm45-mtp-unlisted": _glm45_mtp_unlisted(root / "glm45-mtp-unlisted"),
        "qwen35-fp4-out-proj": _qwen35_fp4_out_proj(root / "qwen35-fp4-out-proj"),
    }
    return {k: Src(p, json.loads((p / "config.json").read_text())) for k, p in paths.items()}


@pytest.fixture(scope="module")
def outputs(sources: dict[str, Src], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-out")
    out = {}
    for name in CONVERTED:
        res = _convert(sources[name].path, root / name)
        assert res.exit_code == EXIT_OK, f"{name}: {res.stderr}"
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def split(sources: dict[str, Src], tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("gguf-split") / "out"
    res = _convert(sources["ct-mxfp4"].path, dst, "--max-shard-size", "40KB")
    assert res.exit_code == EXIT_OK, res.stderr
    return dst


def _reader(folder: Path) -> GGUFReader:
    files = sorted(folder.glob("*.gguf"))
    assert [f.name for f in files] == ["model.gguf"], files
    return GGUFReader(str(files[0]))


def _value(r: GGUFReader, key: str) -> Any:
    assert key in r.fields, f"{key} is not in the GGUF"
    return r.fields[key].contents()


def _types(r: GGUFReader, key: str) -> list[GGUFValueType]:
    return list(r.fields[key].types)


# ------------------------------------------------------------------ metadata
@pytest.mark.parametrize("name", CONVERTED)
def test_general_metadata(outputs: dict[str, Path], sources: dict[str, Src], name: str) -> None:
    r = _reader(outputs[name])
    assert _value(r, "general.architecture") == sources[name].arch
    assert _value(r, "general.file_type") == 38 and _types(r, "general.file_type") == [GGUFValueType.UINT32]
    assert _value(r, "general.quantization_version") == 2
    assert _types(r, "general.quantization_version") == [GGUFValueType.UINT32]
    assert _value(r, "GGUF.version") == 3
    assert _value(r, "tokenizer.ggml.model") == "gpt2"
    assert len(_value(r, "tokenizer.ggml.tokens")) == sources[name].cfg["vocab_size"]
    assert not any(k.startswith("split.") for k in r.fields), "one file: no split keys"


def _hparams(src: Src) -> dict[str, Any]:
    """What llama.cpp's loader reads for the architecture (llama-model.cpp's load_hparams), from config.json."""
    c = src.cfg
    common = {"block_count": c["num_hidden_layers"], "embedding_length": c["hidden_size"],
              "context_length": c["max_position_embeddings"], "attention.head_count": c["num_attention_heads"],
              "expert_used_count": c["num_experts_per_tok"],
              "attention.layer_norm_rms_epsilon": pytest.approx(c["rms_norm_eps"], rel=1e-7),
              "rope.freq_base": pytest.approx(c["rope_theta"], rel=1e-7)}
    if src.arch == "qwen3moe":
        return {**common, "expert_count": c["num_experts"], "expert_feed_forward_length": c["moe_intermediate_size"],
                "attention.head_count_kv": c["num_key_value_heads"], "attention.key_length": c["head_dim"],
                "attention.value_length": c["head_dim"]}
    if src.arch == "gpt-oss":
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return {**common, "expert_count": c["num_local_experts"], "expert_feed_forward_length": c["intermediate_size"],
                "attention.head_count_kv": c["num_key_value_heads"], "attention.key_length": head_dim,
                "attention.value_length": head_dim, "attention.sliding_window": c["sliding_window"],
                "attention.sliding_window_pattern": [t == "sliding_attention" for t in c["layer_types"]]}
    d = deepseek
    assert (c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"]) == (d.KV_LORA, d.ROPE, d.NOPE)
    # MLA: llama.cpp caches one "head" of kv_lora_rank + the rope part; the MTP layer is not a block
    return {**common, "block_count": d.LAYERS, "expert_count": d.EXPERTS, "expert_feed_forward_length": d.MOE_I,
            "feed_forward_length": d.DENSE_I, "leading_dense_block_count": d.FIRST_DENSE,
            "attention.head_count_kv": 1, "attention.kv_lora_rank": d.KV_LORA, "attention.q_lora_rank": d.Q_LORA,
            "attention.key_length": d.KV_LORA + d.ROPE, "attention.value_length": d.KV_LORA,
            "attention.key_length_mla": d.NOPE + d.ROPE, "attention.value_length_mla": d.V_DIM,
            "rope.dimension_count": d.ROPE, "expert_shared_count": 1, "expert_weights_scale": pytest.approx(2.5),
            "expert_weights_norm": True, "expert_gating_func": 2, "vocab_size": d.VOCAB}


@pytest.mark.parametrize("name", CONVERTED)
def test_architecture_hyper_parameters(outputs: dict[str, Path], sources: dict[str, Src], name: str) -> None:
    src = sources[name]
    r = _reader(outputs[name])
    for key, want in _hparams(src).items():
        got = _value(r, f"{src.arch}.{key}")
        assert got == want, f"{src.arch}.{key}: {got!r}, expected {want!r}"
        if isinstance(want, int) and not isinstance(want, bool):
            assert _types(r, f"{src.arch}.{key}") == [GGUFValueType.UINT32], key


def test_mixtral_is_llama_cpp_s_llama_with_experts(sources: dict[str, Src], tmp_path: Path) -> None:
    """Mixtral converts as llama.cpp's converter writes it: architecture ``llama`` and its keys, experts
    stacked from ``block_sparse_moe.experts.E.w1/w3/w2`` as MXFP4 (llama.cpp computing with it: the
    runtime tests)."""
    src = sources["mixtral"]
    assert _convert(src.path, tmp_path / "out").exit_code == EXIT_OK
    r, c = _reader(tmp_path / "out"), src.cfg
    assert _value(r, "general.architecture") == "llama"
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    want = {"block_count": c["num_hidden_layers"], "embedding_length": c["hidden_size"],
            "attention.head_count": c["num_attention_heads"], "attention.head_count_kv": c["num_key_value_heads"],
            "expert_count": c["num_local_experts"], "expert_used_count": c["num_experts_per_tok"],
            "feed_forward_length": c["intermediate_size"], "rope.dimension_count": head_dim,
            "vocab_size": c["vocab_size"], "rope.freq_base": pytest.approx(c["rope_theta"], rel=1e-7)}
    for key, v in want.items():
        assert _value(r, f"llama.{key}") == v, key
    by = {t.name: t for t in r.tensors}
    for p, rows, cols in (("gate", c["intermediate_size"], c["hidden_size"]), ("up", c["intermediate_size"], c["hidden_size"]),
                          ("down", c["hidden_size"], c["intermediate_size"])):
        t = by[f"blk.0.ffn_{p}_exps.weight"]
        assert t.tensor_type == MXFP4 and _ne(t) == [cols, rows, c["num_local_experts"]]
    assert by["blk.0.ffn_gate_inp.weight"].tensor_type == GGMLQuantizationType.F32


def test_qwen35_release_is_llama_cpp_s_qwen35moe_text_model(tmp_path: Path) -> None:
    """NVIDIA's ModelOpt NVFP4 Qwen3.5-MoE layout (Qwen3-VL names, a vision tower, an MTP block with its BF16
    ``mtp.fc``) converts to llama.cpp's ``qwen35moe`` text model as its converter writes it with ``--no-mtp``:
    no vision or MTP tensor; hyper-parameters from ``text_config``; Gated DeltaNet under llama.cpp's names
    with A = -exp(A_log), conv1d squeezed to {K, C}, the gated norm as it is and every (1 + weight) RMSNorm
    written with 1 added; the NVFP4 gated attention and experts requantized to MXFP4 (llama.cpp computing
    with such an output: the runtime tests' Qwen3.5 cases)."""
    from tests.producers.producers_lib import load_tensors
    from tests.replicas import BUILDERS

    src = BUILDERS["modelopt-nvfp4-qwen35-moe"](tmp_path / "src").path
    text = json.loads((src / "config.json").read_text())["text_config"]
    add_bpe_tokenizer(src, int(text["vocab_size"]))
    res = _convert(src, tmp_path / "out")
    assert res.exit_code == EXIT_OK, res.stderr
    r = _reader(tmp_path / "out")
    assert _value(r, "general.architecture") == "qwen35moe"
    want = {"block_count": 4, "embedding_length": text["hidden_size"], "expert_count": text["num_experts"],
            "expert_shared_feed_forward_length": text["shared_expert_intermediate_size"],
            "attention.key_length": text["head_dim"], "rope.dimension_count": text["head_dim"] // 4,
            "rope.dimension_sections": [4, 6, 6, 0], "ssm.conv_kernel": 4, "ssm.state_size": 32,
            "ssm.group_count": 1, "ssm.time_step_rank": 2, "ssm.inner_size": 64,
            "attention.recurrent_layers": [True, True, True, False], "full_attention_interval": 4}
    for key, v in want.items():
        assert _value(r, f"qwen35moe.{key}") == v, key
    assert "qwen35moe.nextn_predict_layers" not in r.fields
    by = {t.name: t for t in r.tensors}
    assert {n.split(".")[1] for n in by if n.startswith("blk.")} == {"0", "1", "2", "3"}
    assert not [n for n in by if not n.startswith("blk.") and n not in GLOBAL], "a vision or MTP tensor was written"
    t = load_tensors(src)
    lm = "model.language_model.layers"

    def f32(name: str) -> np.ndarray:
        assert by[name].tensor_type == F32, name
        return np.asarray(by[name].data).reshape(-1)

    assert np.array_equal(f32("blk.0.ssm_a"), (-t[f"{lm}.0.linear_attn.A_log"].float().exp()).numpy())
    assert np.array_equal(f32("blk.0.ssm_norm.weight"), t[f"{lm}.0.linear_attn.norm.weight"].float().numpy())
    assert np.array_equal(f32("blk.0.ssm_dt.bias"), t[f"{lm}.0.linear_attn.dt_bias"].float().numpy())
    for gg, hf in (("blk.0.attn_norm.weight", f"{lm}.0.input_layernorm.weight"),
                   ("blk.3.post_attention_norm.weight", f"{lm}.3.post_attention_layernorm.weight"),
                   ("blk.3.attn_q_norm.weight", f"{lm}.3.self_attn.q_norm.weight"),
                   ("output_norm.weight", "model.language_model.norm.weight")):
        assert np.array_equal(f32(gg), (t[hf].float() + 1).numpy()), gg
    conv = t[f"{lm}.0.linear_attn.conv1d.weight"]
    assert _ne(by["blk.0.ssm_conv1d.weight"]) == [conv.shape[2], conv.shape[0]]
    assert np.array_equal(f32("blk.0.ssm_conv1d.weight"), conv.float().reshape(-1).numpy())
    assert _ne(by["blk.0.ffn_gate_inp_shexp.weight"]) == [text["hidden_size"], 1]
    assert by["blk.0.attn_qkv.weight"].tensor_type == BF16 and by["blk.0.ssm_out.weight"].tensor_type == BF16
    assert by["blk.3.attn_q.weight"].tensor_type == MXFP4
    assert _ne(by["blk.3.attn_q.weight"]) == [text["hidden_size"], 2 * text["num_attention_heads"] * text["head_dim"]]
    assert by["blk.1.ffn_gate_exps.weight"].tensor_type == MXFP4
    res = CliRunner().invoke(cli, ["verify", str(src), str(tmp_path / "out")])
    assert res.exit_code == EXIT_OK, res.stderr


def test_only_architectures_written_with_nextn_blocks_keep_layers_past_the_trunk() -> None:
    """A layer past num_hidden_layers is written only where llama.cpp's converter writes it as a nextn block
    (GLM-4.5); elsewhere it is dropped (DeepSeek's MTP layer) or refused, whatever the config's MTP count."""
    from mxfp4conv.targets.gguf_arch import ARCHS

    assert {k for k, a in ARCHS.items() if a.writes_nextn} == {"glm4_moe"}
    assert ARCHS["deepseek_v3"].mtp and not ARCHS["deepseek_v3"].writes_nextn


def test_glm45_mtp_block_is_llama_cpp_s_nextn_block(tmp_path: Path) -> None:
    """GLM-4.5's MTP block (layer num_hidden_layers) is written as llama.cpp's converter writes it: one more block,
    ``nextn_predict_layers``, its ``eh_proj`` / ``enorm`` / ``hnorm`` / ``shared_head.norm`` under ``blk.N.nextn.*``
    and its experts stacked as any layer's."""
    from tests.producers.producers_lib import load_tensors

    src = _tokenized(ct_families.glm45(tmp_path / "src").path)
    res = _convert(src, tmp_path / "out")
    assert res.exit_code == EXIT_OK, res.stderr
    r, cfg = _reader(tmp_path / "out"), json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    assert _value(r, "glm4moe.block_count") == n + 1 and _value(r, "glm4moe.nextn_predict_layers") == 1
    by = {t.name: t for t in r.tensors}
    t = load_tensors(src)
    eh = by[f"blk.{n}.nextn.eh_proj.weight"]
    assert eh.tensor_type == BF16 and _ne(eh) == [2 * cfg["hidden_size"], cfg["hidden_size"]]
    for gg, hf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("shared_head_norm", "shared_head.norm")):
        got = np.asarray(by[f"blk.{n}.nextn.{gg}.weight"].data).reshape(-1)
        assert by[f"blk.{n}.nextn.{gg}.weight"].tensor_type == F32
        assert np.array_equal(got, t[f"model.layers.{n}.{hf}.weight"].float().numpy()), gg
    assert by[f"blk.{n}.ffn_gate_exps.weight"].tensor_type == MXFP4 and f"blk.{n}.attn_q.weight" in by
    res = CliRunner().invoke(cli, ["verify", str(src), str(tmp_path / "out")])
    assert res.exit_code == EXIT_OK, res.stderr


# ------------------------------------------------------------------ tensors
def _source_name(gguf_name: str, arch: str) -> str:
    if gguf_name in GLOBAL:
        return GLOBAL[gguf_name]
    m = _BLK.match(gguf_name)
    assert m is not None and m[2] in BLK[arch], f"{gguf_name}: not a tensor this test knows llama.cpp's {arch} has"
    return f"model.layers.{m[1]}.{BLK[arch][m[2]]}"


def _ne(t: Any) -> list[int]:
    return [int(x) for x in t.shape]


def _mxfp4_values(t: Any) -> np.ndarray:
    return dequantize(np.asarray(t.data), MXFP4)


def _shape(w: oracle.MX | oracle.NV) -> tuple[int, ...]:
    return tuple(w.codes.shape if isinstance(w, oracle.MX) else w.values.shape)


def _fp4_written(w: oracle.MX | oracle.NV) -> np.ndarray:
    """The values the output must hold: the source's (MXFP4) or the MSE requantization of them (NVFP4)."""
    return oracle.requantize(w.values).values() if isinstance(w, oracle.NV) else w.values()


def _dropped(name: str, src: Src) -> bool:
    """What llama.cpp has no tensor for: DeepSeek's MTP layer and an FP8 KV cache's scales."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return (m is not None and int(m[1]) >= src.cfg["num_hidden_layers"]) or name.endswith((".k_scale", ".v_scale"))


@pytest.mark.parametrize("name", CONVERTED)
def test_every_tensor_s_type_dims_and_values(outputs: dict[str, Path], sources: dict[str, Src], name: str) -> None:
    """MXFP4 for experts and FP4 Linears (ne[0] = K elements, dequantized by gguf to the source's values),
    F32 for norms, biases, the router and sinks (the source's values widened), BF16 matrices kept byte for
    byte; GGML dims are the torch shape reversed. Every source tensor is written but the dropped ones."""
    src = sources[name]
    raw, fp4 = oracle.read_tensors(src.path), oracle.source_fp4(src.path)
    r = _reader(outputs[name])
    names = [t.name for t in r.tensors]
    assert len(names) == len(set(names)) == _value(r, "GGUF.tensor_count")
    covered: set[str] = set()
    for t in r.tensors:
        ne, tt = _ne(t), t.tensor_type
        if (m := _EXPS.match(t.name)) is not None:
            experts = [f"model.layers.{m[1]}.mlp.experts.{e}.{m[2]}_proj" for e in range(ne[-1])]
            assert all(e in fp4 for e in experts), f"{t.name}: {ne[-1]} experts, not the source's"
            assert f"model.layers.{m[1]}.mlp.experts.{ne[-1]}.{m[2]}_proj" not in fp4, f"{t.name}: experts missing"
            n, k = _shape(fp4[experts[0]])
            if m[3] == "bias":  # GPT-OSS: gate_up_proj_bias [E, 2I], gate on even columns
                assert tt == F32 and ne == [n, ne[-1]], (t.name, tt.name, ne)
                bias = f"model.layers.{m[1]}.mlp.experts.{'down_proj' if m[2] == 'down' else 'gate_up_proj'}_bias"
                want = raw[bias].array() if m[2] == "down" else raw[bias].array()[:, {"gate": 0, "up": 1}[m[2]]::2]
                assert np.array_equal(np.asarray(t.data), want), t.name
                covered.add(bias)
                continue
            assert tt == MXFP4 and ne == [k, n, len(experts)], (t.name, tt.name, ne)
            got = _mxfp4_values(t)
            bad = [e for i, e in enumerate(experts) if not np.array_equal(got[i], _fp4_written(fp4[e]))]
            assert not bad, f"{t.name}: experts {bad} differ from the source's values"
            covered.update(experts)
            continue
        if t.name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
            continue  # test_deepseek_mla_split
        hf = _source_name(t.name, src.arch)
        if hf.removesuffix(".weight") in fp4:  # a dense FP4 Linear
            w = fp4[hf.removesuffix(".weight")]
            want = _fp4_written(w)
            assert tt == MXFP4 and ne == list(reversed(_shape(w))), (t.name, tt.name, ne)
            assert np.array_equal(_mxfp4_values(t), want), f"{t.name}: not the source's values"
            covered.add(hf.removesuffix(".weight"))
            continue
        assert hf in raw, f"{t.name}: the source has no {hf}"
        s = raw[hf]
        assert ne == list(reversed(s.shape)), (t.name, ne, s.shape)
        if len(s.shape) <= 1 or t.name.endswith(F32_BEYOND_1D):
            assert tt == F32, f"{t.name}: {tt.name}, llama.cpp computes it in F32"
            assert np.array_equal(np.asarray(t.data), s.array()), f"{t.name}: not the source's values"
        else:
            assert s.dtype == "BF16" and tt == BF16, f"{t.name}: {tt.name} for a {s.dtype} source"
            assert bytes(np.asarray(t.data).tobytes()) == s.data, f"{t.name}: not the source's bytes"
        covered.add(hf)
    owned = tuple(f"{m}." for m in fp4)
    kv_b = {n for n in raw if n.endswith(".self_attn.kv_b_proj.weight")}
    want_covered = {m for m in fp4 if not _dropped(m, src)} | {n for n in raw if not (
        n.startswith(owned) or ".mlp.experts." in n or n in kv_b or _dropped(n, src))}
    want_covered |= {n for n in raw if n.endswith("_proj_bias") and ".mlp.experts." in n}  # GPT-OSS's
    assert covered == want_covered, (sorted(want_covered - covered), sorted(covered - want_covered))


def test_gpt_oss_has_expert_biases_and_sinks(outputs: dict[str, Path]) -> None:
    types = {t.name: t.tensor_type for t in _reader(outputs["gpt-oss"]).tensors}
    for layer in range(2):
        for want in ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias", "attn_sinks.weight",
                     "ffn_gate_inp.bias", "attn_q.bias"):
            assert types.get(f"blk.{layer}.{want}") == F32, f"blk.{layer}.{want}: {types.get(f'blk.{layer}.{want}')}"


def test_fp4_attention_is_mxfp4(outputs: dict[str, Path]) -> None:
    """AutoRound's and NVIDIA's Qwen3-MoE quantize attention too: MXFP4 Linears, not BF16."""
    for name in ("autoround", "modelopt-qwen3-kv"):
        types = {t.name: t.tensor_type for t in _reader(outputs[name]).tensors}
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            got = types[f"blk.0.{proj}.weight"]
            assert got == MXFP4, f"{name}: blk.0.{proj}.weight is {got.name}"


@pytest.mark.parametrize("name", CONVERTED)
def test_tensor_data_is_aligned_to_32(outputs: dict[str, Path], name: str) -> None:
    r = _reader(outputs[name])
    assert "general.alignment" not in r.fields or _value(r, "general.alignment") == 32
    assert [t.name for t in r.tensors if int(t.data_offset) % 32] == []
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in r.tensors)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "tensor data overlap"
    assert spans[-1][1] <= (outputs[name] / "model.gguf").stat().st_size


def test_deepseek_mtp_layer_and_kv_scales_are_dropped(outputs: dict[str, Path], sources: dict[str, Src]) -> None:
    raw = oracle.read_tensors(sources["r1"].path)
    assert any(n.startswith(f"model.layers.{deepseek.MTP}.") for n in raw), "the replica has an MTP layer"
    assert any(n.endswith(".k_scale") for n in raw), "the replica has FP8 KV scales"
    names = [t.name for t in _reader(outputs["r1"]).tensors]
    assert not [n for n in names if n.startswith(f"blk.{deepseek.MTP}.")], "MTP layer written"
    assert not [n for n in names if "scale" in n or "kv_b" in n], names
    qwen = [t.name for t in _reader(outputs["modelopt-qwen3-kv"]).tensors]
    assert not [n for n in qwen if "scale" in n], "FP8 KV scales written"


def test_deepseek_mla_split(outputs: dict[str, Path], sources: dict[str, Src]) -> None:
    """kv_b_proj [heads * (nope + v), kv_lora] -> attn_k_b (torch [heads, kv_lora, nope]: each head's nope rows
    transposed) and attn_v_b (torch [heads, v, kv_lora]), as llama.cpp's converter splits it."""
    d = deepseek
    raw = oracle.read_tensors(sources["r1"].path)
    by = {t.name: t for t in _reader(outputs["r1"]).tensors}
    for layer in range(d.LAYERS):
        k_b, v_b = by[f"blk.{layer}.attn_k_b.weight"], by[f"blk.{layer}.attn_v_b.weight"]
        assert (k_b.tensor_type, _ne(k_b)) == (BF16, [d.NOPE, d.KV_LORA, d.HEADS]), _ne(k_b)
        assert (v_b.tensor_type, _ne(v_b)) == (BF16, [d.KV_LORA, d.V_DIM, d.HEADS]), _ne(v_b)
        kv_b = raw[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
        assert kv_b.shape == (d.HEADS * (d.NOPE + d.V_DIM), d.KV_LORA)
        bits = np.frombuffer(kv_b.data, "<u2").reshape(d.HEADS, d.NOPE + d.V_DIM, d.KV_LORA)
        want_k = np.ascontiguousarray(bits[:, :d.NOPE].transpose(0, 2, 1))
        want_v = np.ascontiguousarray(bits[:, d.NOPE:])
        assert np.asarray(k_b.data).tobytes() == want_k.tobytes(), f"blk.{layer}.attn_k_b"
        assert np.asarray(v_b.data).tobytes() == want_v.tobytes(), f"blk.{layer}.attn_v_b"


# ------------------------------------------------------------------ splits
def test_max_shard_size_splits_as_llama_gguf_split(split: Path, outputs: dict[str, Path]) -> None:
    files = sorted(split.glob("*.gguf"))
    n = len(files)
    assert n > 1 and [f.name for f in files] == [f"model-{i + 1:05d}-of-{n:05d}.gguf" for i in range(n)]
    whole = _reader(outputs["ct-mxfp4"])
    whole_keys = {k for k in whole.fields if not k.startswith("GGUF.")}
    seen: list[str] = []
    for i, f in enumerate(files):
        r = GGUFReader(str(f))
        assert _value(r, "split.no") == i and _types(r, "split.no") == [GGUFValueType.UINT16]
        assert _value(r, "split.count") == n and _types(r, "split.count") == [GGUFValueType.UINT16]
        assert _value(r, "split.tensors.count") == len(whole.tensors)
        assert _types(r, "split.tensors.count") == [GGUFValueType.INT32]
        keys = {k for k in r.fields if not k.startswith(("GGUF.", "split."))}
        want_keys = whole_keys if i == 0 else set()
        assert keys == want_keys, f"{f.name}: {sorted(keys ^ want_keys)}"
        if i == 0:
            assert all(_value(r, k) == _value(whole, k) for k in whole_keys)
        assert r.tensors, f"{f.name} holds no tensor"
        assert [t.name for t in r.tensors if int(t.data_offset) % 32] == []
        seen += [t.name for t in r.tensors]
        for t in r.tensors:  # the same bytes as the unsplit output's tensor
            w = next(x for x in whole.tensors if x.name == t.name)
            assert (t.tensor_type, _ne(t)) == (w.tensor_type, _ne(w)) and np.array_equal(t.data, w.data), t.name
    assert sorted(seen) == sorted(t.name for t in whole.tensors) and len(seen) == len(set(seen))


def test_split_output_verifies(split: Path, sources: dict[str, Src]) -> None:
    res = CliRunner().invoke(cli, ["verify", str(sources["ct-mxfp4"].path), str(split)])
    assert res.exit_code == EXIT_OK, res.stderr


# ------------------------------------------------------------------ verify
def test_verify_passes_on_every_output(outputs: dict[str, Path], sources: dict[str, Src]) -> None:
    for name in CONVERTED:
        res = CliRunner().invoke(cli, ["verify", str(sources[name].path), str(outputs[name])])
        assert res.exit_code == EXIT_OK, f"{name}: {res.stderr}"


def test_verify_fails_after_one_byte_of_an_expert_changes(outputs: dict[str, Path], sources: dict[str, Src],
                                                          tmp_path: Path) -> None:
    dst = tmp_path / "flipped"
    shutil.copytree(outputs["ct-mxfp4"], dst)
    path = dst / "model.gguf"
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == EXPERT)
    blob = bytearray(path.read_bytes())
    blob[int(t.data_offset) + 17 * 3 + 9] ^= 0x10  # one code nibble of the fourth block of the first row
    path.write_bytes(bytes(blob))
    res = CliRunner().invoke(cli, ["verify", str(sources["ct-mxfp4"].path), str(dst)])
    assert res.exit_code == EXIT_VERIFY, res.output + res.stderr
    assert "model.layers.1.mlp.experts" in res.stderr, res.stderr


def test_verify_fails_after_a_metadata_value_changes(outputs: dict[str, Path], sources: dict[str, Src],
                                                     tmp_path: Path) -> None:
    dst = tmp_path / "edited"
    shutil.copytree(outputs["ct-mxfp4"], dst)
    key = "qwen3moe.expert_used_count"
    r = GGUFReader(str(dst / "model.gguf"), "r+")  # gguf_set_metadata's way: the value in place, through the mmap
    field = r.fields[key]
    assert field.contents() == 2
    field.parts[field.data[0]][0] = 3
    r.data.flush()
    del r, field
    assert GGUFReader(str(dst / "model.gguf")).fields[key].contents() == 3
    res = CliRunner().invoke(cli, ["verify", str(sources["ct-mxfp4"].path), str(dst)])
    assert res.exit_code == EXIT_VERIFY, res.output + res.stderr
    assert key in res.stderr, res.stderr


# ------------------------------------------------------------------ inspect and refusals
def _inspect(src: Path) -> dict[str, Any]:
    res = CliRunner().invoke(cli, ["inspect", str(src), "--json"])
    assert res.exit_code == EXIT_OK, res.stderr
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def test_inspect_lists_gguf_for_a_source_with_a_tokenizer(sources: dict[str, Src]) -> None:
    got = _inspect(sources["ct-mxfp4"].path)
    assert "gguf" in got["targets"] and "gguf" not in got["refused"], got["refused"]


def test_inspect_refuses_gguf_without_a_tokenizer(sources: dict[str, Src]) -> None:
    assert not (sources["no-tokenizer"].path / "tokenizer.json").exists()
    got = _inspect(sources["no-tokenizer"].path)
    assert "gguf" not in got["targets"] and "ct" in got["targets"]
    why = got["refused"].get("gguf", "")
    assert why.startswith("tokenizer.json: ") and "no tokenizer" in why and "\n" not in why, why


@pytest.mark.parametrize(("name", "extra", "says"), [
    ("deepseek-v4", [], ["'deepseek_v4'", "deepseek_v3", "gpt_oss", "kimi_k2", "llama4", "minimax_m2", "mixtral",
                         "qwen3_moe", "qwen3_next", "qwen3_vl_moe"]),
    ("modelopt-nvfp4", ["--keep-nvfp4"], ["--keep-nvfp4", "MXFP4"]),
    ("mixtral", ["--keep-nvfp4"], ["--keep-nvfp4", "MXFP4"]),
    ("fp8-block", [], ["model.layers.0.self_attn.kv_b_proj", "fp8-block", "FP8"]),
    ("no-tokenizer", [], ["tokenizer.json", "no tokenizer"]),
    ("qwen35-kv-dims", [], ["config.json", "Gated DeltaNet", "ssm.state_size"]),
    ("qwen35-fp4-out-proj", [], ["model.layers.0.linear_attn.out_proj", "input columns", "--to ct"]),
    ("qwen3-vl-no-sections", [], ["config.json", "mrope_section", "qwen3vlmoe"]),
    ("llama4-chunk-256", [], ["config.json", "attention_chunk_size 256", "llama4 fixes 8192"]),
    ("glm45-mtp-unlisted", [], ["model.layers.2.", "num_hidden_layers (2)", "MTP blocks (0)"]),
], ids=["unknown-architecture", "keep-nvfp4", "keep-nvfp4-mxfp4-source", "fp8-layer", "no-tokenizer",
        "qwen35-value-heads-wider", "qwen35-fp4-out-proj", "qwen3-vl-no-mrope-sections",
        "llama4-attention-chunk", "glm45-mtp-not-in-config"])
def test_refusals_at_planning(sources: dict[str, Src], tmp_path: Path, name: str, extra: list[str],
                              says: list[str]) -> None:
    parent = tmp_path / "out"
    parent.mkdir()
    res = _convert(sources[name].path, parent / "dst", *extra)
    msg = res.stderr.strip()
    assert res.exit_code == EXIT_INVALID, (res.exit_code, msg)
    assert "\n" not in msg and "to gguf" in msg, msg
    assert all(s in msg for s in says), (says, msg)
    assert list(parent.iterdir()) == [], "a refusal left files behind"


@pytest.mark.parametrize(("name", "extra", "says"), [
    ("r1", ["--keep-nvfp4"], ["--keep-nvfp4", "deepseek2", "per-tensor scale"]),
    ("ct-mxfp4", ["--keep-nvfp4"], ["--keep-nvfp4", "MXFP4", "losslessly"]),
], ids=["keep-nvfp4-deepseek2", "keep-nvfp4-mxfp4-source"])
def test_keep_nvfp4_refusals(sources: dict[str, Src], tmp_path: Path, name: str, extra: list[str],
                             says: list[str]) -> None:
    """llama.cpp's deepseek2 graph passes no NVFP4 per-tensor scale (its GGUF would compute wrong values)."""
    res = _convert(sources[name].path, tmp_path / "dst", *extra)
    msg = res.stderr.strip()
    assert res.exit_code == EXIT_INVALID and "\n" not in msg and all(s in msg for s in says), (res.exit_code, msg)
    assert not (tmp_path / "dst").exists()


def test_a_nan_e8m0_scale_is_refused_not_made_finite(sources: dict[str, Src], tmp_path: Path) -> None:
    """ggml reads the E8M0 byte 0xFF as 2^127, not NaN: carried as it is, a corrupt block would become weights."""
    src = tmp_path / "src"
    shutil.copytree(sources["ct-mxfp4"].path, src)
    t = oracle.read_tensors(src)
    name = next(n for n in sorted(t) if n.endswith("experts.0.down_proj.weight_scale"))
    shard = next(f for f in sorted(src.glob("*.safetensors")) if name.encode() in f.read_bytes()[:1 << 20])
    blob = bytearray(shard.read_bytes())
    (n,) = np.frombuffer(blob[:8], dtype="<u8")
    header = json.loads(blob[8:8 + int(n)])
    blob[8 + int(n) + header[name]["data_offsets"][0]] = 0xFF
    shard.write_bytes(bytes(blob))
    res = _convert(src, tmp_path / "dst")
    msg = res.stderr.strip()
    assert res.exit_code == EXIT_INVALID and "0xFF" in msg and "experts" in msg, (res.exit_code, msg)
    assert not (tmp_path / "dst").exists()
