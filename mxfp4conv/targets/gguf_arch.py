"""The architectures ``--to gguf`` writes, as llama.cpp names and reads them (``ARCHS``): each one's tensor
names (HF suffix -> GGUF suffix), its hyper-parameters from config.json, what llama.cpp's converter does to
a tensor beyond naming it (``Reshape``: rows moved, a fused projection split, values transformed) and the
config values its llama.cpp graph has no form for (``Arch.refusal``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mxfp4conv.sources.gguf import KV, VType

if TYPE_CHECKING:
    import torch

__all__ = ["ARCHS", "LAYER", "Arch", "expert_prefix", "gguf_name", "layer_of", "rope_config", "text_hparams", "text_name"]

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# a multimodal release's language model: Qwen3-VL's and Qwen3.5's names, Llama-4's
_VL_TEXT = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.": "lm_head."}


def text_name(name: str) -> str:
    """A source name as the language model's own (``model.language_model.X`` -> ``model.X``)."""
    for vl, text in _VL_TEXT.items():
        if name.startswith(vl):
            return text + name[len(vl):]
    return name


def text_hparams(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config (a multimodal release nests it under ``text_config``; its ``vision_config``
    kept beside it, where a language model's keys depend on the vision tower)."""
    inner = cfg.get("text_config")
    if isinstance(inner, Mapping) and "hidden_size" in inner:
        return {**inner, "vision_config": cfg.get("vision_config") or {}}
    return cfg


def layer_of(name: str) -> re.Match[str] | None:
    return LAYER.match(text_name(name))


@dataclass(frozen=True)
class Arch:
    """How llama.cpp names and reads one architecture."""

    name: str  # general.architecture
    layer_names: Mapping[str, str]  # HF suffix after "model.layers.L." -> GGUF suffix after "blk.L." (".weight"/".bias" kept)
    hparams: Callable[[Mapping[str, Any]], list[KV]]
    mla: bool = False  # kv_b_proj written as llama.cpp's MLA pair attn_k_b / attn_v_b
    mtp: bool = False  # layers past num_hidden_layers are an MTP block llama.cpp's converter drops
    nvfp4_scales: bool = False  # its graph multiplies NVFP4 weights by their per-tensor <name>.scale
    experts: str = "mlp.experts"  # the routed experts' container after "model.layers.L."
    drop: tuple[str, ...] = ()  # prefixes of what the GGUF leaves out (a vision tower, an MTP block)
    # per tensor (its suffix after "model.layers.L.", or its global name): what llama.cpp's converter does to it
    reshape: Callable[[str, Mapping[str, Any]], Reshape | None] | None = None
    # why the text config has no exact form in llama.cpp's graph (a key it fixes or requires), None if it has
    refusal: Callable[[Mapping[str, Any]], str | None] | None = None


@dataclass(frozen=True)
class Reshape:
    """What becomes of one source tensor in the GGUF: rows and columns reordered, a middle dimension of 1
    squeezed out and the rows split into several GGUF tensors (exact moves), or its values transformed in
    float32 (``values``). An FP4 Linear takes ``rows`` only (its blocks run along the columns)."""

    rows: torch.Tensor | None = None  # the source row of each output row
    cols: torch.Tensor | None = None  # the source column of each output column
    squeeze: bool = False  # [C, 1, K] -> [C, K]
    values: Callable[[torch.Tensor], torch.Tensor] | None = None
    parts: tuple[tuple[str, int], ...] = ()  # split by rows: (GGUF suffix after "blk.L.", rows) each

    def shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        shape = (shape[0], shape[-1]) if self.squeeze else tuple(shape)
        return [(n, *shape[1:]) for _, n in self.parts] if self.parts else [shape]

    def apply(self, t: torch.Tensor) -> list[torch.Tensor]:
        """A source tensor -> the tensors written (before any widening to F32)."""
        t = t if self.rows is None else t.index_select(0, self.rows)
        t = t if self.cols is None else t.index_select(1, self.cols)
        t = t.reshape(t.shape[0], t.shape[-1]) if self.squeeze else t
        t = t if self.values is None else self.values(t)
        return [x.contiguous() for x in t.split([n for _, n in self.parts])] if self.parts else [t]

    def undo(self, pieces: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The source tensor back from what ``apply`` wrote (moves only: ``values`` is not inverted)."""
        import torch

        assert self.values is None
        t = torch.cat(pieces) if self.parts else pieces[0]
        t = t.reshape(shape) if self.squeeze else t
        t = t if self.cols is None else t.index_select(1, self.cols.argsort())
        return t if self.rows is None else t.index_select(0, self.rows.argsort())


def _u32(k: str, v: Any) -> KV:
    return KV(k, VType.UINT32, int(v))


def _f32(k: str, v: Any) -> KV:
    return KV(k, VType.FLOAT32, float(v))


def rope_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters, from ``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling``."""
    rope = cfg.get("rope_parameters")
    out = dict(rope) if isinstance(rope, dict) else {}
    if isinstance(cfg.get("rope_scaling"), dict):
        out = {**cfg["rope_scaling"], **out}
    if "rope_theta" in cfg:
        out.setdefault("rope_theta", cfg["rope_theta"])
    out.setdefault("rope_type", out.get("type", "default"))
    return out


def _common(cfg: Mapping[str, Any]) -> list[KV]:
    """What llama.cpp's converter writes for every architecture here (its TextModel hyper-parameters)."""
    rope = rope_config(cfg)
    out = [_u32("context_length", cfg.get("max_position_embeddings", 4096)),
           _u32("embedding_length", cfg["hidden_size"]),
           _u32("block_count", cfg["num_hidden_layers"]),
           _u32("attention.head_count", cfg["num_attention_heads"]),
           _u32("attention.head_count_kv", cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
           _f32("rope.freq_base", rope.get("rope_theta", 10000.0)),
           _f32("attention.layer_norm_rms_epsilon", cfg.get("rms_norm_eps", 1e-6)),
           _u32("expert_count", cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts", 0)))),
           _u32("expert_used_count", cfg["num_experts_per_tok"])]
    if rope["rope_type"] == "yarn":
        out += [KV("rope.scaling.type", VType.STRING, "yarn"), _f32("rope.scaling.factor", rope["factor"]),
                _u32("rope.scaling.original_context_length", rope["original_max_position_embeddings"])]
        for hf, gg in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if hf in rope:
                out.append(_f32(f"rope.scaling.{gg}", rope[hf]))
    elif rope["rope_type"] not in ("default", None):
        raise ValueError(f"rope_type {rope['rope_type']!r}")  # refused at planning (``_rope_refusal``)
    return out


def _head_dim(cfg: Mapping[str, Any]) -> list[KV]:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return [_u32("attention.key_length", head_dim), _u32("attention.value_length", head_dim)]


def _qwen3moe(cfg: Mapping[str, Any]) -> list[KV]:
    return [*_common(cfg), _u32("feed_forward_length", cfg.get("intermediate_size", cfg["moe_intermediate_size"])),
            _u32("expert_feed_forward_length", cfg["moe_intermediate_size"]), *_head_dim(cfg)]


def _gpt_oss(cfg: Mapping[str, Any]) -> list[KV]:
    out = [*_common(cfg), _u32("feed_forward_length", cfg["intermediate_size"]),
           _u32("expert_feed_forward_length", cfg["intermediate_size"]), *_head_dim(cfg),
           _u32("attention.sliding_window", cfg["sliding_window"])]
    types = cfg.get("layer_types")
    if isinstance(types, list):  # which layers use the sliding window (llama.cpp's default: the even ones)
        out.append(KV("attention.sliding_window_pattern", VType.ARRAY, [t == "sliding_attention" for t in types],
                      VType.BOOL))
    return out


def _deepseek2(cfg: Mapping[str, Any]) -> list[KV]:
    # MLA: llama.cpp caches the compressed KV (one "head" of kv_lora_rank + the rope part)
    out = [kv for kv in _common(cfg) if kv.key != "attention.head_count_kv"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    out += [_u32("attention.head_count_kv", 1), _u32("feed_forward_length", cfg["intermediate_size"]),
            _u32("leading_dense_block_count", cfg.get("first_k_dense_replace", 0)),
            _u32("vocab_size", cfg["vocab_size"]),
            _u32("attention.kv_lora_rank", cfg["kv_lora_rank"]),
            _u32("attention.key_length", cfg["kv_lora_rank"] + rope),
            _u32("attention.value_length", cfg["kv_lora_rank"]),
            _u32("attention.key_length_mla", nope + rope), _u32("attention.value_length_mla", v),
            _u32("expert_feed_forward_length", cfg["moe_intermediate_size"]),
            _u32("expert_shared_count", cfg.get("n_shared_experts", 0)),
            _f32("expert_weights_scale", cfg.get("routed_scaling_factor", 1.0)),
            _u32("rope.dimension_count", rope)]
    if cfg.get("q_lora_rank"):
        out.append(_u32("attention.q_lora_rank", cfg["q_lora_rank"]))
    if cfg.get("n_group") is not None:
        out += [_u32("expert_group_count", cfg["n_group"]), _u32("expert_group_used_count", cfg["topk_group"])]
    if cfg.get("norm_topk_prob"):
        out.append(KV("expert_weights_norm", VType.BOOL, True))
    out.append(_u32("expert_gating_func", {"softmax": 1, "sigmoid": 2}[cfg.get("scoring_func", "softmax")]))
    rs = rope_config(cfg)
    if rs["rope_type"] == "yarn" and "mscale_all_dim" in rs:
        out.append(_f32("rope.scaling.yarn_log_multiplier", 0.1 * float(rs["mscale_all_dim"])))
    return out


def _glm4moe(cfg: Mapping[str, Any]) -> list[KV]:
    # partial rotary embedding; sigmoid routing with a correction bias; leading dense layers; one shared expert
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    out = [*_common(cfg), _u32("feed_forward_length", cfg["intermediate_size"]), *_head_dim(cfg),
           _u32("rope.dimension_count", int(head_dim * float(cfg.get("partial_rotary_factor", 0.5)))),
           _u32("expert_feed_forward_length", cfg["moe_intermediate_size"]),
           _u32("expert_shared_count", cfg.get("n_shared_experts", 0)),
           _u32("leading_dense_block_count", cfg.get("first_k_dense_replace", 0)),
           _u32("expert_gating_func", 2),
           _f32("expert_weights_scale", cfg.get("routed_scaling_factor", 1.0))]
    if cfg.get("norm_topk_prob"):
        out.append(KV("expert_weights_norm", VType.BOOL, True))
    return out


_NORMS = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
_QKVO = {f"self_attn.{hf}_proj.{p}": f"attn_{gg}.{p}" for hf, gg in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                         ("o", "output")) for p in ("weight", "bias")}
_MLP = {f"mlp.{hf}_proj.weight": f"ffn_{hf}.weight" for hf in ("gate", "up", "down")}
_SHARED = {f"mlp.shared_experts.{hf}_proj.weight": f"ffn_{hf}_shexp.weight" for hf in ("gate", "up", "down")}
_MLA = {"self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.kv_b_proj.weight": "attn_k_b.weight"}  # and attn_v_b.weight (``_mla_split``)
ARCHS: dict[str, Arch] = {
    "qwen3_moe": Arch("qwen3moe", {**_NORMS, **_QKVO, "self_attn.q_norm.weight": "attn_q_norm.weight",
                                   "self_attn.k_norm.weight": "attn_k_norm.weight",
                                   "mlp.gate.weight": "ffn_gate_inp.weight"}, _qwen3moe, nvfp4_scales=True),
    "gpt_oss": Arch("gpt-oss", {"input_layernorm.weight": "attn_norm.weight",
                                "post_attention_layernorm.weight": "post_attention_norm.weight", **_QKVO,
                                "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
                                "mlp.router.bias": "ffn_gate_inp.bias"}, _gpt_oss),
    "deepseek_v3": Arch("deepseek2", {**_NORMS, **_MLA, **_MLP, **_SHARED, "mlp.gate.weight": "ffn_gate_inp.weight",
                                      "mlp.gate.e_score_correction_bias": "exp_probs_b.bias"},
                        _deepseek2, mla=True, mtp=True),
}
ARCHS["kimi_k2"] = ARCHS["deepseek_v3"]
# GLM-4.5 / 4.6: its MTP layers (past num_hidden_layers) are left out, as for DeepSeek; llama.cpp then runs the trunk
ARCHS["glm4_moe"] = Arch("glm4moe", {"input_layernorm.weight": "attn_norm.weight",
                                     "post_attention_layernorm.weight": "post_attention_norm.weight", **_QKVO,
                                     "self_attn.q_norm.weight": "attn_q_norm.weight",
                                     "self_attn.k_norm.weight": "attn_k_norm.weight", **_MLP, **_SHARED,
                                     "mlp.gate.weight": "ffn_gate_inp.weight",
                                     "mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}, _glm4moe, mtp=True)
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(name: str, arch: Arch) -> str | None:
    """The GGUF name of a source tensor (or of an FP4 Linear's ``<module>.weight``), None if llama.cpp has none."""
    name = text_name(name)
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = LAYER.match(name)
    if m is None or m[2] not in arch.layer_names:
        return None
    return f"blk.{m[1]}.{arch.layer_names[m[2]]}"


def expert_prefix(key: str, arch: Arch) -> str | None:
    m = layer_of(key)
    return f"blk.{m[1]}" if m is not None and m[2] == arch.experts else None


_QK = re.compile(r"^self_attn\.([qk])_proj\.(weight|bias)$")


def _rotary_pairs(suffix: str, cfg: Mapping[str, Any]) -> Reshape | None:
    """For an architecture llama.cpp runs with interleaved rotary pairs (its NORM rope), the row order its
    converter gives a Q or K projection: in each head, row j of the first half then row j of the second."""
    import torch

    m = _QK.match(suffix)
    if m is None:
        return None
    heads = int(cfg["num_attention_heads"] if m[1] == "q" else cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    half = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) // 2
    return Reshape(rows=torch.tensor([h * 2 * half + t * half + j for h in range(heads) for j in range(half)
                                      for t in range(2)]))


def _granitemoe(cfg: Mapping[str, Any]) -> list[KV]:
    # llama.cpp's llama-family keys plus Granite's four multipliers; experts use feed_forward_length
    return [*_common(cfg), _u32("feed_forward_length", cfg["intermediate_size"]),
            _u32("vocab_size", cfg["vocab_size"]),
            _u32("rope.dimension_count", cfg["hidden_size"] // cfg["num_attention_heads"]),
            _f32("attention.scale", cfg.get("attention_multiplier", 1.0)),
            _f32("embedding_scale", cfg.get("embedding_multiplier", 1.0)),
            _f32("residual_scale", cfg.get("residual_multiplier", 1.0)),
            _f32("logit_scale", cfg.get("logits_scaling", 1.0))]


ARCHS["granitemoe"] = Arch("granitemoe", {**_NORMS, **_QKVO, "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight"},
                           _granitemoe, experts="block_sparse_moe.experts", reshape=_rotary_pairs)


def _llama(cfg: Mapping[str, Any]) -> list[KV]:
    # Mixtral is llama.cpp's llama with experts: the rotary width is the head's, experts use feed_forward_length
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    out = [*_common(cfg), _u32("feed_forward_length", cfg["intermediate_size"]), _u32("vocab_size", cfg["vocab_size"]),
           _u32("rope.dimension_count", head_dim)]
    return out + (_head_dim(cfg) if cfg.get("head_dim") else [])


ARCHS["mixtral"] = Arch("llama", {**_NORMS, **_QKVO, "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}, _llama,
                        experts="block_sparse_moe.experts", reshape=_rotary_pairs)


def _qwen3next(cfg: Mapping[str, Any]) -> list[KV]:
    # Qwen3-Next: Gated DeltaNet layers (llama.cpp's ssm.* keys) and gated full attention every
    # ``full_attention_interval``-th layer, partial rotary, a shared expert
    rope = rope_config(cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    interval = int(cfg.get("full_attention_interval", 4))
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                       for i in range(n)]
    return [*_common(cfg), _u32("expert_feed_forward_length", cfg["moe_intermediate_size"]),
            _u32("expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"]), *_head_dim(cfg),
            _u32("rope.dimension_count", int(head_dim * partial)),
            _u32("ssm.conv_kernel", cfg["linear_conv_kernel_dim"]), _u32("ssm.state_size", cfg["linear_key_head_dim"]),
            _u32("ssm.group_count", cfg["linear_num_key_heads"]),
            _u32("ssm.time_step_rank", cfg["linear_num_value_heads"]),
            _u32("ssm.inner_size", cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]),
            KV("attention.recurrent_layers", VType.ARRAY, [t == "linear_attention" for t in types], VType.BOOL),
            _u32("full_attention_interval", interval)]


def _qwen35moe(cfg: Mapping[str, Any]) -> list[KV]:
    # Qwen3-Next's keys, its rotary in interleaved MRoPE sections (all equal for text: one position per token)
    sections = [int(x) for x in rope_config(cfg).get("mrope_section", [11, 11, 10])][:4]
    return [*_qwen3next(cfg),
            KV("rope.dimension_sections", VType.ARRAY, sections + [0] * (4 - len(sections)), VType.INT32)]


def _v_tiled(cfg: Mapping[str, Any], head: int, before: int = 0) -> torch.Tensor:
    """Gated DeltaNet's value heads from grouped by key head (``[K0: v0..v(r-1), K1: ...]``, the checkpoint's)
    to tiled (``[v0 of K0, v0 of K1, ..., v1 of K0, ...]``, what ggml's broadcast expects), ``head`` rows per
    value head, after ``before`` rows kept in place."""
    import torch

    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    v = torch.arange(nv * head).reshape(nk, nv // nk, head).transpose(0, 1).reshape(-1)
    return torch.cat([torch.arange(before), v + before])


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t.float() + 1.0  # Qwen3.5's RMSNorm scales by (1 + weight); llama.cpp's by its weight


def _neg_exp(t: torch.Tensor) -> torch.Tensor:
    return -t.float().exp()  # the decay A = -exp(A_log), which llama.cpp reads as ssm_a


def _qkvz_split(cfg: Mapping[str, Any]) -> Reshape:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, its value heads' v, their z) as llama.cpp's converter
    writes it: every head's q, then every k, every v (``attn_qkv``), and every z (``attn_gate``)."""
    import torch

    nk, hk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    vz = int(cfg["linear_num_value_heads"]) // nk * int(cfg["linear_value_head_dim"])
    sizes, per = (hk, hk, vz, vz), 2 * hk + 2 * vz
    at = [sum(sizes[:i]) for i in range(4)]
    rows = torch.cat([torch.arange(n) + h * per + a for a, n in zip(at, sizes, strict=True) for h in range(nk)])
    return Reshape(rows=rows, parts=(("attn_qkv.weight", nk * (2 * hk + vz)), ("attn_gate.weight", nk * vz)))


def _qwen3next_reshape(suffix: str, cfg: Mapping[str, Any]) -> Reshape | None:
    if suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":  # that one is a plain gated norm
        return Reshape(values=_plus_one)
    if suffix == "linear_attn.in_proj_qkvz.weight":
        return _qkvz_split(cfg)
    if suffix == "linear_attn.A_log":
        return Reshape(values=_neg_exp)
    return Reshape(squeeze=True) if suffix == "linear_attn.conv1d.weight" else None


def _qwen35_reshape(suffix: str, cfg: Mapping[str, Any]) -> Reshape | None:
    if suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":  # that one is a plain gated norm
        return Reshape(values=_plus_one)
    if not suffix.startswith("linear_attn."):
        return None
    tiled = int(cfg["linear_num_key_heads"]) != int(cfg["linear_num_value_heads"])
    qk = 2 * int(cfg["linear_num_key_heads"]) * int(cfg["linear_key_head_dim"])
    hv = int(cfg["linear_value_head_dim"])
    part = suffix[len("linear_attn."):]
    rows = None
    if tiled and part in ("in_proj_qkv.weight", "conv1d.weight"):
        rows = _v_tiled(cfg, hv, before=qk)
    elif tiled and part == "in_proj_z.weight":
        rows = _v_tiled(cfg, hv)
    elif tiled and part in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        rows = _v_tiled(cfg, 1)
    cols = _v_tiled(cfg, hv) if tiled and part == "out_proj.weight" else None
    squeeze = part == "conv1d.weight"  # llama.cpp's ssm_conv1d is {K, C}
    values = _neg_exp if part == "A_log" else None
    return None if rows is None and cols is None and not squeeze and values is None else Reshape(rows, cols, squeeze,
                                                                                                  values)


def _deltanet_refusal(cfg: Mapping[str, Any]) -> str | None:
    if cfg.get("linear_key_head_dim") != cfg.get("linear_value_head_dim"):
        return (f"config.json: Gated DeltaNet key heads of {cfg.get('linear_key_head_dim')} and value heads of "
                f"{cfg.get('linear_value_head_dim')}: llama.cpp sizes both from one key (ssm.state_size)")
    return None


_QWEN35 = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
           **_QKVO, "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
           "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
           "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
           "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.A_log": "ssm_a",
           "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm.weight": "ssm_norm.weight",
           "linear_attn.out_proj.weight": "ssm_out.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
           **{f"mlp.shared_expert.{hf}_proj.weight": f"ffn_{hf}_shexp.weight" for hf in ("gate", "up", "down")},
           "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
# the text model of Qwen3.5-MoE: a multimodal release's vision tower goes to llama.cpp's separate mmproj GGUF, which
# this target does not write, and its MTP block is left out as llama.cpp's converter leaves it with --no-mtp
ARCHS["qwen3_5_moe"] = Arch("qwen35moe", _QWEN35, _qwen35moe, drop=("model.visual.", "mtp.", "model.mtp."),
                            reshape=_qwen35_reshape, refusal=_deltanet_refusal)
ARCHS["qwen3_5_moe_text"] = ARCHS["qwen3_5_moe"]


# Qwen3-Next: Qwen3.5's names, its fused projections as its llama.cpp converter writes them (in_proj_qkvz split
# into attn_qkv / attn_gate, in_proj_ba as it is) and value heads in the checkpoint's order; its MTP block left out
_QWEN3NEXT = {**{k: v for k, v in _QWEN35.items() if not k.startswith("linear_attn.in_proj_")},
              "linear_attn.in_proj_qkvz.weight": "attn_qkv.weight", "linear_attn.in_proj_ba.weight": "ssm_ba.weight"}
ARCHS["qwen3_next"] = Arch("qwen3next", _QWEN3NEXT, _qwen3next, drop=("mtp.", "model.mtp."), reshape=_qwen3next_reshape,
                           refusal=_deltanet_refusal)


def _qwen3vlmoe(cfg: Mapping[str, Any]) -> list[KV]:
    # Qwen3-MoE's keys, its interleaved MRoPE sections, and how many layers add the vision tower's deepstack features
    sections = [int(x) for x in rope_config(cfg)["mrope_section"]][:4]
    deepstack = len(cfg.get("vision_config", {}).get("deepstack_visual_indexes") or [])
    return [*_qwen3moe(cfg), KV("rope.dimension_sections", VType.ARRAY, sections + [0] * (4 - len(sections)), VType.INT32),
            _u32("n_deepstack_layers", deepstack)]


def _mrope_refusal(cfg: Mapping[str, Any]) -> str | None:
    if "mrope_section" in rope_config(cfg):
        return None
    return "config.json: text_config gives no mrope_section, which llama.cpp's qwen3vlmoe needs"


# Qwen3-VL-MoE: the text model (the vision tower goes to llama.cpp's separate mmproj GGUF, not written here)
ARCHS["qwen3_vl_moe"] = Arch("qwen3vlmoe", ARCHS["qwen3_moe"].layer_names, _qwen3vlmoe, drop=("model.visual.",),
                             refusal=_mrope_refusal)


def _minimax_m2(cfg: Mapping[str, Any]) -> list[KV]:
    # sigmoid routing over a selection bias (exp_probs_b), partial rotary of rotary_dim, experts of intermediate_size
    return [*_common(cfg), _u32("feed_forward_length", cfg["intermediate_size"]),
            _u32("expert_feed_forward_length", cfg["intermediate_size"]), *_head_dim(cfg),
            _u32("rope.dimension_count", cfg["rotary_dim"]), _u32("expert_gating_func", 2)]


ARCHS["minimax_m2"] = Arch("minimax-m2", {**_NORMS, **_QKVO, "self_attn.q_norm.weight": "attn_q_norm.weight",
                                          "self_attn.k_norm.weight": "attn_k_norm.weight",
                                          "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
                                          "block_sparse_moe.e_score_correction_bias": "exp_probs_b.bias"},
                           _minimax_m2, experts="block_sparse_moe.experts")


def _llama4(cfg: Mapping[str, Any]) -> list[KV]:
    # dense layers of intermediate_size_mlp between MoE layers every interleave_moe_layer_step-th; rotary pairs
    # interleaved in the checkpoint already (llama.cpp's converter moves no rows)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return [*_common(cfg), _u32("feed_forward_length", cfg["intermediate_size_mlp"]),
            _u32("expert_feed_forward_length", cfg["intermediate_size"]),
            _u32("interleave_moe_layer_step", cfg.get("interleave_moe_layer_step", 1)), _u32("vocab_size", cfg["vocab_size"]),
            _u32("rope.dimension_count", head_dim), *_head_dim(cfg)]


def _llama4_refusal(cfg: Mapping[str, Any]) -> str | None:
    """llama.cpp's llama4 fixes what Llama-4's config sets: chunked attention of 8192 with every fourth layer
    global and without RoPE, attention temperature tuning (floor 8192, scale 0.1), Q/K L2 norms unless it has
    128 experts (Maverick)."""
    n = int(cfg["num_hidden_layers"])
    fixed = {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n)], "attention_chunk_size": 8192,
             "floor_scale": 8192, "attn_scale": 0.1, "attn_temperature_tuning": True,
             "use_qk_norm": int(cfg.get("num_local_experts", 0)) != 128}
    for key, want in fixed.items():
        got = cfg.get(key, want)
        if (list(got) if isinstance(got, list) else got) != want:
            return f"config.json: {key} {got!r}, where llama.cpp's llama4 fixes {want!r}"
    return None


_FFN = {f"feed_forward.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")}
ARCHS["llama4"] = Arch("llama4", {**_NORMS, **_QKVO, **_FFN, "feed_forward.router.weight": "ffn_gate_inp.weight",
                                  **{f"feed_forward.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight"
                                     for p in ("gate", "up", "down")}},
                       _llama4, experts="feed_forward.experts", drop=("vision_model.", "multi_modal_projector."),
                       refusal=_llama4_refusal)
ARCHS["llama4_text"] = ARCHS["llama4"]
