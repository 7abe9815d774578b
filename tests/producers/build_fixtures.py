"""Build the producer fixtures with the REAL producers (run as a script, in its own process).

    python tests/producers/build_fixtures.py OUT_DIR

For each architecture a tiny random-init model (2 layers, 4 experts, seeded) is saved in bf16
(``OUT/<arch>-bf16``), loaded back the way llm-compressor's MoE examples do it
(``with load_context(): AutoModelForCausalLM.from_pretrained(...)``, which linearizes the experts),
quantized data-free with ``oneshot(model, recipe=QuantizationModifier(targets="Linear", scheme=S,
ignore=[...]))`` and written with ``model.save_pretrained(dir, save_compressed=True)``.

A native GPT-OSS MXFP4 checkpoint (``gpt_oss-native``) is derived from the llm-compressor GPT-OSS
output (FORMATS.md "Observed" item 7: no offline producer of that layout exists): the very same
E2M1 codes and E8M0 exponents are laid out as ``experts.{gate_up,down}_proj_{blocks,scales,bias}``
with gate/up rows (and biases) interleaved, written with plain ``safetensors``; nothing from
mxfp4conv is used.

This runs in a separate process on purpose: ``load_quantizable_moe`` registers checkpoint
conversion mappings in transformers' global registry, which would change how transformers reads
checkpoints later in the test process (the tests must see stock transformers).

Writes ``OUT/manifest.json``: {"fixtures": {name: {...}}, "versions": {...}, "seconds": ...}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*router.*", "re:.*self_attn.*", "re:.*block_sparse_moe.gate$"]
IGNORE_KEEP_ATTN = ["lm_head", "re:.*mlp.gate$", "re:.*router.*"]  # attention quantized too (dense FP4)
# name -> (arch, scheme, ignore list, save_pretrained max_shard_size or None)
BUILDS: dict[str, tuple[str, str, list[str], str | None]] = {
    "qwen3_moe-mxfp4a16": ("qwen3_moe", "MXFP4A16", IGNORE, None),
    "qwen3_moe-mxfp4": ("qwen3_moe", "MXFP4", IGNORE, None),
    "qwen3_moe-nvfp4a16": ("qwen3_moe", "NVFP4A16", IGNORE, None),
    "mixtral-mxfp4a16": ("mixtral", "MXFP4A16", IGNORE, None),
    "gpt_oss-mxfp4a16": ("gpt_oss", "MXFP4A16", IGNORE, None),
    # FP4 attention (dense FP4 Linears, GPT-OSS's with biases) in a sharded checkpoint with an index
    "qwen3_moe-mxfp4a16-attn": ("qwen3_moe", "MXFP4A16", IGNORE_KEEP_ATTN, "100KB"),
    "gpt_oss-mxfp4a16-attn": ("gpt_oss", "MXFP4A16", IGNORE_KEEP_ATTN, "100KB"),
}
HIDDEN = 96
INTERMEDIATE = 64
NUM_EXPERTS = 4
NUM_LAYERS = 2
VOCAB = 256
SEED = 0
GPT_OSS_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def guard_torchvision_aliases() -> int:
    """transformers 5.17 registers lazy ``models.*.image_processing_*_fast`` alias modules whose
    ``__dir__`` imports the target module, which imports torchvision. Its monkey-patching pass
    (used by llm-compressor's MoE loader) calls ``dir()`` on every transformers module, so with no
    torchvision installed it raises ModuleNotFoundError (FORMATS.md "Observed" item 8). Make those
    alias ``__dir__``s return [] when the import fails. Call again after imports: transformers may
    re-create the aliases."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("transformers.") or getattr(mod, "__file__", 1) is not None:
            continue
        orig = vars(mod).get("__dir__")
        if orig is None or getattr(orig, "_mxfp4conv_guarded", False):
            continue

        def safe(orig=orig):  # type: ignore[no-untyped-def]
            try:
                return orig()
            except ImportError:
                return []

        safe._mxfp4conv_guarded = True  # type: ignore[attr-defined]
        mod.__dir__ = safe  # type: ignore[method-assign]
        n += 1
    return n


def make_config(arch: str):  # type: ignore[no-untyped-def]
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=2 * INTERMEDIATE, moe_intermediate_size=INTERMEDIATE,
                              num_experts=NUM_EXPERTS, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "mixtral":
        return MixtralConfig(**common, intermediate_size=INTERMEDIATE, num_local_experts=NUM_EXPERTS)
    if arch == "gpt_oss":
        return GptOssConfig(**common, intermediate_size=INTERMEDIATE, num_local_experts=NUM_EXPERTS, sliding_window=8,
                            rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    raise ValueError(arch)


def build_bf16(arch: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(make_config(arch), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initializes biases (GPT-OSS experts, attention) to zero: make them random
            # so that gate/up bias interleaving and bias placement are actually exercised.
            if name.endswith("bias") and not bool(p.any()):
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    model.save_pretrained(out)


def quantize(bf16: Path, scheme: str, ignore: list[str], shard: str | None, out: Path) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.utils.dev import load_context
    from transformers import AutoModelForCausalLM

    guard_torchvision_aliases()
    with load_context():
        model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore))
    shard_kw: dict[str, Any] = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, save_compressed=True, **shard_kw)


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """rows [g0, u0, g1, u1, ...] (GPT-OSS order) from gate [I, ...] and up [I, ...]."""
    return torch.stack([gate, up], dim=1).reshape(gate.shape[0] * 2, *gate.shape[1:])


def derive_gpt_oss_native(src: Path, out: Path) -> None:
    """FORMATS.md §3 native layout from llm-compressor's per-expert GPT-OSS output, same codes/exponents."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118
                tensors[k] = fh.get_tensor(k)
    rx = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight_packed|weight_scale|bias)$")
    experts: dict[str, dict[tuple[int, str, str], torch.Tensor]] = {}
    native: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        m = rx.match(k)
        if m:
            experts.setdefault(m[1], {})[(int(m[2]), m[3], m[4])] = t
        else:
            native[k] = t
    for prefix, parts in experts.items():
        num = 1 + max(e for e, _, _ in parts)

        def stack(proj: str, what: str, parts=parts, num=num) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
            return [parts[(e, proj, what)] for e in range(num)]

        gu_packed = torch.stack([_interleave(g, u) for g, u in zip(stack("gate_proj", "weight_packed"), stack("up_proj", "weight_packed"), strict=True)])
        gu_scale = torch.stack([_interleave(g, u) for g, u in zip(stack("gate_proj", "weight_scale"), stack("up_proj", "weight_scale"), strict=True)])
        gu_bias = torch.stack([_interleave(g, u) for g, u in zip(stack("gate_proj", "bias"), stack("up_proj", "bias"), strict=True)])
        dn_packed = torch.stack(stack("down_proj", "weight_packed"))
        e, rows, kh = gu_packed.shape
        native[f"{prefix}.gate_up_proj_blocks"] = gu_packed.reshape(e, rows, kh // 16, 16).contiguous()
        native[f"{prefix}.gate_up_proj_scales"] = gu_scale.contiguous()
        native[f"{prefix}.gate_up_proj_bias"] = gu_bias.contiguous()
        native[f"{prefix}.down_proj_blocks"] = dn_packed.reshape(e, dn_packed.shape[1], dn_packed.shape[2] // 16, 16).contiguous()
        native[f"{prefix}.down_proj_scales"] = torch.stack(stack("down_proj", "weight_scale")).contiguous()
        native[f"{prefix}.down_proj_bias"] = torch.stack(stack("down_proj", "bias")).contiguous()
    save_file(dict(sorted(native.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERT}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if (src / "generation_config.json").exists():
        (out / "generation_config.json").write_text((src / "generation_config.json").read_text())


def versions() -> dict[str, str]:
    import compressed_tensors
    import llmcompressor
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "compressed_tensors": compressed_tensors.__version__, "llmcompressor": llmcompressor.__version__}


def main(out_dir: str) -> None:
    t0 = time.perf_counter()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    import transformers  # noqa: F401

    guard_torchvision_aliases()
    fixtures: dict[str, dict[str, object]] = {}
    seconds: dict[str, float] = {}
    for arch in dict.fromkeys(a for a, _, _, _ in BUILDS.values()):
        t = time.perf_counter()
        build_bf16(arch, root / f"{arch}-bf16")
        seconds[f"{arch}-bf16"] = time.perf_counter() - t
    for name, (arch, scheme, ignore, shard) in BUILDS.items():
        t = time.perf_counter()
        quantize(root / f"{arch}-bf16", scheme, ignore, shard, root / name)
        seconds[name] = time.perf_counter() - t
        fixtures[name] = {"dir": name, "arch": arch, "scheme": scheme, "bf16": f"{arch}-bf16", "ignore": ignore,
                          "max_shard_size": shard, "producer": "llm-compressor"}
    t = time.perf_counter()
    derive_gpt_oss_native(root / "gpt_oss-mxfp4a16", root / "gpt_oss-native")
    seconds["gpt_oss-native"] = time.perf_counter() - t
    fixtures["gpt_oss-native"] = {"dir": "gpt_oss-native", "arch": "gpt_oss", "scheme": "MXFP4A16",
                                  "bf16": "gpt_oss-bf16", "producer": "derived from gpt_oss-mxfp4a16"}
    seconds["total"] = time.perf_counter() - t0
    manifest = {"fixtures": fixtures, "versions": versions(), "seconds": seconds,
                "dims": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "experts": NUM_EXPERTS, "layers": NUM_LAYERS}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
