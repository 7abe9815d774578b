"""Sources, ``--to gguf`` outputs and what llama.cpp must compute from them (project venv side).

For each case: a tiny source checkpoint with a byte-level BPE tokenizer (llama.cpp loads a vocabulary
from the GGUF), its ``--to gguf`` output, and the float32 references of its logits, made from the source
by the test's own reading (``tests/oracle.py``: numpy, no mxfp4conv code) and transformers' float32 model
of the architecture:

* ``reference``: the model as the source defines it (NVFP4 values not requantized);
* ``reference_written``: the model with the values the output must hold (the source's for MXFP4, the
  oracle's MSE requantization for NVFP4), which is what llama.cpp computes with.
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
import torch
from click.testing import CliRunner

from mxfp4conv.cli import cli
from tests import builders, oracle
from tests.producers.producers_lib import load_tensors

PROMPT = [int(x) for x in np.random.default_rng(20261206).integers(3, 250, 16)]
_EXPERT = re.compile(r"^(?P<c>.+)\.experts\.(?P<e>\d+)\.(?P<p>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's expert names on disk
# NVFP4 sources whose dims are whole GGML NVFP4 blocks (64 inputs): also converted with --keep-nvfp4
KEEP = ("qwen3_moe-modelopt-nvfp4-h128", "qwen3_5_moe-modelopt-nvfp4", "qwen3_next-modelopt-nvfp4",
        "mixtral-modelopt-nvfp4")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class Case:
    name: str
    src: Path
    dst: Path
    model_type: str
    nvfp4: bool
    flags: tuple[str, ...] = ()

    @property
    def keeps_nvfp4(self) -> bool:
        return "--keep-nvfp4" in self.flags


def add_bpe_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens (the model's embedding rows): the
    printable ASCII bytes, merges of frequent pairs up to ``vocab_size - 3``, three special tokens. The
    pre-tokenizer is Qwen2's (its Split regex, then ByteLevel without its own regex), as Qwen's
    tokenizer.json has it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_char = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    assert set(byte_char.values()) == set(alphabet)
    vocab = {byte_char[b]: i for i, b in enumerate(range(32, 127))}
    merges: list[tuple[str, str]] = []
    text = "the quick brown fox jumps over the lazy dog and then the fox sleeps in the sun"
    words = [[byte_char[b] for b in (" " + w if i else w).encode()] for i, w in enumerate(text.split())]
    while len(vocab) < vocab_size - len(SPECIALS):
        pairs: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in itertools.pairwise(w):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        vocab[best[0] + best[1]] = len(vocab)
        words = [_merge(w, best) for w in words]
    while len(vocab) < vocab_size - len(SPECIALS):  # pad with more single characters
        vocab[alphabet[len(vocab) % len(alphabet)] * 2 + str(len(vocab))] = len(vocab)
    qwen2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(qwen2), behavior="isolated"),
                                                 ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512}))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def _merge(word: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def sources(root: Path) -> list[Case]:
    """Every input layout on a tiny Qwen3-MoE, AutoRound's Qwen3-MoE with FP4 attention, GPT-OSS (native MXFP4,
    biases, sinks, sliding window, YaRN) and DeepSeek-R1's replicas (MLA, a dense FP4 MLP, shared experts, an
    MTP layer; NVIDIA's NVFP4 with an FP8 KV cache and AMD's Quark MXFP4), and GLM-4.5's llm-compressor NVFP4
    replica (partial rotary, attention biases, sigmoid routing, a leading dense layer, a shared expert), and
    GraniteMoE written by llm-compressor (MXFP4 attention, llama.cpp's interleaved rotary pairs, multipliers),
    and Mixtral MXFP4 / NVFP4 (llama.cpp's ``llama`` with experts: interleaved rotary pairs, ``w1/w3/w2``),
    and Qwen3.5-MoE in every input layout (llama.cpp's ``qwen35moe``: a Gated DeltaNet layer with two value
    heads per key head, a gated full-attention layer, (1 + weight) RMSNorms, a shared expert) and Qwen3-Next
    (llama.cpp's ``qwen3next``: the same with its fused DeltaNet projections), and MiniMax-M2 (sigmoid routing
    with a selection bias, Q/K norms over whole projections, partial rotary), and Qwen3-VL-MoE's language model
    (a multimodal release's names, MRoPE sections, one deepstack layer), and Llama-4 (dense and MoE layers
    interleaved, a top-1 sigmoid router and a shared expert, a global NoPE fourth layer)."""
    from tests.replicas import deepseek, granitemoe
    from tests.replicas.ct_families import autoround_mxfp4, glm45
    from tests.serving.serving_sources import build_moe

    out: dict[str, tuple[Path, str]] = {}
    for layout in ("ct-mxfp4", "modelopt-nvfp4", "ct-nvfp4"):
        out[f"qwen3_moe-{layout}"] = (builders.build(layout, root / layout), "qwen3_moe")
    out["qwen3_moe-quark-mxfp4"] = (builders.quark_mxfp4(root / "quark-mxfp4"), "qwen3_moe")
    out["qwen3_moe-quark-nvfp4"] = (builders.quark_nvfp4(root / "quark-nvfp4"), "qwen3_moe")
    out["qwen3_moe-autoround-mxfp4"] = (autoround_mxfp4(root / "autoround").path, "qwen3_moe")
    out["gpt_oss"] = (_with_yarn(builders.build("gpt-oss", root / "gpt-oss")), "gpt_oss")
    out["deepseek_v3-modelopt-nvfp4-r1"] = (deepseek.modelopt_nvfp4_r1(root / "r1").path, "deepseek_v3")
    out["deepseek_v3-quark-mxfp4-r1"] = (deepseek.quark_mxfp4_r1(root / "r1-quark").path, "deepseek_v3")
    out["glm4_moe-ct-nvfp4"] = (glm45(root / "glm45").path, "glm4_moe")
    out["granitemoe-ct-mxfp4"] = (granitemoe.llmcompressor_mxfp4(root / "granite").path, "granitemoe")
    out["qwen3_moe-modelopt-nvfp4-h128"] = (build_moe("qwen3_moe", root / "h128", seed=3).paths["modelopt-nvfp4"],
                                            "qwen3_moe")
    mixtral = build_moe("mixtral", root / "mixtral", seed=2)
    for layout in ("ct-mxfp4", "ct-nvfp4", "modelopt-nvfp4"):
        out[f"mixtral-{layout}"] = (mixtral.paths[layout], "mixtral")
    qwen35 = build_moe("qwen3_5_moe_text", root / "qwen35", seed=4)
    for layout in ("ct-mxfp4", "ct-nvfp4", "modelopt-nvfp4"):
        out[f"qwen3_5_moe-{layout}"] = (qwen35.paths[layout], "qwen3_5_moe_text")
    llama4 = build_moe("llama4_text", root / "llama4", seed=8)
    for layout in ("ct-mxfp4", "modelopt-nvfp4"):
        out[f"llama4-{layout}"] = (llama4.paths[layout], "llama4_text")
    out["llama4-llama3-rope-ct-mxfp4"] = (_with_llama3_rope(llama4.paths["ct-mxfp4"], root / "llama4-llama3"),
                                          "llama4_text")
    qwen3_vl = build_moe("qwen3_vl_moe", root / "qwen3-vl", seed=7)
    for layout in ("ct-mxfp4", "ct-nvfp4"):
        out[f"qwen3_vl_moe-{layout}"] = (qwen3_vl.paths[layout], "qwen3_vl_moe")
    minimax = build_moe("minimax_m2", root / "minimax-m2", seed=6)
    for layout in ("ct-mxfp4", "modelopt-nvfp4"):
        out[f"minimax_m2-{layout}"] = (minimax.paths[layout], "minimax_m2")
    qwen3_next = build_moe("qwen3_next", root / "qwen3-next", seed=5)
    for layout in ("ct-mxfp4", "modelopt-nvfp4"):
        out[f"qwen3_next-{layout}"] = (qwen3_next.paths[layout], "qwen3_next")
    cases = []
    for name, (path, mt) in out.items():
        cfg = json.loads((path / "config.json").read_text())
        add_bpe_tokenizer(path, int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]))
        nv = any(isinstance(v, oracle.NV) for v in oracle.source_fp4(path).values())
        cases.append(Case(name, path, root / "out" / name, mt, nv))
    for base in [c for c in cases if c.name in KEEP]:  # NVFP4 kept as GGML NVFP4: no requantization
        cases.append(Case(f"{base.name}--keep-nvfp4", base.src, root / "out" / f"{base.name}--keep-nvfp4",
                          base.model_type, base.nvfp4, ("--keep-nvfp4",)))
    return cases


def _with_llama3_rope(src: Path, dst: Path) -> Path:
    """Llama-4 Scout's RoPE scaling (``llama3``), its original context shortened to 16 so that the prompt's
    positions reach the scaled frequencies of every kind (kept, divided, blended)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _with_yarn(src: Path) -> Path:
    """GPT-OSS's RoPE scaling written out, as the releases' config.json has it (transformers assumes it when
    absent, llama.cpp reads only what the file says)."""
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096}
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    return src


def convert(case: Case, *extra: str) -> str | None:
    """``mxfp4conv convert SRC DST --to gguf --device cpu``; None on success, else the CLI's error."""
    case.dst.parent.mkdir(parents=True, exist_ok=True)
    res = CliRunner().invoke(cli, ["convert", str(case.src), str(case.dst), "--to", "gguf", "--device", "cpu",
                                   *case.flags, *extra])
    return None if res.exit_code == 0 else f"exit {res.exit_code}: {res.stderr.strip() or res.output.strip()}"


def fp4_values(case: Case, written: bool) -> dict[str, np.ndarray]:
    """Every FP4 Linear of the source by module name, in float32: its values (``written=False``), or the
    values the output must hold (the oracle's requantization of an NVFP4 source, unless it is kept)."""
    out = {}
    for module, w in oracle.source_fp4(case.src).items():
        if isinstance(w, oracle.NV):
            requant = written and not case.keeps_nvfp4
            out[module] = oracle.requantize(w.values).values().astype(np.float32) if requant else w.values
        else:
            out[module] = w.values().astype(np.float32)  # E2M1 x 2^k: exact in float32
    return out


def _state(case: Case, written: bool) -> dict[str, torch.Tensor]:
    """The source as float32 parameters of transformers' model (per-expert Linears stacked as it holds them); an
    MTP block (layers past num_hidden_layers) is not part of the model's forward."""
    cfg = json.loads((case.src / "config.json").read_text())
    layers = int(cfg.get("num_hidden_layers") or cfg["text_config"]["num_hidden_layers"])
    fp4 = {m: v for m, v in fp4_values(case, written).items() if not _past(m, layers)}
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for module, v in fp4.items():
        m = _EXPERT.match(module)
        if m is None:
            state[f"{module}.weight"] = torch.from_numpy(np.ascontiguousarray(v))
        else:
            experts.setdefault(_module(m["c"], case.model_type), {}).setdefault(_PROJ.get(m["p"], m["p"]), {})[int(m["e"])] = v
    for c, by in experts.items():
        n = len(by["gate_proj"])
        gate, up, down = (np.stack([by[p][e] for e in range(n)]) for p in ("gate_proj", "up_proj", "down_proj"))
        if case.model_type == "llama4_text":  # transformers' Llama4TextExperts: [E, H, 2I] gate then up, [E, I, H]
            state[f"{c}.experts.gate_up_proj"] = torch.from_numpy(np.ascontiguousarray(
                np.concatenate([gate, up], 1).transpose(0, 2, 1)))
            state[f"{c}.experts.down_proj"] = torch.from_numpy(np.ascontiguousarray(down.transpose(0, 2, 1)))
        elif case.model_type == "gpt_oss":  # transformers' GptOssExperts: [E, H, 2I] gate/up interleaved, [E, I, H]
            gate_up = np.empty((n, gate.shape[2], 2 * gate.shape[1]), dtype=np.float32)
            gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
            state[f"{c}.experts.gate_up_proj"] = torch.from_numpy(gate_up)
            state[f"{c}.experts.down_proj"] = torch.from_numpy(np.ascontiguousarray(down.transpose(0, 2, 1)))
        else:
            state[f"{c}.experts.gate_up_proj"] = torch.from_numpy(np.concatenate([gate, up], 1))
            state[f"{c}.experts.down_proj"] = torch.from_numpy(down)
    owned = tuple(f"{m}." for m in fp4)
    for name, t in load_tensors(case.src).items():
        if _past(name, layers):
            continue
        if name.endswith((".k_scale", ".v_scale")):  # an FP8 KV cache's scales: the reference computes in float32
            continue
        if not name.startswith(owned) and t.dtype in (torch.bfloat16, torch.float16, torch.float32):
            state[_module(name.replace(".router.layer.", ".router."), case.model_type)] = t.float()  # GraniteMoE: llm-compressor's
    return state


def _past(name: str, layers: int) -> bool:
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return m is not None and int(m[1]) >= layers


def _module(name: str, model_type: str) -> str:
    """transformers' module name of a checkpoint name (Mixtral's and MiniMax-M2's ``block_sparse_moe`` is its
    ``mlp``)."""
    if model_type in ("mixtral", "minimax_m2"):
        return f"{name}.".replace(".block_sparse_moe.", ".mlp.")[:-1]
    return name


def reference_logits(case: Case, written: bool) -> np.ndarray:
    """transformers' float32 model of the source's config, with the source's values: the prompt's logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((case.src / "config.json").read_text())
    if case.model_type == "qwen3_vl_moe":
        return _vl_text_logits(case, cfg, written)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("quantization_config",
                                                                                  "compression_config")})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = _state(case, written)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy().astype(np.float64)


def _vl_text_logits(case: Case, cfg: dict[str, Any], written: bool) -> np.ndarray:
    """A multimodal release's language model alone (transformers' text model and the lm_head): the logits of a
    text prompt, the positions of its three rotary sections all the token's."""
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel

    model = Qwen3VLMoeTextModel(Qwen3VLMoeTextConfig(**cfg["text_config"])).float()
    state = _state(case, written)
    head = state.pop("lm_head.weight")
    model.load_state_dict({k.removeprefix("model.language_model."): v for k, v in state.items()}, strict=True)
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0]
        return (hidden @ head.T).numpy().astype(np.float64)


def swap_gate_up(dst: Path, out: Path) -> Path:
    """A copy of a GGUF output whose first layer has its gate and up experts swapped: the negative control
    of the logits check (the swap is made by rewriting the two tensors' bytes in place)."""
    from gguf import GGUFReader

    shutil.copytree(dst, out)
    path = out / "model.gguf"
    r = GGUFReader(str(path))
    by = {t.name: t for t in r.tensors}
    g, u = by["blk.0.ffn_gate_exps.weight"], by["blk.0.ffn_up_exps.weight"]
    blob = bytearray(path.read_bytes())
    a = slice(int(g.data_offset), int(g.data_offset) + int(g.n_bytes))
    b = slice(int(u.data_offset), int(u.data_offset) + int(u.n_bytes))
    blob[a], blob[b] = blob[b], blob[a]
    path.write_bytes(bytes(blob))
    return out


def unpermute_qk(dst: Path, out: Path, heads: int, kv_heads: int) -> Path:
    """A copy of a GGUF output whose Q and K projections have their rows back in the checkpoint's
    rotate-half order (not llama.cpp's interleaved pairs): the negative control of the Q/K row order of
    an architecture llama.cpp runs with its NORM rope (Mixtral). Rows are moved as bytes, whatever the type."""
    from gguf import GGUFReader

    shutil.copytree(dst, out)
    path = out / "model.gguf"
    blob = bytearray(path.read_bytes())
    for t in GGUFReader(str(path)).tensors:
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
        if kind not in ("attn_q", "attn_k"):
            continue
        n = heads if kind == "attn_q" else kv_heads
        rows = int(t.shape[1])
        at = slice(int(t.data_offset), int(t.data_offset) + int(t.n_bytes))
        raw = np.frombuffer(bytes(blob[at]), dtype=np.uint8).reshape(rows, -1)
        blob[at] = raw.reshape(n, rows // n // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1).tobytes()
    path.write_bytes(bytes(blob))
    return out


def _rewrite(dst: Path, out: Path, change: Any) -> Path:
    """A copy of a GGUF output with ``change(name, array)`` applied to tensors in place (same type and size)."""
    from gguf import GGMLQuantizationType, GGUFReader

    shutil.copytree(dst, out)
    path = out / "model.gguf"
    blob = bytearray(path.read_bytes())
    for t in GGUFReader(str(path)).tensors:
        data = np.array(t.data)  # the reader gives BF16 as bytes: as 16-bit elements, so columns can move
        got = change(t.name, data.view(np.uint16) if t.tensor_type == GGMLQuantizationType.BF16 else data)
        if got is not None:
            raw = np.ascontiguousarray(got).tobytes()
            assert len(raw) == int(t.n_bytes), t.name
            blob[int(t.data_offset):int(t.data_offset) + len(raw)] = raw
    path.write_bytes(bytes(blob))
    return out


def unshift_norms(dst: Path, out: Path) -> Path:
    """Qwen3.5's (1 + weight) RMSNorms written as their checkpoint weights (1 not added): a negative control."""
    def change(name: str, a: np.ndarray) -> np.ndarray | None:
        return a - 1 if name.endswith("norm.weight") and ".ssm_norm." not in name else None

    return _rewrite(dst, out, change)


def group_v_heads(dst: Path, out: Path, cfg: dict[str, Any]) -> Path:
    """Qwen3.5's Gated DeltaNet value heads put back in the checkpoint's order (grouped by key head, not the
    tiled order llama.cpp's converter gives them): a negative control. Moves rows (columns of ssm_out)."""
    nk, nv, hd = (int(cfg[k]) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim"))
    r = nv // nk

    def grouped(n_head: int) -> np.ndarray:  # grouped[(k * r + j) * n + d] = tiled[(j * nk + k) * n + d]
        return np.array([(j * nk + k) * n_head + d for k in range(nk) for j in range(r) for d in range(n_head)])

    qk = 2 * nk * int(cfg["linear_key_head_dim"])

    def change(name: str, a: np.ndarray) -> np.ndarray | None:
        part = name.split(".", 2)[-1] if name.startswith("blk.") else ""
        if part in ("attn_qkv.weight", "ssm_conv1d.weight"):
            return np.concatenate([a[:qk], a[qk:][grouped(hd)]])
        if part == "attn_gate.weight":
            return a[grouped(hd)]
        if part in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
            return a[grouped(1)]
        if part == "ssm_out.weight":
            return a[:, grouped(hd)]
        return None

    return _rewrite(dst, out, change)


def unscale_rope(dst: Path, out: Path) -> Path:
    """Llama-4's ``rope_freqs`` set to 1 (its RoPE scaling dropped): a negative control."""
    return _rewrite(dst, out, lambda name, a: np.ones_like(a) if name == "rope_freqs.weight" else None)


def unsplit_qkvz(dst: Path, out: Path, cfg: dict[str, Any]) -> Path:
    """Qwen3-Next's ``in_proj_qkvz`` rows in the checkpoint's order (per key head: q, k, v, z), cut where
    llama.cpp's ``attn_qkv`` / ``attn_gate`` split: the projection not regrouped, a negative control."""
    from gguf import GGUFReader

    nk, hk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    vz = int(cfg["linear_num_value_heads"]) // nk * int(cfg["linear_value_head_dim"])
    by = {t.name: np.array(t.data) for t in GGUFReader(str(dst / "model.gguf")).tensors}
    layers = {n.split(".")[1] for n in by if n.endswith(".attn_gate.weight")}
    per_layer = {}
    for layer in layers:
        qkv, z = by[f"blk.{layer}.attn_qkv.weight"], by[f"blk.{layer}.attn_gate.weight"]
        q, k, v = np.split(qkv, [nk * hk, 2 * nk * hk])
        heads = [np.concatenate([q[h * hk:(h + 1) * hk], k[h * hk:(h + 1) * hk], v[h * vz:(h + 1) * vz],
                                 z[h * vz:(h + 1) * vz]]) for h in range(nk)]
        per_layer[layer] = np.split(np.concatenate(heads), [len(qkv)])

    def change(name: str, a: np.ndarray) -> np.ndarray | None:
        parts = name.split(".")
        if parts[0] == "blk" and parts[1] in per_layer and parts[2] in ("attn_qkv", "attn_gate"):
            return per_layer[parts[1]][0 if parts[2] == "attn_qkv" else 1]
        return None

    return _rewrite(dst, out, change)


def expectations(case: Case) -> dict[str, Any]:
    return {"name": case.name, "model": str(case.dst / "model.gguf"), "prompt": PROMPT}
