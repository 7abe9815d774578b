"""Prepare what the GPU serving test needs on a machine that cannot download: ``make gpu-bundle``.

    python -m tests.gpu_serving.bundle [--out .vllm-gpu] [--cache .vllm-gpu-cache]

Into ``--out`` (ignored by git; it travels with the working tree, 64 MiB at most):

* ``_C_stable_libtorch.abi3.so.xz``, ``_moe_C_stable_libtorch.abi3.so.xz``: vLLM 0.33.0's compiled
  ops. They are built against torch's stable ABI, so they load into another torch release (2.11 on
  the H200 machines). Their ELF images for GPU architectures other than sm_90 are zeroed in place
  (``fatbin.py``; sizes and offsets unchanged, every PTX kept): 92.6 + 45.7 MB compress to about
  26.5 + 12.9 MB instead of 63.7 + 38.0 MB;
* ``site.tar.xz``: vLLM's Python tree and dist-info (no compiled libraries but three tiny ones, no
  C++ headers, no ``vllm-rs`` binary, no flash-attention libraries: the test runs the Triton attention
  backend) and the pure-Python dependencies of the offline engine that such a machine lacks
  (``pins.txt``, wheels for CPython 3.12 on manylinux x86-64);
* ``mxfp4conv-*.whl``: this checkout as a wheel, with its ``vllm.general_plugins`` entry point;
* ``bundle.json``: every file's sha256 and size, the sha256 of the zeroed libraries and of the
  plugin's sources (the test refuses a bundle whose plugin differs from the checkout's).

Downloads and the zeroed libraries are kept in ``--cache`` (not sent anywhere).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from tests.gpu_serving.fatbin import zero_foreign

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VLLM = "0.33.0"
LIBS = ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so")
# the compiled libraries of vLLM's wheel that are small and imported on every start
SMALL_LIBS = ("fs_io_C.abi3.so", "cumem_allocator.abi3.so", "spinloop.abi3.so")
DROP_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")
DROP_PREFIXES = ("vllm/vllm-rs", "vllm/third_party/fmha_sm100/", "vllm/third_party/deep_gemm/include/")
# pip download for the GPU machine's python3 (CPython 3.12, glibc x86-64)
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
LIMIT = 60 * 1024 * 1024  # leaves room under 64 MiB for the checkout itself


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def plugin_digest(root: Path) -> str:
    """sha256 over the plugin's sources (names and bytes), as a wheel or a checkout holds them."""
    h = hashlib.sha256()
    for f in sorted((root / "mxfp4conv" / "vllm_plugin").glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def step(msg: str) -> None:
    print(f"[gpu-bundle {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def download(cache: Path) -> list[Path]:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(wheels),
           f"vllm=={VLLM}", "-r", str(HERE / "pins.txt")]
    subprocess.run(cmd, check=True)
    return sorted(wheels.glob("*.whl"))


def zeroed_libs(vllm_wheel: Path, cache: Path, out: Path) -> dict[str, str]:
    """Zero and xz the two stable-ABI libraries (cached by the wheel's sha256); sha256 of each zeroed .so."""
    key = sha256(vllm_wheel)[:16]
    d = cache / f"libs-{key}"
    d.mkdir(parents=True, exist_ok=True)
    digests: dict[str, str] = {}
    with zipfile.ZipFile(vllm_wheel) as z:
        for name in LIBS:
            xz, so = d / f"{name}.xz", d / name
            if not xz.exists():
                raw = d / f"{name}.orig"
                with z.open(f"vllm/{name}") as src, open(raw, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
                stats = zero_foreign(raw, so)
                raw.unlink()
                step(f"{name}: {stats}")
                (d / f"{name}.sha256").write_text(sha256(so))
                subprocess.run(["xz", "-T0", "-6", "-k", "-f", str(so)], check=True)
                so.unlink()
            digests[name] = (d / f"{name}.sha256").read_text().strip()
            shutil.copyfile(xz, out / xz.name)
    return digests


def keep(name: str) -> bool:
    """Whether a file of vLLM's wheel goes into the site tarball."""
    if name.startswith(DROP_PREFIXES):
        return False
    if name.endswith(DROP_SUFFIXES):
        return name.rsplit("/", 1)[-1] in SMALL_LIBS
    return True


def site_tarball(wheels: list[Path], cache: Path, out: Path) -> dict[str, int]:
    stage = cache / "site-stage"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    sizes: dict[str, int] = {}
    for whl in wheels:
        is_vllm = whl.name.startswith("vllm-")
        with zipfile.ZipFile(whl) as z:
            members = [m for m in z.infolist() if not m.is_dir() and (not is_vllm or keep(m.filename))]
            for m in members:
                z.extract(m, stage)
            sizes[whl.name] = sum(m.file_size for m in members)
    tar = out / "site.tar"
    with tarfile.open(tar, "w") as t:
        for p in sorted(stage.iterdir()):
            t.add(p, arcname=p.name)
    subprocess.run(["xz", "-T0", "-6", "-f", str(tar)], check=True)
    shutil.rmtree(stage)
    return sizes


def mxfp4conv_wheel(out: Path) -> Path:
    for old in out.glob("mxfp4conv-*.whl"):
        old.unlink()
    build = Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True, check=True).stdout.strip())
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                        str(out), str(ROOT)], check=True, cwd=build)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    (whl,) = out.glob("mxfp4conv-*.whl")
    with zipfile.ZipFile(whl) as z:
        eps = [n for n in z.namelist() if n.endswith("entry_points.txt")]
        if not eps or "vllm.general_plugins" not in z.read(eps[0]).decode():
            raise SystemExit(f"{whl.name}: no vllm.general_plugins entry point")
    return whl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".vllm-gpu")
    ap.add_argument("--cache", type=Path, default=ROOT / ".vllm-gpu-cache")
    ap.add_argument("--wheel-only", action="store_true", help="rebuild only the mxfp4conv wheel of an existing bundle")
    a = ap.parse_args()
    out, cache = a.out.resolve(), a.cache.resolve()
    if a.wheel_only and (out / "bundle.json").exists():
        doc = json.loads((out / "bundle.json").read_text())
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        step("pip download (vLLM and pins.txt, CPython 3.12 manylinux x86-64)")
        wheels = download(cache)
        (vllm_wheel,) = [w for w in wheels if w.name.startswith(f"vllm-{VLLM}-")]
        step(f"zero foreign GPU code in {', '.join(LIBS)}")
        lib_sha = zeroed_libs(vllm_wheel, cache, out)
        step("site tarball")
        doc = {"vllm": VLLM, "libs_sha256": lib_sha, "site_bytes_unpacked": site_tarball(wheels, cache, out)}
    step("mxfp4conv wheel")
    whl = mxfp4conv_wheel(out)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(out.iterdir())
             if p.name != "bundle.json"}
    doc.update(files=files, mxfp4conv_wheel=whl.name, plugin_sha256=plugin_digest(ROOT))
    (out / "bundle.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
    total = sum(f["bytes"] for f in files.values())
    for name, f in files.items():
        step(f"  {name}: {f['bytes'] / 1e6:.1f} MB")
    step(f"{out}: {total / 1e6:.1f} MB")
    if total > LIMIT:
        raise SystemExit(f"{out} holds {total / 1e6:.1f} MB, more than {LIMIT / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
