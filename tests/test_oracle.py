"""The independent oracle (tests/oracle.py) against the producers' own dequantization, and the
conversion of every examples/tiny.py layout against it: what the proof cannot see, because it reads
the source with the same layout code as the conversion. tests/cli/test_real_families.py runs the same
comparison over every replica family (including quark-mxfp4, quark-nvfp4 and deepseek-v4-mxfp4)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from mxfp4conv.cli import cli
from tests.oracle import E4M3, MX, NV, compare, output_fp4, requantize, source_fp4

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny.py"


def _tiny_build() -> Callable[..., None]:
    spec = importlib.util.spec_from_file_location("tiny_oracle", TINY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("oracle-src")
    build = _tiny_build()
    built: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in built:
            build(layout, root / layout)
            built[layout] = root / layout
        return built[layout]

    return get


def convert(src: Path, dst: Path, target: str, *extra: str) -> None:
    res = CliRunner().invoke(cli, ["convert", str(src), str(dst), "--to", target, "--device", "cpu", *extra])
    assert res.exit_code == 0, res.stderr or res.output


# the oracle against the producers ----------------------------------------------------------------
def test_e4m3_table_is_torchs_float8_e4m3fn() -> None:
    t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(t), np.isnan(E4M3))
    assert np.array_equal(t[~np.isnan(t)], E4M3[~np.isnan(E4M3)])


@pytest.mark.parametrize("layout", ["ct-mxfp4", "ct-nvfp4"])
def test_oracle_reads_compressed_tensors_as_its_own_dequantizer(tiny: Callable[[str], Path], layout: str) -> None:
    """compressed-tensors' unpacking and ``dequantize`` (its scheme presets, float32) give the oracle's
    values: exactly for MXFP4, within one float32 rounding for NVFP4 (it divides the block scale by
    the global scale before multiplying; NUMERICS.md's order multiplies first)."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    src = tiny(layout)
    mine = source_fp4(src)
    args = preset_name_to_scheme("MXFP4A16" if layout == "ct-mxfp4" else "NVFP4A16", ["Linear"]).weights
    checked = 0
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118
                if not k.endswith(".weight_packed"):
                    continue
                module = k.removesuffix(".weight_packed")
                packed = fh.get_tensor(k)
                scale = _tensor(src, f"{module}.weight_scale")
                unpacked = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
                if layout == "ct-mxfp4":
                    theirs = dequantize(unpacked, decompress_mx_scale(scale).float(), args=args, dtype=torch.float32)
                    mx = mine[module]
                    assert isinstance(mx, MX)
                    assert np.array_equal(theirs.double().numpy(), mx.values()), module
                else:
                    gs = _tensor(src, f"{module}.weight_global_scale")
                    theirs = dequantize(unpacked, scale.float(), args=args, dtype=torch.float32, global_scale=gs)
                    ours = mine[module]
                    assert isinstance(ours, NV)
                    np.testing.assert_allclose(theirs.numpy(), ours.values, rtol=2.0**-22, atol=0, err_msg=module)
                checked += 1
    assert checked == len(mine) > 0


def _tensor(folder: Path, name: str) -> torch.Tensor:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / index[name]), "pt") as fh:
        return fh.get_tensor(name)


def test_oracle_reads_gpt_oss_as_transformers_does(tiny: Callable[[str], Path]) -> None:
    """transformers' own GPT-OSS MXFP4 dequantization (``convert_moe_packed_tensors``, [E, K, rows]
    with gate and up interleaved) gives the oracle's per-expert gate, up and down values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = tiny("gpt-oss")
    mine = {m: w.values() for m, w in source_fp4(src).items() if isinstance(w, MX)}
    prefix = "model.layers.0.mlp.experts"
    for proj in ("gate_up_proj", "down_proj"):
        w = convert_moe_packed_tensors(_tensor(src, f"{prefix}.{proj}_blocks"), _tensor(src, f"{prefix}.{proj}_scales"),
                                       dtype=torch.float32).transpose(1, 2).double().numpy()
        for e in range(w.shape[0]):
            if proj == "gate_up_proj":
                assert np.array_equal(w[e, 0::2], mine[f"{prefix}.{e}.gate_proj"])
                assert np.array_equal(w[e, 1::2], mine[f"{prefix}.{e}.up_proj"])
            else:
                assert np.array_equal(w[e], mine[f"{prefix}.{e}.down_proj"])


def test_requantize_model_by_hand() -> None:
    """The float64 MSE model on blocks whose answer is worked out by hand."""
    x = np.zeros((1, 64), dtype=np.float32)
    x[0, :32] = 6.0  # RCEIL 0 exactly; one binade lower every 6 would clip to 3 * 2: RCEIL
    x[0, 32] = 3.2  # RCEIL 0 (3 < 3.2 <= 6); 3.2 -> 3 at 0, 6.4 -> 6 (3) at -1: error 0.2 either way
    x[0, 33:64] = 0.7  # 0.7 -> 0.5 at 0 (error 0.2), 1.4 -> 1.5 (0.75) at -1 (0.05): the lower binade wins
    mx = requantize(x)
    assert mx.exps.tolist() == [[127, 126]]
    assert mx.codes[0, 0] == 7 and mx.codes[0, 32] == 7 and mx.codes[0, 33] == 3  # 6, 6 * 0.5, 1.5 * 0.5
    neg = requantize(np.full((1, 32), -0.0, dtype=np.float32))
    assert neg.exps.tolist() == [[127]] and bool((neg.codes == 8).all())  # a zero block: 2^0, signs kept


# conversions against the oracle ------------------------------------------------------------------
CASES = [("ct-mxfp4", "ct"), ("ct-mxfp4", "quark"), ("ct-nvfp4", "ct"), ("ct-nvfp4", "quark"),
         ("modelopt-nvfp4", "ct"), ("modelopt-nvfp4", "quark"), ("gpt-oss", "quark"), ("gpt-oss", "gpt-oss")]


@pytest.mark.parametrize(("layout", "target"), CASES)
def test_conversion_holds_the_values_the_source_means(tiny: Callable[[str], Path], tmp_path: Path,
                                                     layout: str, target: str) -> None:
    src = tiny(layout)
    convert(src, tmp_path / "out", target)
    want, got = source_fp4(src), output_fp4(tmp_path / "out")
    assert len(want) == 24
    problems = compare(want, got)
    assert not problems, "\n".join(problems)


def _edit_global_scales(src: Path, dst: Path, how: str) -> int:
    """A copy of ``src`` whose NVFP4 second-level scales are inverted or 1.0: converting it with a
    correct reader gives what a reader that misapplies the original's scale would."""
    shutil.copytree(src, dst)
    changed = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            t = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
            meta = fh.metadata()
        for k in t:
            if k.endswith((".weight_scale_2", ".weight_global_scale")):
                t[k] = 1.0 / t[k] if how == "inverted" else torch.ones_like(t[k])
                changed += 1
        save_file(t, str(f), metadata=meta)
    return changed


@pytest.mark.parametrize("layout", ["modelopt-nvfp4", "ct-nvfp4"])
@pytest.mark.parametrize("how", ["inverted", "one"])
def test_a_misapplied_global_scale_is_caught(tiny: Callable[[str], Path], tmp_path: Path, layout: str,
                                            how: str) -> None:
    """A source whose global scale is inverted (a multiplier read as a divisor) or read as 1.0
    converts and passes ``verify``, which reads it with the same code, but the oracle sees every
    expert's scales moved by many binades."""
    src = tiny(layout)
    bad = tmp_path / "bad-src"
    assert _edit_global_scales(src, bad, how) == 24
    convert(bad, tmp_path / "out", "ct")
    res = CliRunner().invoke(cli, ["verify", str(bad), str(tmp_path / "out"), "--device", "cpu"])
    assert res.exit_code == 0, res.output  # the proof's blind spot: it compares with the same reading
    problems = compare(source_fp4(src), output_fp4(tmp_path / "out"), limit=100)
    assert len(problems) == 24 and all("binades" in p for p in problems), "\n".join(problems)
