"""What every ``--to gguf`` architecture shares (``gguf_arch.ARCHS`` is built from it): how llama.cpp's
names are read off a source name (a multimodal release's language model included), what an architecture is
to the target (``Arch``), what llama.cpp's converter may do to a tensor beyond naming it (``Reshape``), and
the hyper-parameters every architecture writes."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mxfp4conv.sources.gguf import KV, VType

if TYPE_CHECKING:
    import torch

__all__ = ["LAYER", "NORMS", "QKVO", "Arch", "Reshape", "common_kvs", "f32", "head_dim_kvs", "layer_of", "rope_config",
           "text_hparams", "text_name", "u32"]

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
    ropes: tuple[str, ...] = ("default", "yarn")  # the rope_type values written for it

    @property
    def writes_nextn(self) -> bool:
        """Its MTP blocks (layers past num_hidden_layers) are written, as llama.cpp's nextn blocks."""
        return "eh_proj.weight" in self.layer_names


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
    # F32 tensors llama.cpp's converter derives from the config alone, written beside this one: (GGUF name, value)
    extra: tuple[tuple[str, torch.Tensor], ...] = ()

    def shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        shape = (shape[0], shape[-1]) if self.squeeze else tuple(shape)
        own = [(n, *shape[1:]) for _, n in self.parts] if self.parts else [shape]
        return own + [tuple(t.shape) for _, t in self.extra]

    def apply(self, t: torch.Tensor) -> list[torch.Tensor]:
        """A source tensor -> the tensors written (before any widening to F32), then the ``extra`` ones."""
        t = t if self.rows is None else t.index_select(0, self.rows)
        t = t if self.cols is None else t.index_select(1, self.cols)
        t = t.reshape(t.shape[0], t.shape[-1]) if self.squeeze else t
        t = t if self.values is None else self.values(t)
        own = [x.contiguous() for x in t.split([n for _, n in self.parts])] if self.parts else [t]
        return own + [x for _, x in self.extra]

    def undo(self, pieces: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The source tensor back from what ``apply`` wrote (moves only: ``values`` is not inverted)."""
        import torch

        assert self.values is None
        pieces = pieces[:len(pieces) - len(self.extra)]
        t = torch.cat(pieces) if self.parts else pieces[0]
        t = t.reshape(shape) if self.squeeze else t
        t = t if self.cols is None else t.index_select(1, self.cols.argsort())
        return t if self.rows is None else t.index_select(0, self.rows.argsort())


def u32(k: str, v: Any) -> KV:
    return KV(k, VType.UINT32, int(v))


def f32(k: str, v: Any) -> KV:
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


def common_kvs(cfg: Mapping[str, Any]) -> list[KV]:
    """What llama.cpp's converter writes for every architecture here (its TextModel hyper-parameters)."""
    rope = rope_config(cfg)
    out = [u32("context_length", cfg.get("max_position_embeddings", 4096)),
           u32("embedding_length", cfg["hidden_size"]),
           u32("block_count", cfg["num_hidden_layers"]),
           u32("attention.head_count", cfg["num_attention_heads"]),
           u32("attention.head_count_kv", cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
           f32("rope.freq_base", rope.get("rope_theta", 10000.0)),
           f32("attention.layer_norm_rms_epsilon", cfg.get("rms_norm_eps", 1e-6)),
           u32("expert_count", cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts", 0)))),
           u32("expert_used_count", cfg["num_experts_per_tok"])]
    if rope["rope_type"] == "yarn":
        out += [KV("rope.scaling.type", VType.STRING, "yarn"), f32("rope.scaling.factor", rope["factor"]),
                u32("rope.scaling.original_context_length", rope["original_max_position_embeddings"])]
        for hf, gg in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if hf in rope:
                out.append(f32(f"rope.scaling.{gg}", rope[hf]))
    elif rope["rope_type"] not in ("default", "llama3", None):  # llama3: a rope_freqs tensor (Llama-4's Reshape)
        raise ValueError(f"rope_type {rope['rope_type']!r}")  # refused at planning (``Arch.ropes``)
    return out


def head_dim_kvs(cfg: Mapping[str, Any]) -> list[KV]:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return [u32("attention.key_length", head_dim), u32("attention.value_length", head_dim)]


NORMS = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
QKVO = {f"self_attn.{hf}_proj.{p}": f"attn_{gg}.{p}" for hf, gg in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                       ("o", "output")) for p in ("weight", "bias")}
