"""Reading mutations that the proof cannot see, each of which the test suite must catch.

The inline proof and ``verify`` read the source through the same layout code as the conversion, so
a source misread the same way on both sides passes them. Each mutation below is such a misreading.
For each, the package is copied into a temporary folder, the one change applied there, and the named
fast tests run against the copy; the check passes only if the unchanged copy passes those tests and
every mutated copy fails them. The working tree is never modified.

    python tests/mutation/run.py            # every mutation (make mutation)
    python tests/mutation/run.py -k global  # those whose name contains "global"
    python tests/mutation/run.py --serving  # vLLM's serving tests instead (make mutation-serving)

Not part of ``make test``: each mutation reruns its tests (under a minute each on two cores; the
serving tests, which need vLLM's CPU venv, about a minute and a half).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# the tests that hold the source's reading against an independent oracle (tests/oracle.py)
ORACLE_TESTS = ("tests/test_oracle.py", "tests/cli/test_real_families.py::test_convert_keeps_the_values_the_source_means")
# vLLM's loaded parameters against a reference made from the source by the oracle, on every host
SERVING_TESTS = ("tests/serving/test_vllm_cpu.py",)


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    why: str
    serving: bool = False  # the serving tests hold a source of this layout: they must catch it too


MUTATIONS = (
    Mutation("modelopt-global-scale-as-divisor", "mxfp4conv/layouts/modelopt_nvfp4.py",
             'global_scale="weight_scale_2", global_is_divisor=False',
             'global_scale="weight_scale_2", global_is_divisor=True',
             "ModelOpt's weight_scale_2 is a multiplier", serving=True),
    Mutation("quark-nvfp4-global-scale-as-divisor", "mxfp4conv/layouts/quark_nvfp4.py",
             'global_scale="weight_scale_2", global_is_divisor=False',
             'global_scale="weight_scale_2", global_is_divisor=True',
             "Quark NVFP4's weight_scale_2 is a multiplier"),
    Mutation("ct-nvfp4-global-scale-as-multiplier", "mxfp4conv/layouts/ct_nvfp4.py",
             'global_scale="weight_global_scale", global_is_divisor=True',
             'global_scale="weight_global_scale", global_is_divisor=False',
             "compressed-tensors' weight_global_scale is a divisor", serving=True),
    Mutation("nvfp4-global-scale-read-as-one", "mxfp4conv/layouts/split.py",
             "global_rows = torch.cat(parts, dim=1).contiguous()",
             "global_rows = torch.ones_like(torch.cat(parts, dim=1)).contiguous()",
             "every NVFP4 second-level scale ignored", serving=True),
    Mutation("nvfp4-first-module-global-scale-for-all", "mxfp4conv/layouts/split.py",
             "parts.append(gs[:, None].expand(-1, n))",
             "parts.append(gs[:1, None].expand(len(mods), n))",
             "gate's second-level scale applied to up (and to every expert of a group)"),
    Mutation("gpt-oss-gate-up-swapped", "mxfp4conv/layouts/gpt_oss.py",
             "idx = torch.cat([torch.arange(0, n, 2, device=x.device), torch.arange(1, n, 2, device=x.device)])",
             "idx = torch.cat([torch.arange(1, n, 2, device=x.device), torch.arange(0, n, 2, device=x.device)])",
             "GPT-OSS's gate rows are the even ones"),
)


def _copy(dst: Path) -> None:
    for name in ("mxfp4conv", "tests", "examples"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _run(copy: Path, tests: tuple[str, ...]) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(copy)}  # ahead of the editable install's finder
    probe = subprocess.run([sys.executable, "-c", "import mxfp4conv; print(mxfp4conv.__file__)"], cwd=copy, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(probe).resolve().is_relative_to(copy.resolve()), f"tests would import {probe}, not the copy"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=copy,
                         env=env, capture_output=True, text=True)
    failed = [ln.split()[1].split("::", 1)[-1] for ln in res.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    summary = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr.strip()[-300:]
    if failed:
        summary += ": " + ", ".join(failed[:6]) + (f", ... ({len(failed) - 6} more)" if len(failed) > 6 else "")
    return res.returncode, summary, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="run only the mutations whose name contains this")
    ap.add_argument("--tests", nargs="+", default=None, help="the tests that must catch each mutation")
    ap.add_argument("--serving", action="store_true",
                    help="the serving tests (vLLM's CPU venv) on the mutations of the layouts they serve")
    args = ap.parse_args(argv)
    tests = tuple(args.tests or (SERVING_TESTS if args.serving else ORACLE_TESTS))
    chosen = [m for m in MUTATIONS if args.k in m.name and (m.serving or not args.serving)]
    if args.serving:  # without vLLM the serving tests skip, which would read as "survived"
        os.environ.setdefault("MXFP4CONV_REQUIRE_VLLM", "1")
    with tempfile.TemporaryDirectory(prefix="mxfp4conv-mutation-") as tmp:
        base = Path(tmp) / "base"
        _copy(base)
        code, line, secs = _run(base, tests)
        print(f"unchanged copy: exit {code} in {secs:.0f}s ({line})", flush=True)
        if code != 0:
            print("the unchanged package fails the tests: nothing to measure", file=sys.stderr)
            return 2
        survived = []
        for m in chosen:
            copy = Path(tmp) / m.name
            _copy(copy)
            target = copy / m.path
            text = target.read_text()
            if text.count(m.old) != 1:
                print(f"{m.name}: the code to mutate is no longer in {m.path}; update tests/mutation/run.py",
                      file=sys.stderr)
                return 2
            target.write_text(text.replace(m.old, m.new))
            code, line, secs = _run(copy, tests)
            caught = code == 1  # 1: tests failed; anything else (usage, collection, internal) is no verdict
            print(f"{m.name} ({m.why}): {'caught' if caught else f'SURVIVED (exit {code})'} in {secs:.0f}s: {line}",
                  flush=True)
            if not caught:
                survived.append(m.name)
            shutil.rmtree(copy)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations caught"
          + (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
