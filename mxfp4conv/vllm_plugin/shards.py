"""What a Marlin-ready rank folder holds and whether this server may load it (no vLLM, no torch).

Reads the safetensors headers of one ``rank-N`` folder written by ``mxfp4conv convert --to marlin``:
the ``mxfp4conv.*`` metadata every shard carries (docs/serving-marlin.md) and, per tensor, its dtype
and shape. :func:`check_server` compares the metadata with the server's settings and returns the
first mismatch as one line (None when the shards may be loaded as they are).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

LAYOUT = "v2"
MOE_LEAVES = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_weight_scale_2",
              "w2_weight_scale_2", "w13_bias", "w2_bias")
DENSE_LEAVES = ("weight", "weight_scale", "weight_global_scale", "bias")
_SAME_IN_EVERY_SHARD = ("mxfp4conv.format", "mxfp4conv.marlin_layout", "mxfp4conv.quant", "mxfp4conv.params_dtype",
                        "mxfp4conv.act_dtype", "mxfp4conv.engine", "mxfp4conv.tp_size", "mxfp4conv.tp_rank",
                        "mxfp4conv.w13_order")


class MarlinReadyMismatch(ValueError):
    """The Marlin-ready shards do not fit this server; ``str()`` is one line naming the mismatch."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name: I32, F8_E8M0, F8_E4M3, F32, BF16, ...
    shape: tuple[int, ...]


@dataclass
class RankShards:
    """The Marlin tensors of one rank folder, grouped by checkpoint module."""

    folder: Path
    meta: dict[str, str]
    moe: dict[str, dict[str, TensorInfo]] = field(default_factory=dict)  # experts module -> leaf -> info
    dense: dict[str, dict[str, TensorInfo]] = field(default_factory=dict)  # Linear module -> leaf -> info

    @property
    def tp_size(self) -> int:
        return int(self.meta["mxfp4conv.tp_size"])

    @property
    def tp_rank(self) -> int:
        return int(self.meta["mxfp4conv.tp_rank"])

    @property
    def quant(self) -> str:
        return self.meta.get("mxfp4conv.quant", "mxfp4")

    def marlin_names(self) -> set[str]:
        """Checkpoint names of every tensor that is already in Marlin's layout."""
        out = {f"{m}.{leaf}" for m, leaves in self.moe.items() for leaf in leaves}
        return out | {f"{m}.{leaf}" for m, leaves in self.dense.items() for leaf in leaves}


def read_header(path: Path) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """The shard's metadata and tensors; a shard shorter or longer than its header says is refused in one
    line (an interrupted copy would otherwise stop vLLM's loader with safetensors' own error)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
        if not 0 < n <= min(100_000_000, size - 8):
            raise MarlinReadyMismatch(f"{path}: not a safetensors file ({size} bytes, header length {n}): copy the "
                                      "shard again, or convert again")
        try:
            head = json.loads(fh.read(n))
            meta = head.pop("__metadata__", None) or {}
            tensors = {k: TensorInfo(v["dtype"], tuple(v["shape"])) for k, v in head.items()}
            end = max((int(v["data_offsets"][1]) for v in head.values()), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise MarlinReadyMismatch(f"{path}: its safetensors header does not parse ({type(e).__name__}): copy the "
                                      "shard again, or convert again") from None
    if 8 + n + end != size:
        raise MarlinReadyMismatch(f"{path}: damaged: its header describes {8 + n + end} bytes, the file holds {size} "
                                  "(copy the shard again, or convert again)")
    return meta, tensors


def read_rank_folder(folder: str | Path) -> RankShards:
    """Headers of every shard of a Marlin-ready rank folder; refuses shards that disagree."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise MarlinReadyMismatch(f"{folder}: no safetensors shards (serve one rank-N folder of a --to marlin output)")
    meta: dict[str, str] | None = None
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        m, t = read_header(f)
        if m.get("mxfp4conv.format") != "marlin-fp4":
            raise MarlinReadyMismatch(f"{f}: mxfp4conv.format is {m.get('mxfp4conv.format')!r}, not 'marlin-fp4'")
        if meta is None:
            meta = m
        bad = [k for k in _SAME_IN_EVERY_SHARD if m.get(k) != meta.get(k)]
        if bad:
            raise MarlinReadyMismatch(f"{f}: {bad[0]} is {m.get(bad[0])!r} but {meta.get(bad[0])!r} in {files[0].name}")
        tensors.update(t)
    assert meta is not None
    out = RankShards(folder, meta)
    for name, info in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf in MOE_LEAVES and f"{module}.w13_weight" in tensors and tensors[f"{module}.w13_weight"].dtype == "I32":
            out.moe.setdefault(module, {})[leaf] = info
        elif leaf in DENSE_LEAVES and tensors.get(f"{module}.weight", info).dtype == "I32" \
                and f"{module}.weight_scale" in tensors:
            out.dense.setdefault(module, {})[leaf] = info
    return out


@dataclass(frozen=True)
class Server:
    """What the server runs with, as far as Marlin-ready shards care."""

    params_dtype: str  # "bfloat16", "float16", ...
    act_dtype: str  # "bf16" or "fp8_e4m3" (VLLM_MARLIN_INPUT_DTYPE=fp8)
    tp_size: int
    tp_rank: int
    expert_parallel: bool
    moe_backend: str  # "auto", "marlin", ...


def check_server(shards: RankShards, server: Server) -> str | None:
    """The first disagreement between the shards' metadata and the server, as one line; None if none."""
    m = shards.meta
    where = f"{shards.folder}"
    checks = [
        ("mxfp4conv.marlin_layout", m.get("mxfp4conv.marlin_layout"), LAYOUT, "this plugin loads layout v2 only"),
        ("mxfp4conv.engine", m.get("mxfp4conv.engine"), "vllm", "convert again with --engine vllm"),
        ("mxfp4conv.params_dtype", m.get("mxfp4conv.params_dtype"), server.params_dtype,
         f"the server runs --dtype {server.params_dtype}; serve with --dtype bfloat16"),
        ("mxfp4conv.act_dtype", m.get("mxfp4conv.act_dtype"), server.act_dtype,
         "VLLM_MARLIN_INPUT_DTYPE=fp8 must be set exactly when the shards were written with --marlin-act fp8"),
        ("mxfp4conv.tp_size", m.get("mxfp4conv.tp_size"), str(server.tp_size),
         f"the server runs --tensor-parallel-size {server.tp_size}; convert again with --tp-size {server.tp_size}"),
        ("mxfp4conv.tp_rank", m.get("mxfp4conv.tp_rank"), str(server.tp_rank),
         f"this process is TP rank {server.tp_rank}; each rank must load its own rank-{server.tp_rank} folder"),
    ]
    for key, have, want, fix in checks:
        if have != want:
            return f"{where}: {key} is {have!r}, the server needs {want!r} ({fix})"
    if server.expert_parallel and shards.moe:
        return f"{where}: expert parallelism is on, but Marlin-ready experts are split by TP rank (drop --enable-expert-parallel)"
    if server.moe_backend not in ("auto", "marlin") and shards.moe:
        return f"{where}: MoE backend {server.moe_backend!r} is forced, but these experts are in Marlin's layout (use --moe-backend marlin or auto)"
    return None
