"""GraniteMoE MXFP4 written by llm-compressor itself (the real producer, on CPU, in a subprocess).

    python -m tests.replicas.granitemoe OUT_DIR

A tiny random ``GraniteMoeForCausalLM`` (transformers ``models/granitemoe``: attention
``self_attn.{q,k,v,o}_proj``, MoE ``block_sparse_moe`` with a ``GraniteMoeTopKRouter`` named
``router`` and fused ``GraniteMoeParallelExperts``, tied embeddings) is saved in bf16, loaded back
inside llm-compressor's ``load_context()`` (``llmcompressor/modeling/moe/linearize.py``: granitemoe
is in ``ARCH_TO_IMPORT_PATHS`` but has no ``ARCH_TO_2D_MAPPINGS`` entry, so ``linearize_moe`` splits
the experts into per-expert ``experts.E.{gate,up,down}_proj`` Linears after loading), quantized
data-free with ``oneshot(recipe=QuantizationModifier(targets="Linear", scheme="MXFP4",
ignore=["lm_head", "re:.*block_sparse_moe.router"]))`` (a user recipe: the router and lm_head kept
in bf16, attention quantized) and written with ``save_pretrained(save_compressed=True)``.

What llm-compressor 0.14.0.1 / compressed-tensors 0.19.0 / transformers 5.17.0 write (observed by
running it; the builder re-checks each point, so a producer that writes otherwise fails loudly):

* experts linearized on disk: ``model.layers.N.block_sparse_moe.experts.E.{gate,up,down}_proj.
  {weight_packed, weight_scale}`` (U8 / U8 E8M0), not the fused ``input_linear`` /
  ``output_linear`` of the original Granite checkpoints;
* attention MXFP4 the same way (``self_attn.{q,k,v,o}_proj.weight_packed``);
* the router saved as ``model.layers.N.block_sparse_moe.router.layer.weight`` BF16: transformers'
  ``conversion_mapping.py`` (``"granitemoe"``) loads ``router.layer.weight`` into the module
  ``router`` and reverts the rename on save;
* the saved ``ignore`` list names the in-memory module: ``model.layers.N.block_sparse_moe.router``
  (one exact name per layer) and ``lm_head`` - never the on-disk ``router.layer``;
* config groups ``{"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized"}}``, weights
  float 4-bit ``group`` 32 ``scale_dtype torch.uint8``, input activations the same, dynamic (W4A4);
* ``tie_word_embeddings: true``: no ``lm_head.weight`` tensor at all.

vLLM's ``vllm/model_executor/models/granitemoe.py`` builds the router as ``block_sparse_moe.gate``
(``ReplicatedLinear(..., quant_config=None)``), the experts as one ``FusedMoE``
``block_sparse_moe.experts`` and ``self_attn.qkv_proj`` (``packed_modules_mapping``); the output
config must also be right for readers that go by the names on disk (``router.layer``) or in
transformers (``router``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import Replica

HIDDEN, INTER, EXPERTS, LAYERS, HEADS, KV_HEADS, VOCAB = 128, 64, 4, 2, 2, 1, 256
IGNORE = ["lm_head", "re:.*block_sparse_moe.router"]
SHARD = "100KB"  # save_pretrained's own sharding: several files and an index
ALL_CONVERT: dict[str, str | None] = {"ct": None, "quark": None, "marlin": None}
QKV = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}


def produce(out: Path) -> None:
    """Run the real producer into ``out`` (bf16 model in ``out/bf16``, the checkpoint in ``out/mxfp4``)."""
    import torch
    from transformers import AutoModelForCausalLM, GraniteMoeConfig

    from tests.producers.build_fixtures import guard_torchvision_aliases

    cfg = GraniteMoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_local_experts=EXPERTS,
                           num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out / "bf16")

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.utils.dev import load_context

    guard_torchvision_aliases()
    with load_context():
        model = AutoModelForCausalLM.from_pretrained(out / "bf16", dtype=torch.bfloat16)
    guard_torchvision_aliases()
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="MXFP4", ignore=IGNORE))
    model.save_pretrained(out / "mxfp4", save_compressed=True, max_shard_size=SHARD)


def _headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    import struct

    out: dict[str, tuple[str, list[int]]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


def runtime_names(name: str) -> list[str]:
    """vLLM's GraniteMoe prefixes (experts one FusedMoE, q/k/v one ``qkv_proj``); the router as it is on
    disk (``router.layer``) and as transformers and the producer's ignore list name it (``router``).
    vLLM's own ``gate`` is built without a quantization config, so no config entry can reach it."""
    parts = name.split(".")
    if len(parts) > 2 and parts[-3] == "experts" and parts[-2].isdigit():
        return [".".join(parts[:-2])]
    if parts[-1] in QKV:
        return [".".join([*parts[:-1], QKV[parts[-1]]])]
    if name.endswith(".router.layer"):
        return [name, name[: -len(".layer")]]
    return [name]


def llmcompressor_mxfp4(root: Path) -> Replica:
    """GraniteMoE MXFP4 (W4A4) by llm-compressor, read back and checked against what the module docstring says."""
    work = root.parent / f".{root.name}-producer"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.replicas.granitemoe", str(work)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llm-compressor GraniteMoE build failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    (work / "mxfp4").rename(root)
    tensors = _headers(root)
    cfg: dict[str, Any] = json.loads((root / "config.json").read_text())
    q = cfg["quantization_config"]
    # the producer's output, as the docstring records it
    assert cfg["architectures"] == ["GraniteMoeForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert "lm_head.weight" not in tensors
    assert q["ignore"] == [*(f"model.layers.{n}.block_sparse_moe.router" for n in range(LAYERS)), "lm_head"], q["ignore"]
    assert list(q["config_groups"]) == ["group_0"] and q["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert q["format"] == "mxfp4-pack-quantized" and q["config_groups"]["group_0"]["input_activations"]["dynamic"]
    assert len(list(root.glob("*.safetensors"))) >= 2 and (root / "model.safetensors.index.json").exists()
    modules: dict[str, str] = {}
    for name, (dtype, shape) in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight_packed":
            assert dtype == "U8" and tensors[f"{module}.weight_scale"][0] == "U8", name
            modules[module] = "mxfp4"
        elif suffix == "weight" and len(shape) == 2 and not module.endswith("embed_tokens"):
            assert dtype == "BF16", name
            modules[module] = "bf16"
    for n in range(LAYERS):
        p = f"model.layers.{n}"
        assert modules[f"{p}.block_sparse_moe.router.layer"] == "bf16"
        assert not any(k.startswith(f"{p}.block_sparse_moe.input_linear") for k in tensors)
        for e in range(EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert modules[f"{p}.block_sparse_moe.experts.{e}.{proj}"] == "mxfp4"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert modules[f"{p}.self_attn.{proj}"] == "mxfp4"
    return Replica(path=root, family="llmcompressor-mxfp4-granitemoe", layout="ct-mxfp4", scheme="w4a4",
                   modules=modules, runtime_names=runtime_names, kv_cache=None, expected_targets=ALL_CONVERT,
                   fused={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
                   attention_layers=[f"model.layers.{n}.self_attn.attn" for n in range(LAYERS)])


if __name__ == "__main__":
    produce(Path(sys.argv[1]))
