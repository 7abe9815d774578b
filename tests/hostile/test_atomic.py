"""Destination safety: refusals, --overwrite, SIGKILL at random points, a full disk, determinism.

All conversions run as ``python -m mxfp4conv`` subprocesses. Independent subprocesses run
concurrently (each spends most of its time importing torch).
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.hostile.hostile_util import (
    cli_cmd,
    cli_env,
    file_hashes,
    inspectable_text,
    leftovers,
    lines,
    run_cli,
    staging_of,
    timestamp_like,
    tiny,
    tree_state,
)

REPO = Path(__file__).resolve().parents[2]
WORKERS = max(2, min(4, (os.cpu_count() or 2) + 1))
SEED = int(os.environ.get("HOSTILE_SEED", str(int(time.time()) % 100_000)))  # printed with -s; rerun with it
KILL_TRIALS = int(os.environ.get("HOSTILE_KILL_TRIALS", "4"))
BIG: dict[str, Any] = {"layers": 6, "experts": 8, "hidden": 128, "inter": 64, "shards": 4}
BIG_OPTS = ("--device", "cpu", "--max-shard-size", "200KB")  # ~9 output shards
OPTS = ("--device", "cpu")


def one_error_line(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode == 1, f"{what}: exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    got = lines(proc.stderr)
    assert len(got) == 1 and got[0].startswith("error:"), f"{what}: expected one 'error:' line:\n{proc.stderr}"
    return got[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("atomic")


@pytest.fixture(scope="module")
def small_src(work: Path) -> Path:
    return tiny.build("ct-mxfp4", work / "small-src")


@pytest.fixture(scope="module")
def small_ref(work: Path, small_src: Path) -> Path:
    """An in-process CLI convert of the small source: the bytes every subprocess run must reproduce."""
    from click.testing import CliRunner

    from mxfp4conv.cli import cli

    out = work / "small-ref" / "ref"
    out.parent.mkdir()
    res = CliRunner().invoke(cli, ["convert", str(small_src), str(out), *OPTS])
    assert res.exit_code == 0, res.stderr
    return out


# ---- refusals and --overwrite --------------------------------------------------------------------

@dataclass
class Scenario:
    args: list[str]
    watch: list[Path]  # trees that must be unchanged
    dst: Path
    expect_ok: bool = False


def _scenarios(base: Path, src: Path) -> dict[str, Scenario]:
    base.mkdir()
    out: dict[str, Scenario] = {}
    out["dst_equals_src"] = Scenario([str(src), str(src), "--overwrite"], [src], src)
    out["dst_inside_src"] = Scenario([str(src), str(src / "out")], [src], src / "out")
    (base / "link-to-src").symlink_to(src)
    out["dst_inside_src_via_symlink"] = Scenario([str(src), str(base / "link-to-src" / "out")], [src],
                                                 base / "link-to-src" / "out")
    real = base / "real"
    real.mkdir()
    (base / "link-parent").symlink_to(real)
    out["dst_parent_is_symlink"] = Scenario([str(src), str(base / "link-parent" / "out")], [real],
                                            base / "link-parent" / "out")
    target = base / "symlink-target"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    (base / "dst-link").symlink_to(target)
    out["dst_is_symlink_overwrite"] = Scenario([str(src), str(base / "dst-link"), "--overwrite"], [target],
                                               base / "dst-link")
    exists = base / "exists"
    exists.mkdir()
    (exists / "model.safetensors").write_bytes(b"previous output")
    out["dst_exists_no_overwrite"] = Scenario([str(src), str(exists)], [exists], exists)
    holder = base / "holder"  # DST holds SRC: --overwrite would delete the input with the old DST
    shutil.copytree(src, holder / "src")
    (holder / "notes.txt").write_text("the user's other files")
    out["dst_contains_src_overwrite"] = Scenario([str(holder / "src"), str(holder), "--overwrite"], [holder], holder)
    repo = base / "hub" / "models--org--tiny"  # DST is the blobs/ folder an HF snapshot links into
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("ab" * 20)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, repo / "blobs" / f"blob-{f.name}")
        (snap / f.name).symlink_to(os.path.relpath(repo / "blobs" / f"blob-{f.name}", snap))
    out["dst_is_hf_blobs_overwrite"] = Scenario([str(snap), str(repo / "blobs"), "--overwrite"], [repo],
                                                repo / "blobs")
    replace = base / "replace"
    replace.mkdir()
    (replace / "stale-file.txt").write_text("from an older run")
    (replace / "model.safetensors").write_bytes(b"previous output")
    out["dst_exists_overwrite"] = Scenario([str(src), str(replace), "--overwrite"], [], replace, expect_ok=True)
    return out


@pytest.fixture(scope="module")
def destination_runs(work: Path, small_src: Path) -> dict[str, tuple[Scenario, Any, dict[str, Any], dict[str, Any]]]:
    scen = _scenarios(work / "dst-cases", small_src)
    before = {k: {str(p): tree_state(p) for p in [small_src, *s.watch]} for k, s in scen.items()}

    def go(name: str) -> Any:
        return run_cli("convert", *scen[name].args, *OPTS)

    with ThreadPoolExecutor(WORKERS) as pool:
        procs = dict(zip(scen, pool.map(go, scen), strict=True))
    return {k: (scen[k], procs[k], before[k], {str(p): tree_state(p) for p in [small_src, *scen[k].watch]})
            for k in scen}


REFUSALS = ["dst_equals_src", "dst_inside_src", "dst_inside_src_via_symlink", "dst_parent_is_symlink",
            "dst_is_symlink_overwrite", "dst_exists_no_overwrite", "dst_contains_src_overwrite",
            "dst_is_hf_blobs_overwrite"]
_DST_EXISTS = {"dst_equals_src", "dst_exists_no_overwrite", "dst_is_symlink_overwrite", "dst_contains_src_overwrite",
               "dst_is_hf_blobs_overwrite"}


@pytest.mark.parametrize("name", REFUSALS)
def test_destination_refused(name: str, destination_runs: Any) -> None:
    scen, proc, before, after = destination_runs[name]
    line = one_error_line(proc, name)
    assert str(scen.dst) in line, line
    assert after == before, "SRC or an existing DST was modified"
    if name not in _DST_EXISTS:
        assert not os.path.lexists(scen.dst)
    assert not os.path.lexists(staging_of(scen.dst)), "staging folder left behind"
    if name == "dst_inside_src_via_symlink":
        assert not os.path.lexists(staging_of(scen.dst.parent.resolve() / scen.dst.name))


def test_overwrite_replaces(destination_runs: Any, small_ref: Path) -> None:
    scen, proc, _, _ = destination_runs["dst_exists_overwrite"]
    assert proc.returncode == 0, proc.stderr
    assert not (scen.dst / "stale-file.txt").exists(), "old DST content survived --overwrite"
    assert file_hashes(scen.dst) == file_hashes(small_ref)
    assert leftovers(scen.dst) == [str(scen.dst)]


# ---- SIGKILL at random points --------------------------------------------------------------------

@dataclass
class Big:
    src: Path
    ref: Path  # the reference output
    second: Path  # a second convert of the same input, run at the same time (for determinism)
    phase: float  # seconds from the staging folder's appearance to the publish (DST appears)
    second_proc: Any


@pytest.fixture(scope="module")
def big(work: Path) -> Big:
    src = tiny.build("ct-mxfp4", work / "big-src", **BIG)
    ref, second = work / "big-ref" / "ref", work / "big-second" / "another-name"
    ref.parent.mkdir()
    second.parent.mkdir()
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(run_cli, "convert", src, second, *BIG_OPTS)
        proc = subprocess.Popen(cli_cmd("convert", src, ref, *BIG_OPTS), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=cli_env(), cwd=str(REPO), text=True)
        seen = published = None
        while proc.poll() is None:
            if seen is None and staging_of(ref).exists():
                seen = time.monotonic()
            if published is None and ref.exists():
                published = time.monotonic()
            time.sleep(0.001)
        end = time.monotonic()
        _, err = proc.communicate()
        second_proc = other.result()
    assert proc.returncode == 0, err
    assert len(list(ref.glob("*.safetensors"))) > 3, "the reference should be multi-shard"
    return Big(src, ref, second, max((published or end) - (seen or end), 0.1), second_proc)


@dataclass
class Trial:
    n: int
    previous: bool  # an older DST exists and --overwrite is passed
    delay: float  # seconds after the staging folder appears


def _kill_trial(t: Trial, src: Path, ref: Path, base: Path) -> dict[str, Any]:
    dst = base / f"trial-{t.n}" / "out"
    dst.parent.mkdir(parents=True)
    prev_state = None
    if t.previous:
        shutil.copytree(ref, dst)
        (dst / "PREVIOUS-RUN.txt").write_text(f"trial {t.n}")
        prev_state = tree_state(dst)
    src_before = tree_state(src)
    args = [*BIG_OPTS, "--overwrite"] if t.previous else list(BIG_OPTS)
    proc = subprocess.Popen(cli_cmd("convert", src, dst, *args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=cli_env(), cwd=str(REPO), start_new_session=True)
    staged = None
    while proc.poll() is None:
        now = time.monotonic()
        if staged is None and os.path.lexists(staging_of(dst)):
            staged = now
        if staged is not None and now - staged >= t.delay:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: any helper processes die with it
            break
        time.sleep(0.001)
    rc = proc.wait()
    killed = rc == -signal.SIGKILL
    result: dict[str, Any] = {"trial": t, "rc": rc, "killed": killed}
    if os.path.lexists(dst):
        state = tree_state(dst)
        if prev_state is not None and state == prev_state:
            result["dst"] = "previous"
        elif file_hashes(dst) == file_hashes(ref) and not (dst / "PREVIOUS-RUN.txt").exists():
            result["dst"] = "new"
        else:
            result["dst"] = "CORRUPT: " + ", ".join(sorted(file_hashes(dst))[:12])
    else:
        result["dst"] = "none"
    result["src_unchanged"] = tree_state(src) == src_before
    result["staging_left"] = os.path.lexists(staging_of(dst))
    # A following convert cleans the staging folder up and succeeds.
    again = run_cli("convert", src, dst, *BIG_OPTS, *(["--overwrite"] if os.path.lexists(dst) else []))
    result["rerun_rc"], result["rerun_err"] = again.returncode, again.stderr
    result["rerun_equal"] = again.returncode == 0 and file_hashes(dst) == file_hashes(ref)
    result["rerun_left"] = leftovers(dst)
    return result


def test_sigkill_leaves_old_or_no_dst(work: Path, big: Big) -> None:
    """Kill convert at a random moment after its staging folder appears (writing, verifying or
    publishing): DST is absent, the previous DST byte for byte, or the complete new output; the next
    convert removes the stale staging folder and writes the reference bytes."""
    src, ref, phase = big.src, big.ref, big.phase
    rng = random.Random(SEED)
    # Three in four kills spread over writing + verifying, one in four around the publish itself.
    n = KILL_TRIALS
    delays = [rng.uniform(0.0, phase) if k % 4 != 3 else rng.uniform(0.9 * phase, 1.1 * phase) for k in range(n)]
    trials = [Trial(n, previous=n % 2 == 1, delay=d) for n, d in enumerate(delays)]
    base = work / "kills"
    base.mkdir()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda t: _kill_trial(t, src, ref, base), trials))
    report = "\n".join(f"  seed {SEED} {r['trial']}: rc={r['rc']} dst={r['dst']} staging_left={r['staging_left']}"
                       for r in results)
    for r in results:
        t: Trial = r["trial"]
        allowed = {"previous", "new"} if t.previous else {"none", "new"}
        assert r["dst"] in allowed, f"after SIGKILL DST is {r['dst']}, allowed {allowed}\n{report}"
        if not r["killed"]:
            assert r["rc"] == 0 and r["dst"] == "new", f"unkilled run failed\n{report}"
        assert r["src_unchanged"], f"SRC changed\n{report}"
        assert r["rerun_rc"] == 0, f"the convert after a SIGKILL failed: {r['rerun_err']}\n{report}"
        assert r["rerun_equal"], f"the convert after a SIGKILL wrote different bytes\n{report}"
        assert r["rerun_left"] == [str(base / f"trial-{t.n}" / "out")], f"left behind: {r['rerun_left']}\n{report}"
    print(report)


# ---- a full disk ---------------------------------------------------------------------------------


def _pages(n: int) -> int:
    return -(-n // 4096)


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[bool]:
    """A tmpfs of ``size`` bytes at ``path``; yields False when mounting is not permitted here."""
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        yield False
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


FULL_DISK = ["during_shard", "after_shards"]


@pytest.fixture(scope="module")
def full_disk_runs(work: Path, small_src: Path, small_ref: Path) -> Iterator[dict[str, Any]]:
    """Convert onto tmpfs mounts too small for the output, all at once: (mount, proc) per variant,
    or None where no tmpfs can be mounted (the shard variant then uses RLIMIT_FSIZE instead)."""
    sizes = {p: p.stat().st_size for p in small_ref.rglob("*") if p.is_file()}
    shard_pages = sum(_pages(n) for p, n in sizes.items() if p.suffix == ".safetensors")
    # during_shard: the first shard cannot be written; after_shards: the shards fit, the next file does not
    pages = {"during_shard": 4, "after_shards": shard_pages + 1}
    assert pages["after_shards"] < sum(_pages(n) for n in sizes.values())
    with contextlib.ExitStack() as stack:
        jobs: dict[str, Any] = {}
        for where in FULL_DISK:
            mnt = work / f"tmpfs-{where}"
            size = pages[where] * 4096
            if stack.enter_context(tmpfs(mnt, size)):
                jobs[where] = (mnt, {})
            elif where == "during_shard":  # a per-file size limit fails the same writes (EFBIG)
                def limit(size: int = size) -> None:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

                jobs[where] = (mnt, {"preexec_fn": limit})
        with ThreadPoolExecutor(WORKERS) as pool:
            futs = {w: pool.submit(run_cli, "convert", small_src, mnt / "out", *OPTS, **kw)
                    for w, (mnt, kw) in jobs.items()}
            out = {w: (jobs[w][0], f.result()) for w, f in futs.items()}
        yield {w: out.get(w) for w in FULL_DISK}  # the mounts stay until the tests looked at them


@pytest.mark.parametrize("where", [
    "during_shard",
    pytest.param("after_shards"),
])
def test_full_disk(where: str, full_disk_runs: dict[str, Any]) -> None:
    """Exit 1, one line naming the file being written, and nothing left on the full disk."""
    if full_disk_runs[where] is None:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    mnt, proc = full_disk_runs[where]
    line = one_error_line(proc, f"full disk ({where})")
    assert str(mnt) in line, f"the message does not name the file being written: {line}"
    assert leftovers(mnt / "out") == [], f"left behind on the full disk: {leftovers(mnt / 'out')}"
    assert os.listdir(mnt) == [], os.listdir(mnt)


# ---- determinism ---------------------------------------------------------------------------------

_FORBIDDEN = [str(REPO), "/tmp/", str(Path.home()) + "/", sys.prefix]


def _scan(out: Path, extra: list[str]) -> list[str]:
    problems = []
    for p in sorted(out.rglob("*")):
        if not p.is_file():
            continue
        text = inspectable_text(p)
        for s in [*_FORBIDDEN, *extra]:
            if s.encode() in text:
                problems.append(f"{p.relative_to(out)} holds the path {s!r}")
        for ts in timestamp_like(text):
            problems.append(f"{p.relative_to(out)} holds a timestamp-like {ts!r}")
    return problems


@pytest.mark.parametrize("layout", ["ct-mxfp4", "modelopt-nvfp4"])
def test_deterministic_output(layout: str, work: Path, big: Big) -> None:
    """Two converts of one input (into differently named folders) give byte-identical trees, and no
    output file holds an absolute path or a timestamp."""
    if layout == "ct-mxfp4":
        src, a, b = big.src, big.ref, big.second
        procs = [big.second_proc]
    else:  # the requantizing path (float math, threads) is where nondeterminism would hide
        src = tiny.build(layout, work / "det-nv" / "src")
        a, b = work / "det-nv" / "out-a", work / "det-nv" / "out-b"
        with ThreadPoolExecutor(2) as pool:
            procs = list(pool.map(lambda d: run_cli("convert", src, d, *OPTS), [a, b]))
    for proc in procs:
        assert proc.returncode == 0, proc.stderr
    ha, hb = file_hashes(a), file_hashes(b)
    assert ha == hb, f"outputs differ: {sorted(k for k in ha.keys() | hb.keys() if ha.get(k) != hb.get(k))}"
    found = _scan(a, [str(src), str(a), str(b)]) + _scan(b, [str(src), str(a), str(b)])
    assert not found, "\n".join(found)
