"""The command line: ``mxfp4conv inspect | convert | verify``. The only module importing click and rich.

stdout carries data (one JSON document with --json); stderr carries people's output (tables,
progress, errors). Errors are one line and an exit code; tracebacks only with --debug or
MXFP4CONV_DEBUG=1.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mxfp4conv import __version__
from mxfp4conv.errors import EXIT_INTERNAL, ConvertError

if TYPE_CHECKING:
    from mxfp4conv.run.pipeline import ConvertOptions

Progress = Callable[[int, int], None]  # (bytes done, bytes in all); (-1, -1) closes a bar

_err = Console(stderr=True, highlight=False, soft_wrap=True)
_CTRL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _safe(text: object) -> str:
    """Names come from untrusted files: control characters become ``?`` and rich markup is escaped
    (a tensor name or hint holding ``[...]`` prints as written)."""
    return escape(_CTRL.sub("?", str(text)))


def _fail(exc: BaseException, debug: bool) -> NoReturn:
    if debug:
        traceback.print_exc()
    if isinstance(exc, ConvertError):
        _err.print(f"[bold red]error:[/] {_safe(exc.one_line())}", markup=True)  # hints hold [brackets]
        sys.exit(exc.exit_code)
    _err.print(f"[bold red]internal error:[/] {_safe(type(exc).__name__)}: {_safe(exc)} "
               "(a bug in mxfp4conv; rerun with --debug and report it)", markup=True)
    sys.exit(EXIT_INTERNAL)


@contextlib.contextmanager
def _handled(debug: bool) -> Iterator[None]:
    """Errors as one line and their exit code (``_fail``); click's own usage errors as click prints them."""
    debug = debug or os.environ.get("MXFP4CONV_DEBUG") == "1"
    try:
        yield
    except click.ClickException:  # a bad option value found while running: click's usage error (exit 2)
        raise
    except (ConvertError, Exception) as exc:
        _fail(exc, debug)


def _run(debug: bool, fn: Callable[[], int]) -> NoReturn:
    with _handled(debug):
        code = fn()
    sys.exit(code)


def _emit_json(doc: dict[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


_size_units = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
               "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _size_units:
        raise click.BadParameter(f"{text!r} is not a size like 5GB, 500MB or 2GiB")
    value = int(float(m.group(1)) * _size_units[m.group(2).upper()])
    if value <= 0:
        raise click.BadParameter("must be positive")
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mxfp4conv")
def cli() -> None:
    """Convert FP4 mixture-of-experts checkpoints into layouts runtimes load natively.

    \b
    Exit codes: 0 ok, 1 input rejected / unreadable / output problem, 2 usage,
    3 verification failed (nothing published), 123 internal error.
    """


@cli.command("inspect")
@click.argument("src")
@click.option("--revision", default=None, help="Hugging Face revision (for a repo id SRC).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def inspect_cmd(src: str, revision: str | None, as_json: bool, debug: bool) -> None:
    """Describe an FP4 MoE checkpoint from its headers (no weight data is read).

    \b
    Examples:
      mxfp4conv inspect ./Qwen3-30B-A3B-MXFP4A16
      mxfp4conv inspect openai/gpt-oss-20b --json
    """
    from mxfp4conv.plan.inspect import inspect_checkpoint

    def run() -> int:
        report = inspect_checkpoint(src, revision)
        doc = report.to_dict()
        if as_json:
            _emit_json(doc)
            if doc["problems"]:
                p = doc["problems"][0]
                more = f" (and {len(doc['problems']) - 1} more in the JSON report)" if len(doc["problems"]) > 1 else ""
                _err.print(f"problem: {_safe(p['file'])}: {_safe(p['tensor'])}: {_safe(p['message'])}{more}")
        else:
            _render_inspect(doc, stream_note=report.at_link_rate)
        return report.exit_code

    _run(debug, run)


def _render_inspect(doc: dict[str, Any], *, stream_note: bool = False) -> None:
    t = Table(title=f"mxfp4conv inspect: {_safe(doc['source'])}", show_header=False)
    for key in ("layout", "model_type", "architecture", "scheme", "num_layers", "num_moe_layers", "num_experts",
                "hidden_size", "intermediate_size", "num_dense_fp4_layers", "num_passthrough_tensors", "tensors"):
        t.add_row(key, _safe(doc[key]))
    prec = doc["precision"]
    t.add_row("precision", f"FP4 experts {prec['fp4_experts']}, FP4 dense {prec['fp4_dense']}, FP8 per-tensor "
              f"{prec['fp8_tensor']}, FP8 block {prec['fp8_block']}, BF16 {prec['bf16']} (Linear modules)")
    t.add_row("kv cache", _safe(doc["kv_cache"] or "unquantized"))
    t.add_row("total size", f"{doc['total_bytes'] / 1e9:.3f} GB in {len(doc['files'])} file(s)")
    t.add_row("evidence", _safe("; ".join(doc["evidence"])))
    t.add_row("targets", ", ".join(doc["targets"]) or "-")
    for name, why in doc.get("refused", {}).items():
        t.add_row(f"not --to {name}", _safe(why))
    _err.print(t)
    if stream_note:
        _err.print(f"note: `mxfp4conv convert {_safe(doc['source'])} DST --stream` converts without a local copy; "
                   f"without --stream the {doc['total_bytes'] / 1e9:.3f} GB are downloaded into huggingface_hub's cache "
                   "first", markup=False)
    if doc["inferred_layout"]:
        _err.print(f"[yellow]note:[/] no quantization config found: layout {_safe(doc['layout'])} was inferred "
                   "from tensor names and dtypes", markup=True)
    for p in doc["problems"]:
        _err.print(f"[red]problem:[/] {_safe(p['file'])}: {_safe(p['tensor'])}: {_safe(p['message'])}", markup=True)
    if not doc["problems"]:
        _err.print("[green]ok:[/] complete and consistent", markup=True)


@cli.command("convert")
@click.argument("src")
@click.argument("dst")
@click.option("--to", "target", default="auto", show_default=True,
              type=click.Choice(["auto", "ct", "quark", "gpt-oss", "marlin", "mlx", "gguf"]), help="Output layout.")
@click.option("--scale-rule", default="mse", show_default=True, type=click.Choice(["mse", "even", "floor", "rceil"]),
              help="E8M0 scale rule for NVFP4 -> MXFP4 requantization.")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N (same bytes on all).")
@click.option("--devices", default=None, metavar="0,1", help="GPU ids to spread work units over (default with --device cuda: all).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard.")
@click.option("--tp-size", default=1, show_default=True, type=click.IntRange(1, 64), help="Marlin: tensor-parallel size.")
@click.option("--engine", default="vllm", show_default=True, type=click.Choice(["vllm", "sglang"]), help="Marlin: target engine.")
@click.option("--marlin-act", default="bf16", show_default=True, type=click.Choice(["bf16", "fp8"]),
              help="Marlin: activation type of the kernel (fp8 = vLLM's W4A8 MXFP4 tiling).")
@click.option("--keep-nvfp4", is_flag=True, help="Marlin: keep NVFP4 sources as NVFP4 (no requantization; refused for mlx and gguf).")
@click.option("--revision", default=None, help="Hugging Face revision (for a repo id SRC).")
@click.option("--stream", is_flag=True,
              help="A repo id SRC: read its shards by range instead of downloading them (no local copy; each "
                   "shard's sha256 checked against the Hub's before DST appears).")
@click.option("--overwrite", is_flag=True, help="Replace an existing DST (atomically).")
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
@click.option("--no-verify", is_flag=True, help="Skip the post-write verification.")
@click.option("--resume", is_flag=True, help="Reuse finished shards (re-hashed) from an interrupted run's staging folder.")
@click.option("--partition", default=None, metavar="I/N", help="Write only shards j with j % N == I into the staging folder.")
@click.option("--finish", is_flag=True, help="Verify and publish once every --partition has finished.")
@click.option("--skip-if-current", is_flag=True, help="Do nothing if DST's manifest matches this input and these options.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Run work units as Ray tasks on the cluster at ADDRESS (HOST:PORT); input and output must be on "
                   "a filesystem every node sees. Needs mxfp4conv[ray].")
@click.option("--push-to-hub", "push_to_hub", default=None, metavar="ORG/NAME",
              help="Upload the published DST to this Hugging Face repo in one commit (resumable: run it again); "
                   "with --partition, upload this partition's shards for --finish to commit.")
@click.option("--private", is_flag=True, help="--push-to-hub: create the repo private.")
@click.option("--push-revision", default=None, metavar="BRANCH", help="--push-to-hub: commit to this branch (made if missing).")
@click.option("--commit-message", default=None, metavar="TEXT", help="--push-to-hub: the commit's message.")
@click.option("--base-model", default=None, metavar="ORG/NAME",
              help="The Hub repo DST's card names as its base model (default: a repo id SRC, else the source card's).")
@click.option("--json", "as_json", is_flag=True, help="Print the final report as one JSON document on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def convert_cmd(src: str, dst: str, target: str, scale_rule: str, device: str, devices: str | None, max_shard_size: str, tp_size: int,
                engine: str, marlin_act: str, keep_nvfp4: bool, revision: str | None, stream: bool, overwrite: bool,
                dry_run: bool, no_verify: bool,
                resume: bool, partition: str | None, finish: bool, skip_if_current: bool, ray_address: str | None,
                push_to_hub: str | None, private: bool, push_revision: str | None, commit_message: str | None,
                base_model: str | None, as_json: bool, debug: bool) -> None:
    """Convert SRC (folder or HF repo id) into DST; verified before it appears.

    \b
    Examples:
      mxfp4conv convert ./Qwen3-30B-A3B-MXFP4A16 ./out --to ct
      mxfp4conv convert ./gpt-oss-20b ./gpt-oss-20b-quark --to quark --json
      mxfp4conv convert ./Qwen3-30B-A3B-NVFP4 ./out --to ct --scale-rule mse --device cuda
      mxfp4conv convert ./src ./out --dry-run
      mxfp4conv convert ./src ./out --partition 0/4   # on 4 machines sharing a filesystem, then:
      mxfp4conv convert ./src ./out --finish
      mxfp4conv convert ./src ./out --ray 10.0.0.1:6379   # on a Ray cluster sharing a filesystem
      mxfp4conv convert ./gpt-oss-20b ./out --to quark --push-to-hub my-org/gpt-oss-20b-quark --private
    """
    from mxfp4conv.publish.push import PushOptions
    from mxfp4conv.publish.release import convert

    with _handled(debug):
        if ray_address is not None:
            _refuse_with_ray(partition=partition is not None, finish=finish, dry_run=dry_run,
                             devices=devices is not None)
        opts = _convert_options(target, scale_rule, device, devices, max_shard_size, tp_size, engine, marlin_act,
                                keep_nvfp4, revision, stream, overwrite, dry_run, no_verify, resume, partition,
                                finish, skip_if_current, base_model)
        push = PushOptions.from_cli(push_to_hub, private, push_revision, commit_message, opts)
        bars = _ConvertBars.on_terminal(not as_json and sys.stderr.isatty(), stream=stream, push=push is not None)
        # the units of a run on Ray are converted by its workers, not in this process
        collector: contextlib.AbstractContextManager[Progress | None] = (
            _collector_settled_at_first_unit(bars.converting) if ray_address is None
            else contextlib.nullcontext(bars.converting))
        with collector as progress:
            report = convert(src, dst, opts, on_progress=progress, on_fetch=bars.streaming, push=push,
                             ray=ray_address, on_push=bars.uploading)
        if as_json:
            _emit_json(report.to_dict())
        else:
            _render_convert(report.to_dict())
    sys.exit(0)


def _refuse_with_ray(**given: bool) -> None:
    """``--ray`` with the options it plans itself: click's usage error (exit 2)."""
    clash = [f"--{name.replace('_', '-')}" for name, on in given.items() if on]
    if clash:
        raise click.UsageError(f"--ray cannot be combined with {', '.join(clash)} "
                               "(--ray plans the partitions and devices itself)")


def _convert_options(target: str, scale_rule: str, device: str, devices: str | None, max_shard_size: str,
                     tp_size: int, engine: str, marlin_act: str, keep_nvfp4: bool, revision: str | None,
                     stream: bool, overwrite: bool, dry_run: bool, no_verify: bool, resume: bool,
                     partition: str | None, finish: bool, skip_if_current: bool,
                     base_model: str | None) -> ConvertOptions:
    """``convert``'s options, parsed (a bad value is click's usage error, exit 2)."""
    from mxfp4conv.run.pipeline import ConvertOptions
    from mxfp4conv.targets.base import TargetOptions

    topts = TargetOptions(tp_size=tp_size, engine=engine, marlin_act=marlin_act, keep_nvfp4=keep_nvfp4)
    return ConvertOptions(target=target, scale_rule=scale_rule, device=_device(device),
                          max_shard_size=parse_size(max_shard_size), overwrite=overwrite, dry_run=dry_run,
                          verify=not no_verify, skip_if_current=skip_if_current, revision=revision, stream=stream,
                          target_options=topts, resume=resume, partition=_partition(partition), finish=finish,
                          devices=_device_list(devices), base_model=base_model)


@dataclass(frozen=True)
class _ConvertBars:
    """``convert``'s progress bars on a terminal (None each where it is not shown): a Hub repo read by
    range (its bytes, their rate and the time left) above the output's bar; the shards' uploads below it."""

    converting: Progress | None = None
    streaming: Progress | None = None
    uploading: Progress | None = None

    @classmethod
    def on_terminal(cls, shown: bool, *, stream: bool, push: bool) -> _ConvertBars:
        if not shown:
            return cls()
        return cls(converting=_progress_bar("converting", position=1 if stream else 0 if push else None),
                   streaming=_progress_bar("streaming", position=0) if stream else None,
                   uploading=_progress_bar("uploading", position=2 if stream else 1) if push else None)


def _torch_pending() -> bool:
    """Whether torch is not imported yet, or still being imported on another thread."""
    mod = sys.modules.get("torch")
    return mod is None or bool(getattr(getattr(mod, "__spec__", None), "_initializing", False))


@contextlib.contextmanager
def _collector_settled_at_first_unit(
        progress: Callable[[int, int], None] | None) -> Iterator[Callable[[int, int], None]]:
    """Python's cyclic garbage collector off while a conversion starts, back on once torch is imported
    (at the first unit written after that), after one full pass, the objects that exist then frozen.
    Importing torch and planning a large checkpoint leave ~1M long-lived objects and little cyclic
    garbage; each full collection walks them all, holding the GIL the reader, writer and kernel
    threads need (0.3-0.4 s of a small conversion, against the one pass of ~0.1 s). Frozen objects
    are freed as usual once unreferenced, only never scanned again. A conversion that never imports
    torch (renames) runs with the collector off: it makes a few dozen cyclic objects, however many
    units it has. The collector is restored as it was when the command returns."""
    was = gc.isenabled()
    settled = [False]

    def update(done: int, total: int) -> None:
        if not settled[0] and done >= 0 and not _torch_pending():
            settled[0] = True
            # one full pass first: torch's import leaves a cycle of frames (torch.fx looks up its
            # caller's) that holds the importing thread's stack, the locals of the function that
            # read the first unit included; frozen, that unit's memory would never be freed
            gc.collect()
            gc.freeze()
            if was:
                gc.enable()
        if progress is not None:
            progress(done, total)

    gc.disable()
    try:
        yield update
    finally:
        gc.unfreeze()
        if was:
            gc.enable()


def _device_list(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    if not re.fullmatch(r"\d+(,\d+)*", text):
        raise click.BadParameter(f"{text!r}: use GPU ids like 0,1", param_hint="--devices")
    return tuple(f"cuda:{i}" for i in text.split(","))


def _partition(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise click.BadParameter(f"{text!r}: use I/N with 0 <= I < N, e.g. 0/4", param_hint="--partition")
    return int(m.group(1)), int(m.group(2))


def _device(name: str) -> str:
    """Validate ``--device``; ``auto`` is resolved by the pipeline, only if something is requantized."""
    if name == "auto":
        return name
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise click.BadParameter(f"{name!r}: use auto, cpu, cuda or cuda:N", param_hint="--device")
    return name


def _progress_bar(desc: str, position: int | None = None) -> Callable[[int, int], None]:
    """A bar of bytes (done, total), with their rate and the time left; ``done < 0`` closes it."""
    from tqdm import tqdm

    bar: list[Any] = []

    def update(done: int, total: int) -> None:
        if done < 0:
            if bar:
                bar[0].close()
            return
        if not bar:
            bar.append(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr,
                            desc=desc, dynamic_ncols=True, position=position))
        elif total != bar[0].total:  # the uploads' total grows as shards are finished
            bar[0].total = total
        bar[0].update(done - bar[0].n)

    return update


def _render_convert(doc: dict[str, Any]) -> None:
    if doc["status"] == "skipped":
        _err.print(f"[green]up to date:[/] {_safe(doc['destination'])} already matches this input and these options",
                   markup=True)
        return
    t = Table(title=f"{doc['layout']} -> {doc['target']}" + (" (dry run: nothing written)" if doc["status"] == "dry-run" else ""))
    t.add_column("shard")
    t.add_column("tensors", justify="right")
    t.add_column("bytes", justify="right")
    for s in doc["shards"]:
        t.add_row(_safe(s["file"]), str(s["tensors"]), f"{s['bytes']:,}")
    _err.print(t)
    _err.print(f"MoE layers fused: {doc['fused_layers']}, FP4 units requantized: {doc['requantized']}, "
               f"tensors renamed: {doc['renamed']}, passed through: {doc['passthrough']}")
    _render_requant(doc["requant_stats"])
    on = doc.get("requantized_on") or {}
    if len(on) > 1:  # several GPUs
        _err.print("requantized on: " + ", ".join(f"{_safe(d)} {n} unit(s)" for d, n in sorted(on.items())))
    if doc.get("ray"):
        r = doc["ray"]
        _err.print(f"Ray: {r['tasks']} task(s) on {r['nodes']} node(s) of {_safe(r['address'])} (one {r['resource']} each)")
    if doc["status"] == "converted":
        v = doc.get("verify")
        sec = doc["seconds"]
        busy = ", ".join(f"{k} {sec[k]:.1f}" for k in ("read", "transform", "write", "hash", "verify") if sec.get(k))
        if busy:
            _err.print(f"busy seconds per stage (read, transform, write and hash overlap, the largest bounds the "
                       f"conversion; verify checks each unit while it is written): {busy}")
        _err.print(f"[green]done:[/] {_safe(doc['destination'])} ({doc['bytes_written']:,} bytes, "
                   f"{doc['seconds'].get('total', 0):.1f} s)" + (", verified" if v and v.get("ok") else ", NOT verified"),
                   markup=True)
    if doc.get("push") and doc["push"]["commit"] is None:
        p = doc["push"]
        _err.print(f"[green]uploaded:[/] {len(p['uploaded'])} of this partition's {p['shards']} shards to "
                   f"{_safe(p['repo_id'])}@{_safe(p['revision'])}; --finish --push-to-hub commits them "
                   "(and sends any not up yet)", markup=True)
    elif doc.get("push"):
        p = doc["push"]
        _err.print(f"[green]pushed:[/] {_safe(p['repo_id'])}@{_safe(p['revision'])} commit {p['commit']} ({p['files']} "
                   f"files, {p['bytes']:,} bytes{', private' if p['private'] else ''})", markup=True)


def _render_requant(stats: dict[str, dict[str, Any]]) -> None:
    """One summary of the requantized tensors (every tensor: --json, the manifest, DST/README.md)."""
    from mxfp4conv.run.card import requant_summary, sqnr_text

    s = requant_summary(stats)
    if s is None:
        return
    _err.print(f"requantized tensors: {s.tensors}; SQNR worst {sqnr_text(s.worst[1])} ({_safe(s.worst[0])}), "
               f"median {sqnr_text(s.median[1])} ({_safe(s.median[0])}); {s.clipped_tensors} clipped any block "
               f"({s.clipped_blocks:,} of {s.blocks:,} blocks); every tensor in --json and DST/README.md")


@cli.command("verify")
@click.argument("src")
@click.argument("dst")
@click.option("--device", default="auto", show_default=True, help="Device for recomputing requantized tensors.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def verify_cmd(src: str, dst: str, device: str, as_json: bool, debug: bool) -> None:
    """Prove DST (written by convert) against SRC, byte for byte; exit 3 on any difference."""
    from mxfp4conv.proof.verify import verify_output

    def run() -> int:
        report = verify_output(src, dst, raise_on_failure=False, device=_device(device))
        doc = report.to_dict()
        if as_json:
            _emit_json(doc)
        elif report.ok:
            _err.print(f"[green]verified:[/] {report.units} units, {report.tensors} tensors match", markup=True)
        else:
            for m in report.mismatches:
                _err.print(f"[red]mismatch:[/] {_safe(m['tensor'])}: {_safe(m['message'])}", markup=True)
        return report.exit_code

    _run(debug, run)


def main() -> None:
    """The console script. Once a command has finished (its output published, its report printed), the
    process ends without the interpreter's teardown: freeing torch, its ~1 GB of loaded libraries and
    a CUDA context takes a noticeable share of a small conversion's time and buys nothing. Not with
    Ray loaded (its own exit handler disconnects the driver from the cluster)."""
    code = 0
    # torch then backs its CPU tensors of 2 MiB and more with transparent huge pages (it reads the variable
    # once, at its first such allocation, so it is set before torch is imported): a unit's fresh buffers
    # fault in 2 MiB at a time, not 4 KiB, which was a quarter of a decoding conversion's CPU time
    # (BENCHMARKS.md, "--to gguf"; docs/performance.md). A user's 0 stands.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    try:
        cli(prog_name="mxfp4conv")
    except SystemExit as exc:
        if not isinstance(exc.code, int | None) or "ray" in sys.modules:
            raise
        code = exc.code or 0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (``| head``): nothing more can be said
            code = code or 1
    os._exit(code)


if __name__ == "__main__":
    main()
