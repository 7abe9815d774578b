"""Generate large FP4 MoE checkpoints with real shapes, fast (random codes, no quantization).

Qwen3-30B-A3B-like (hidden 2048, moe_intermediate 768, 128 experts) as ct-mxfp4 / modelopt-nvfp4 /
ct-nvfp4, and GPT-OSS-20b-like (hidden 2880, intermediate 2880, 32 experts) as gpt-oss. Layer count
sets the size. Non-expert tensors are small bf16 stand-ins (attention, norms, router). ``--shape
deepseek``: the same Qwen3-MoE model with DeepSeek-V3-sized routed experts (hidden 7168,
moe_intermediate 2048, 256 experts: 6.4 GB per NVFP4 layer), for what a large layer holds.

    python tools/gen_checkpoint.py OUT --layout ct-mxfp4 --layers 13
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny import _ct_qconfig, gpt_oss_config, qwen3_config

SHAPES = {"qwen3": {"experts": 128, "hidden": 2048, "inter": 768}, "gpt-oss": {"experts": 32, "hidden": 2880, "inter": 2880},
          "deepseek": {"experts": 256, "hidden": 7168, "inter": 2048}}


def _rand(gen: torch.Generator, lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bytes in [lo, hi) on the generator's device (a GPU's when there is one: ~100x faster
    than the CPU's ~100 MB/s, so a 17 GB checkpoint takes seconds of device time, not minutes), on the CPU."""
    return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen, device=gen.device).cpu()


def _codes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return _rand(gen, 0, 256, shape)


def _e8m0(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return _rand(gen, 118, 124, shape)


def _e4m3(gen: torch.Generator, *shape: int) -> torch.Tensor:
    # positive normal E4M3 scales (bit patterns 0x30..0x6F: 2^-3 .. ~2^5)
    return _rand(gen, 0x30, 0x70, shape).view(torch.float8_e4m3fn)


def layer_tensors(layout: str, layer: int, gen: torch.Generator, shape: str = "qwen3") -> dict[str, torch.Tensor]:
    gpt = layout == "gpt-oss"
    s = SHAPES["gpt-oss" if gpt else shape]
    e, h, i = s["experts"], s["hidden"], s["inter"]
    p = f"model.layers.{layer}"
    t: dict[str, torch.Tensor] = {
        f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}.self_attn.q_proj.weight": torch.zeros(1024, h, dtype=torch.bfloat16),
        f"{p}.self_attn.o_proj.weight": torch.zeros(h, 1024, dtype=torch.bfloat16),
    }
    x = f"{p}.mlp.experts"
    if gpt:
        t[f"{p}.mlp.router.weight"] = torch.zeros(e, h, dtype=torch.bfloat16)
        t[f"{x}.gate_up_proj_blocks"] = _codes(gen, e, 2 * i, h // 32, 16)
        t[f"{x}.gate_up_proj_scales"] = _e8m0(gen, e, 2 * i, h // 32)
        t[f"{x}.gate_up_proj_bias"] = torch.zeros(e, 2 * i, dtype=torch.bfloat16)
        t[f"{x}.down_proj_blocks"] = _codes(gen, e, h, i // 32, 16)
        t[f"{x}.down_proj_scales"] = _e8m0(gen, e, h, i // 32)
        t[f"{x}.down_proj_bias"] = torch.zeros(e, h, dtype=torch.bfloat16)
        return t
    t[f"{p}.mlp.gate.weight"] = torch.zeros(e, h, dtype=torch.bfloat16)
    for j in range(e):
        for name, n, k in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
            m = f"{x}.{j}.{name}"
            if layout == "ct-mxfp4":
                t[f"{m}.weight_packed"], t[f"{m}.weight_scale"] = _codes(gen, n, k // 2), _e8m0(gen, n, k // 32)
            elif layout == "modelopt-nvfp4":
                t[f"{m}.weight"], t[f"{m}.weight_scale"] = _codes(gen, n, k // 2), _e4m3(gen, n, k // 16)
                t[f"{m}.weight_scale_2"] = torch.tensor(1e-3, dtype=torch.float32)
                t[f"{m}.input_scale"] = torch.tensor(1e-3, dtype=torch.float32)  # NVFP4_DEFAULT_CFG is W4A4
            else:
                t[f"{m}.weight_packed"], t[f"{m}.weight_scale"] = _codes(gen, n, k // 2), _e4m3(gen, n, k // 16)
                t[f"{m}.weight_global_scale"] = torch.tensor([1e3], dtype=torch.float32)
    return t


def generate(out: Path, layout: str, layers: int, layers_per_shard: int = 2, device: str | None = None,
             shape: str = "qwen3") -> Path:
    """Write the checkpoint; random bytes come from ``device`` (default: the GPU when one is visible,
    else the CPU; the CPU's bytes are those of every earlier session, a GPU's differ: both random)."""
    out.mkdir(parents=True, exist_ok=True)
    gpt = layout == "gpt-oss"
    s = SHAPES["gpt-oss" if gpt else shape]
    cfg = (gpt_oss_config if gpt else qwen3_config)(layers, s["experts"], s["hidden"], s["inter"])
    if gpt:
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                      "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    elif layout == "ct-mxfp4":
        cfg["quantization_config"] = _ct_qconfig("mxfp4-pack-quantized", ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"])
    elif layout == "ct-nvfp4":
        cfg["quantization_config"] = _ct_qconfig("nvfp4-pack-quantized", ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"])
    else:
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                      "ignore": ["lm_head", "model.layers.*.mlp.gate", "model.layers.*.self_attn*"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    n_shards = -(-layers // layers_per_shard)
    wmap: dict[str, str] = {}
    total = 0
    for sidx in range(n_shards):
        t: dict[str, torch.Tensor] = {}
        for layer in range(sidx * layers_per_shard, min(layers, (sidx + 1) * layers_per_shard)):
            t.update(layer_tensors(layout, layer, gen, shape))
        if sidx == 0:
            t["model.embed_tokens.weight"] = torch.zeros(1024, s["hidden"], dtype=torch.bfloat16)
            t["model.norm.weight"] = torch.ones(s["hidden"], dtype=torch.bfloat16)
            t["lm_head.weight"] = torch.zeros(1024, s["hidden"], dtype=torch.bfloat16)
        name = f"model-{sidx + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(t, str(out / name), metadata={"format": "pt"})
        wmap.update(dict.fromkeys(t, name))
        total += sum(v.numel() * v.element_size() for v in t.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}))
    return out


def warm(src: Path) -> int:
    """Read every shard of ``src`` once (a warm page cache for the timings); returns their total bytes."""
    size = 0
    for p in src.rglob("*.safetensors"):
        size += len(p.read_bytes())
    return size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layout", default="ct-mxfp4", choices=["ct-mxfp4", "gpt-oss", "modelopt-nvfp4", "ct-nvfp4"])
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--shape", default="qwen3", choices=["qwen3", "deepseek"])
    args = ap.parse_args()
    print(generate(args.out, args.layout, args.layers, shape=args.shape))


if __name__ == "__main__":
    main()
