"""Unpack a ``make gpu-bundle`` folder into a site folder that a GPU machine's python3 can import vLLM from.

    python -m tests.gpu_serving.unpack BUNDLE SITE

The site tarball and the mxfp4conv wheel are extracted, the two stable-ABI libraries decompressed
(two threads) beside vLLM's Python and checked against the bundle's sha256, and one import made
soft: ``vllm/vllm_flash_attn/__init__.py`` raises ImportError when its own libraries are absent
(they are not in the bundle), and vLLM imports it on every CUDA start (layers/attention ->
mm_encoder_attention -> fa_utils) even with the Triton attention backend. A stamp with the bundle's
digest makes a second call with the same bundle a no-op. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

LIBS = ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so")
FLASH_ATTN_RAISE = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def unpack(bundle: Path, site: Path) -> Path:
    """``site``, holding vLLM 0.33 and mxfp4conv as the bundle describes them."""
    manifest = json.loads((bundle / "bundle.json").read_text())
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    stamp = site / ".mxfp4conv-bundle"
    if stamp.exists() and stamp.read_text() == digest:
        return site
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    errors: list[str] = []

    def lib(name: str) -> None:
        with lzma.open(bundle / f"{name}.xz") as src, open(site / "vllm" / name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if _sha256(site / "vllm" / name) != manifest["libs_sha256"][name]:
            errors.append(f"{name}: sha256 differs from bundle.json")

    with tarfile.open(bundle / "site.tar.xz") as t:
        t.extractall(site, filter="data")
    threads = [threading.Thread(target=lib, args=(n,)) for n in LIBS]
    for th in threads:
        th.start()
    with zipfile.ZipFile(bundle / manifest["mxfp4conv_wheel"]) as z:
        z.extractall(site)
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    fa = site / "vllm" / "vllm_flash_attn" / "__init__.py"
    text = fa.read_text()
    if FLASH_ATTN_RAISE not in text:
        raise RuntimeError(f"{fa}: the ImportError this unpacker makes soft is not there (another vLLM?)")
    fa.write_text(text.replace(FLASH_ATTN_RAISE, "if False:  # mxfp4conv bundle: no flash-attention libraries\n"
                                                 "    raise ImportError("))
    stamp.write_text(digest)
    return site


def main() -> int:
    bundle, site = Path(sys.argv[1]), Path(sys.argv[2])
    print(unpack(bundle, site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
