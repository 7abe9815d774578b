"""DST's own model card (``README.md``), built with huggingface_hub's card API.

A converted release is a quantized derivative, not the source release: its card names the source as
``base_model`` with ``base_model_relation: quantized`` (the Hub's model tree shows it as a fine-tune
otherwise), carries the source's license, pipeline tag and languages as they are, and says what the
output is for. The source's card follows under a heading that says whose card it is. The card holds
nothing that changes from one run to the next (no time, no absolute path), so the same conversion
writes the same bytes and a second push sends nothing.

``card_facts`` gathers the inputs from a planned job; ``build_card`` makes the text from them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxfp4conv.errors import UsageError

if TYPE_CHECKING:
    from mxfp4conv.plan.job import Job

__all__ = ["CARD", "CardFacts", "RequantSummary", "SourceCard", "base_model_of", "build_card", "card_facts",
           "check_base_model", "read_source_card", "requant_summary", "sqnr_text"]

CARD = "README.md"
ORIGINAL_HEADING = "## The original release's model card"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FRONT_MATTER = re.compile(r"\A---\n.*?\n---\n", re.DOTALL)
_CARRIED = ("license", "license_name", "license_link", "pipeline_tag", "language")


@dataclass(frozen=True)
class _Use:
    """What a target's output is for: the Hub's ``library_name``, its layout tag, the runtimes that
    serve it, and how to run it (``DST`` stands for the folder or the Hub repo)."""

    library: str
    layout_tag: str
    runtimes: tuple[str, ...]
    run: tuple[str, ...]


# transformers reads compressed-tensors, Quark and GPT-OSS MXFP4 folders (and the Hub offers vLLM's
# snippet for transformers models); Marlin shards load only through vLLM with the plugin; MLX through mlx-lm;
# GGUF through llama.cpp
_USES = {
    "ct": _Use("transformers", "compressed-tensors", ("vllm", "sglang"),
               ("vllm serve DST", "python -m sglang.launch_server --model-path DST")),
    "quark": _Use("transformers", "quark", ("vllm", "sglang"),
                  ("vllm serve DST", "python -m sglang.launch_server --model-path DST")),
    "gpt-oss": _Use("transformers", "gpt-oss", ("vllm",), ("vllm serve DST",)),
    "marlin": _Use("vllm", "marlin", ("vllm",), ("pip install 'mxfp4conv[vllm]'   # next to vLLM 0.32-0.33",
                                                 "vllm serve DST/rank-0{tp}")),
    "mlx": _Use("mlx", "mlx", ("mlx",), ("pip install mlx-lm", 'mlx_lm.generate --model DST --prompt "Hello"')),
    "gguf": _Use("gguf", "gguf", ("llama.cpp",), ("llama-server -m DST/model.gguf   # a split output: its first file, "
                                                 "DST/model-00001-of-0000N.gguf",)),
}


@dataclass(frozen=True)
class SourceCard:
    """The source's card: the metadata carried over, its own ``base_model``, its text (no YAML)."""

    metadata: dict[str, Any] = field(default_factory=dict)
    base_model: str | list[str] | None = None
    text: str | None = None  # None: the source has no card


@dataclass(frozen=True)
class RequantSummary:
    """The requantized tensors at a glance: the worst and the median tensor by SQNR (exact tensors,
    of infinite SQNR, rank last), how many clipped any block."""

    tensors: int
    worst: tuple[str, float | None]
    median: tuple[str, float | None]
    clipped_tensors: int
    clipped_blocks: int
    blocks: int


@dataclass(frozen=True)
class CardFacts:
    """Everything the card says, typed. ``source``: the repo id, or the folder's name; ``commit``:
    the Hub commit read (None for a folder); ``command``: the options that change the output's bytes."""

    source: str
    repo_id: str | None
    commit: str | None
    base_model: str | list[str] | None
    layout: str
    target: str
    version: str
    command: str
    precision: dict[str, int]
    kv_cache: str | None
    requantized: bool
    scale_rule: str
    requant_stats: dict[str, dict[str, Any]]
    verified: bool
    tp_size: int
    card: SourceCard
    kept_nvfp4: bool = False  # --keep-nvfp4: an NVFP4 source's codes and scales carried as NVFP4


def check_base_model(name: str | None) -> None:
    """``--base-model`` must be a Hub repo id (``ORG/NAME``)."""
    if name is not None and not _REPO_ID.match(name):
        raise UsageError(f"--base-model {name!r} is not a Hub repo id", hint="pass it as ORG/NAME, e.g. openai/gpt-oss-20b")


def read_source_card(text: str | None) -> SourceCard:
    """The source card from its ``README.md`` text (None: there is none). Metadata that does not parse
    is dropped, its text kept."""
    if text is None:
        return SourceCard()
    import yaml  # type: ignore[import-untyped]  # huggingface_hub's own dependency
    from huggingface_hub import ModelCard

    try:
        card = ModelCard(text, ignore_metadata_errors=True)
    except (ValueError, yaml.YAMLError):  # YAML that does not parse at all: the text after it, no metadata
        return SourceCard(text=_FRONT_MATTER.sub("", text, count=1))
    data = card.data.to_dict()
    return SourceCard({k: data[k] for k in _CARRIED if data.get(k) is not None}, data.get("base_model") or None,
                      card.text)


def base_model_of(explicit: str | None, repo_id: str | None, card: SourceCard, earlier: dict[str, Any] | None
                  ) -> str | list[str] | None:
    """The output's ``base_model``: ``--base-model``, else the source repo, else (a folder) the source
    card's own, else the repo an earlier mxfp4conv conversion in SRC was made from; never invented."""
    if explicit is not None:
        return explicit
    if repo_id is not None:
        return repo_id
    if card.base_model is not None:
        return card.base_model
    src = (earlier or {}).get("source")
    found = src.get("repo_id") if isinstance(src, dict) else None
    return found if isinstance(found, str) and _REPO_ID.match(found) else None


def requant_summary(stats: dict[str, dict[str, Any]]) -> RequantSummary | None:
    """The summary of per-tensor requant statistics (``RequantStats.to_dict`` each); None without any."""
    if not stats:
        return None

    def rank(item: tuple[str, dict[str, Any]]) -> tuple[float, str]:
        sq = item[1].get("sqnr_db")
        return (float("inf") if sq is None else float(sq), item[0])

    ordered = sorted(stats.items(), key=rank)
    worst, median = ordered[0], ordered[(len(ordered) - 1) // 2]  # a tensor of the set, not an average
    return RequantSummary(
        tensors=len(ordered), worst=(worst[0], worst[1].get("sqnr_db")), median=(median[0], median[1].get("sqnr_db")),
        clipped_tensors=sum(1 for _, s in ordered if s.get("clipped_blocks")),
        clipped_blocks=sum(int(s.get("clipped_blocks") or 0) for _, s in ordered),
        blocks=sum(int(s.get("blocks") or 0) for _, s in ordered))


def sqnr_text(value: float | None) -> str:
    return "exact" if value is None else f"{value:.2f} dB"


def build_card(facts: CardFacts) -> str:
    """The card's text: YAML metadata, then the body, then the source's card."""
    from huggingface_hub import ModelCard, ModelCardData

    use = _USES.get(facts.target, _Use("transformers", facts.target, ("vllm",), ("vllm serve DST",)))
    meta: dict[str, Any] = {"base_model": facts.base_model}
    if facts.base_model is not None:
        meta["base_model_relation"] = "quantized"
    meta |= facts.card.metadata
    meta |= {"library_name": use.library, "tags": list(dict.fromkeys((use.layout_tag, "mxfp4", *use.runtimes,
                                                                      "mxfp4conv")))}
    data = ModelCardData(**meta)
    body = "\n\n".join([*_about(facts), *_precision(facts), *_requant(facts), *_proof(facts), *_run(facts, use),
                        *_original(facts)])
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")
    return str(card.content)


def _about(f: CardFacts) -> list[str]:
    name = f.repo_id or f.source
    if f.repo_id is not None:
        what = f"[{f.repo_id}](https://huggingface.co/{f.repo_id}) at commit `{f.commit}`"
    else:
        what = f"the local folder `{f.source}`"
    return [f"# {name.rsplit('/', 1)[-1]} ({f.target}, MXFP4)",
            f"This is {what} ({f.layout}) converted to the `{f.target}` layout by "
            f"[mxfp4conv](https://pypi.org/project/mxfp4conv/) {f.version}. It is not the source release: "
            "the weights are the source's, laid out for another runtime"
            f"{' and requantized as measured below' if f.requantized else ''}; the source's own card is at the end.",
            f"Made with (options that change no byte, such as `--device` or `--stream`, left out):\n\n"
            f"```sh\n{f.command}\n```"]


def _precision(f: CardFacts) -> list[str]:
    p = f.precision
    fp4 = ("NVFP4 requantized to MXFP4" if f.requantized else
           "NVFP4, every code and scale byte kept" if f.kept_nvfp4 else "MXFP4, every code and scale byte kept")
    # GGUF: llama.cpp computes norms, biases and the router in F32, which holds every BF16 value exactly
    bf16 = "BF16 byte for byte (1-D tensors and the router widened to F32)" if f.target == "gguf" else (
        "carried byte for byte")
    rows = [("FP4 routed experts", p.get("fp4_experts", 0), fp4), ("FP4 dense", p.get("fp4_dense", 0), fp4),
            ("FP8 per tensor", p.get("fp8_tensor", 0), "carried byte for byte"),
            ("FP8 in 128x128 blocks", p.get("fp8_block", 0), "carried byte for byte"),
            ("unquantized (BF16)", p.get("bf16", 0), bf16)]
    table = "| precision | Linear modules | in this output |\n|---|---:|---|\n" + "\n".join(
        f"| {a} | {n} | {b} |" for a, n, b in rows)
    kv = f"KV cache: {f.kv_cache} (declared in the config)." if f.kv_cache else "KV cache: unquantized."
    if f.kv_cache and f.target in ("gguf", "mlx"):
        kv = (f"KV cache: {f.kv_cache} in the source; the runtime keeps its own cache in 16-bit floats, so its "
              "scales are not written.")
    return ["## Precision", f"Linear modules per precision, as `mxfp4conv inspect` counts them in the source:\n\n"
            f"{table}\n\n{kv}"]


def _requant(f: CardFacts) -> list[str]:
    s = requant_summary(f.requant_stats) if f.requantized else None
    if s is None:
        return []
    lines = [f"| {name} | {sqnr_text(st.get('sqnr_db'))} | {st.get('clipped_blocks', 0)} of {st.get('blocks', 0)} |"
             for name, st in sorted(f.requant_stats.items())]
    return ["## Requantization",
            f"NVFP4 weights were dequantized exactly and requantized to MXFP4 once, with the E8M0 scale rule "
            f"`{f.scale_rule}` (`--scale-rule`; `mse` picks, per block of 32, the power-of-two scale of least "
            "squared error). The cost, per tensor, as signal-to-quantization-noise ratio against the NVFP4 values:",
            f"- {s.tensors} requantized tensors; worst `{s.worst[0]}` {sqnr_text(s.worst[1])}, median "
            f"`{s.median[0]}` {sqnr_text(s.median[1])}\n- {s.clipped_tensors} tensors clipped any block "
            f"({s.clipped_blocks} of {s.blocks} blocks)",
            "<details><summary>Every requantized tensor</summary>\n\n| tensor | SQNR | clipped blocks |\n"
            "|---|---:|---:|\n" + "\n".join(lines) + "\n\n</details>"]


def _proof(f: CardFacts) -> list[str]:
    if not f.verified:
        return ["## Proof", "This output was written with `--no-verify`: it was not proven against the source. "
                "`mxfp4conv verify SRC DST` proves it."]
    copied = "the source's requantization" if f.requantized else "the source's codes and scales"
    return ["## Proof",
            "Every byte was proven before this output appeared: each tensor byte of every shard was read back "
            "after it was written and compared with the source, ranges carried unchanged byte for byte, every "
            f"other unit decoded with the layout's own decoder and compared bit for bit with {copied}; the "
            f"shard headers hold exactly the planned tensors{_config_proof(f)}. So a runtime loads exactly the "
            f"source's weights{', as requantized above' if f.requantized else ''}: no layout error (a swapped "
            "gate and up, a wrong nibble order, a misnamed expert) can hide in it. `mxfp4conv verify SRC DST` "
            "proves it again; `mxfp4conv.json` lists the sha256 of every file."]


def _config_proof(f: CardFacts) -> str:
    """What the proof says of the config: MLX's config names no per-module schemes to resolve."""
    if f.target == "mlx":
        return ", and mlx-lm quantizes exactly the modules whose scales the shards hold"
    if f.target == "gguf":
        return ", and the GGUF metadata is the architecture's, the tokenizer's and the source's as written"
    return (", and the config was resolved with the runtime's own matching rules to the precision the source "
            "gave each module")


def _run(f: CardFacts, use: _Use) -> list[str]:
    tp = f" --tensor-parallel-size {f.tp_size}" if f.tp_size > 1 else ""
    cmds = "\n".join(c.format(tp=tp) for c in use.run)
    return ["## How to run it", f"`DST` is this folder, or the Hub repo it is published under.\n\n```sh\n{cmds}\n```"]


def _original(f: CardFacts) -> list[str]:
    text = (f.card.text or "").strip()
    return [ORIGINAL_HEADING, f"The card of the source release ({f.repo_id or f.source}), as it was published; "
            "it describes the source, not this output.", text or "The source release has no model card."]


def card_facts(job: Job, src: str | Path, requant_stats: dict[str, dict[str, Any]]) -> CardFacts:
    """The card's facts for a planned conversion of ``src``."""
    from mxfp4conv import __version__
    from mxfp4conv.plan.inspect import fp4_experts

    opts, source = job.opts, job.ckpt.source
    path = source.file(CARD)
    card = read_source_card(path.read_text(encoding="utf-8", errors="replace") if path is not None else None)
    earlier = None
    if (own := source.own_file("mxfp4conv.json")) is not None:  # an earlier conversion in a folder
        try:
            earlier = json.loads(own.read_text())
        except (OSError, ValueError):
            earlier = None
    kinds = [u.kind for u in job.plan.units]
    return CardFacts(
        source=source.label, repo_id=source.repo_id, commit=source.commit,
        base_model=base_model_of(opts.base_model, source.repo_id, card, earlier if isinstance(earlier, dict) else None),
        layout=job.plan.layout, target=job.target.NAME, version=__version__, command=_command(job),
        precision=job.plan.precision.counts(fp4_experts(job.plan), kinds.count("dense")),
        kv_cache=job.plan.precision.kv_cache, requantized=job.needs_device, scale_rule=opts.scale_rule,
        requant_stats=requant_stats, verified=opts.verify, tp_size=job.ctx.target_options.tp_size, card=card,
        kept_nvfp4=job.ctx.target_options.keep_nvfp4 and job.ctx.facts.source_quant == "nvfp4")


def _command(job: Job) -> str:
    """The ``convert`` command with the options that change the output's bytes."""
    from mxfp4conv.plan.job import ConvertOptions

    opts, t = job.opts, job.opts.target_options
    # DST as in "how to run it": the card is the same wherever the output was written
    words = ["mxfp4conv", "convert", job.ckpt.source.command_arg(), "DST", "--to", job.target.NAME,
             *job.ckpt.source.revision_words(opts.revision)]
    if job.needs_device:
        words += ["--scale-rule", opts.scale_rule]
    if opts.max_shard_size != ConvertOptions().max_shard_size:
        words += ["--max-shard-size", f"{opts.max_shard_size}B"]
    if job.target.NAME == "marlin":
        words += ["--tp-size", str(t.tp_size), "--engine", t.engine, "--marlin-act", t.marlin_act]
    if t.keep_nvfp4:
        words.append("--keep-nvfp4")
    if opts.base_model:
        words += ["--base-model", opts.base_model]
    return " ".join(words)
