"""Where the time of an NVFP4 -> MXFP4 conversion goes on a CUDA machine (host-side profile).

    PYTHONPATH=. python3 tools/device_profile.py OUT_DIR [--layers 4] [--device cuda:0]

Generates a Qwen3-30B-A3B-like ModelOpt NVFP4 checkpoint, converts it once in-process under cProfile
(``--no-verify``), and writes OUT_DIR/profile.txt (top functions by total and cumulative time) and
OUT_DIR/profile.json (the convert report: per-stage seconds, wall, GB/s).

``--as-typed`` runs the CLI's default command (``mxfp4conv convert SRC DST --to ct --device cuda``,
which verifies; ``--json`` is added for the report, ``--flag=--no-verify`` adds a flag) in a fresh
process under the sampler below, so Python's, torch's and CUDA's start are on the timeline as users
meet them.

``--sample`` replaces cProfile (which sees the main thread only) by a sampler of every thread's stack
(``sys._current_frames`` every 2 ms): OUT_DIR/samples.txt lists, per thread, where it spent its
time (innermost frame of our package or the stdlib call it waits in), so a reader / device / writer /
hasher thread that bounds the pipeline shows up as the one that is never idle; OUT_DIR/timeline.txt
shows, per half second, how busy each kind of thread was (start-up, steady state and tail apart);
OUT_DIR/memory.txt, per half second, the process's largest anonymous, file-backed and shared resident
memory (``/proc/self/status``), which tells where a peak RSS is reached and of what kind.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _where(frame) -> str:  # type: ignore[no-untyped-def]
    """The innermost frame inside mxfp4conv, and the frame below it (what it is waiting in / calling)."""
    inner = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
    f = frame
    while f is not None and "mxfp4conv" not in f.f_code.co_filename:
        f = f.f_back
    if f is None or f is frame:
        return inner
    return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}:{f.f_lineno} -> {inner}"


class Sampler(threading.Thread):
    def __init__(self, period: float = 0.002) -> None:
        super().__init__(daemon=True, name="sampler")
        self.period = period
        self.stop = threading.Event()
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        # per thread, per BUCKET seconds since start: [busy samples, all samples]
        self.timeline: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.t0 = time.perf_counter()
        # per BUCKET: the largest RssAnon / RssFile / RssShmem seen (kB), from /proc/self/status
        self.memory: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])

    BUCKET = 0.5
    MEMORY_EVERY = 5  # samples between two reads of /proc/self/status
    IDLE = ("threading.py:wait", "thread.py:_worker", "_wait_for_tstate_lock", "queue.py:get")

    def run(self) -> None:
        me = threading.get_ident()
        n = 0
        while not self.stop.wait(self.period):
            names = {t.ident: t.name for t in threading.enumerate()}
            b = int((time.perf_counter() - self.t0) / self.BUCKET)
            n += 1
            if n % self.MEMORY_EVERY == 0:
                self._memory(b)
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    name = names.get(ident, str(ident))
                    where = _where(frame)
                    self.counts[name][where] += 1
                    cell = self.timeline[name.rstrip("0123456789_")][b]
                    cell[0] += not where.endswith(self.IDLE)
                    cell[1] += 1

    def _memory(self, b: int) -> None:
        try:
            text = Path("/proc/self/status").read_text()
        except OSError:
            return
        cell = self.memory[b]
        for line in text.splitlines():
            for i, key in enumerate(("RssAnon:", "RssFile:", "RssShmem:")):
                if line.startswith(key):
                    cell[i] = max(cell[i], int(line.split()[1]))

    def memory_text(self) -> str:
        """Per BUCKET seconds, the largest anonymous / file-backed / shared resident memory, in GB."""
        lines = ["second  anon_GB  file_GB  shmem_GB"]
        for b in sorted(self.memory):
            a, f, s = self.memory[b]
            lines.append(f"{b * self.BUCKET:6.1f}  {a / 1e6:7.3f}  {f / 1e6:7.3f}  {s / 1e6:8.3f}")
        return "\n".join(lines) + "\n"

    def timeline_text(self) -> str:
        """One line per thread kind (numbered threads merged): per BUCKET seconds, the busy share of its
        samples as a digit (0-9, '*' = every sample busy, '.' = the thread did not exist)."""
        last = max((max(t) for t in self.timeline.values() if t), default=0)
        lines = [f"bucket {self.BUCKET} s; digit = busy share of the thread kind's samples (9 = 90%+)"]
        for name, cells in sorted(self.timeline.items()):
            row = "".join("." if b not in cells else ("*" if cells[b][0] == cells[b][1] else str(min(9, 10 * cells[b][0] // cells[b][1])))
                          for b in range(last + 1))
            lines.append(f"{name[:22]:22s} {row}")
        return "\n".join(lines) + "\n"

    def report(self) -> str:
        lines = []
        for name, c in sorted(self.counts.items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(c.values())
            lines.append(f"== {name}: {total} samples ({total * self.period:.2f} s)")
            for where, n in c.most_common(12):
                lines.append(f"  {100 * n / total:5.1f}%  {where}")
        return "\n".join(lines) + "\n"


def sampled_cli(out: Path, argv: list[str]) -> None:
    """Run ``mxfp4conv ARGV`` in this process under the sampler (this process must not have imported
    torch: its import is part of what is measured); OUT/samples.txt, OUT/timeline.txt, OUT/cli.json."""
    sampler = Sampler()
    sampler.start()
    from mxfp4conv.cli import cli

    code = 0
    try:
        cli.main(argv, prog_name="mxfp4conv", standalone_mode=False)
    except SystemExit as exc:
        code = int(exc.code or 0)
    wall = time.perf_counter() - sampler.t0
    sampler.stop.set()
    sampler.join()
    (out / "samples.txt").write_text(sampler.report())
    (out / "timeline.txt").write_text(sampler.timeline_text())
    (out / "memory.txt").write_text(sampler.memory_text())
    (out / "cli.json").write_text(json.dumps({"argv": argv, "exit_code": code, "wall_s": round(wall, 3)}))


def main() -> None:
    sys.path.insert(0, str(HERE))
    from gen_checkpoint import generate, warm

    from mxfp4conv.run.pipeline import ConvertOptions, convert

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--to", default="ct")
    ap.add_argument("--layout", default="modelopt-nvfp4", help="source layout to generate (ct-mxfp4 / gpt-oss: a lossless rename)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/prof"))
    ap.add_argument("--sample", action="store_true", help="sample every thread instead of cProfile")
    ap.add_argument("--keep-src", action="store_true", help="reuse WORK/src if it is there, and keep it afterwards")
    ap.add_argument("--as-typed", action="store_true", help="profile the CLI's command in a fresh process (see above)")
    ap.add_argument("--flag", action="append", default=[], dest="flags",
                    help="with --as-typed: one more convert flag (repeatable), e.g. --flag=--no-verify")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.keep_src and (args.work / "src").is_dir():
        shutil.rmtree(args.work / "out", ignore_errors=True)
        src = args.work / "src"
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        src = generate(args.work / "src", args.layout, args.layers)
    size = warm(src)
    if args.as_typed:
        argv = ["convert", str(src), str(args.work / "out"), "--to", args.to, "--device", args.device, "--json", *args.flags]
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); from pathlib import Path; "
                f"from device_profile import sampled_cli; sampled_cli(Path({str(args.out)!r}), sys.argv[1:])")
        rep = json.loads(subprocess.run([sys.executable, "-c", code, *argv], check=True, stdout=subprocess.PIPE).stdout)
        print(json.dumps({**json.loads((args.out / "cli.json").read_text()), "bytes": size, "seconds": rep["seconds"],
                          "requantized_on": rep.get("requantized_on"), "verified": (rep.get("verify") or {}).get("ok")}))
        print((args.out / "timeline.txt").read_text())
        print((args.out / "memory.txt").read_text())
        shutil.rmtree(args.work / "out", ignore_errors=True)
        if not args.keep_src:
            shutil.rmtree(args.work, ignore_errors=True)
        return
    opts = ConvertOptions(target=args.to, device=args.device, verify=False)
    # warm-up on a copy of one layer's worth is not possible cheaply: JIT time is part of the first unit
    if args.sample:
        sampler = Sampler()
        t0 = time.perf_counter()
        sampler.t0 = t0
        sampler.start()
        report = convert(src, args.work / "out", opts)
        wall = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
        (args.out / "samples.txt").write_text(sampler.report())
        (args.out / "timeline.txt").write_text(sampler.timeline_text())
    else:
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        report = convert(src, args.work / "out", opts)
        prof.disable()
        wall = time.perf_counter() - t0
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(45)
        (args.out / "profile.txt").write_text(buf.getvalue())
    doc = {"layers": args.layers, "bytes": size, "wall_s": round(wall, 3), "GBps": round(size / wall / 1e9, 3),
           "seconds": report.to_dict().get("seconds")}
    (args.out / "profile.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    # a 48-layer run leaves ~32 GB: keep only the source, and only when it is to be reused
    shutil.rmtree(args.work / "out", ignore_errors=True)
    if not args.keep_src:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
