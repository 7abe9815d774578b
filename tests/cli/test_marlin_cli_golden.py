"""The golden vectors of vLLM 0.33's Marlin preparation, reproduced through `mxfp4conv convert --to marlin`.

Tiny checkpoints are built around the golden inputs (`in.*`): MXFP4 MoE experts (split
compressed-tensors names, gate rows then up rows), GPT-OSS native fused experts (interleaved rows)
and dense MXFP4 Linears (incl. the unaligned N=96 case vLLM zero-pads). The converted rank-0 shard
must hold exactly the golden outputs (`out.*`), compared as raw bytes. The FP8-activation and
NVFP4-kept-as-NVFP4 cases have no CLI path in this release; tests/formats/test_marlin_golden.py
covers them at the function level.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mxfp4conv.cli import cli
from tests.builders import build

GOLDEN = Path(__file__).parents[1] / "data" / "golden_marlin"
DENSE_CASES = ["dense_mxfp4_n128_k256_bias", "dense_mxfp4_n64_k512_nobias", "dense_mxfp4_padded_n96_k192"]


def golden(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / f"{name}.safetensors"))


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def rewrite(src: Path, drop_prefix: str, add: dict[str, torch.Tensor]) -> None:
    """Replace the tensors under ``drop_prefix`` in a single-shard checkpoint by ``add``."""
    shard = src / "model.safetensors"
    t = {k: v for k, v in load_file(str(shard)).items() if not k.startswith(drop_prefix)}
    t.update(add)
    save_file(t, str(shard), metadata={"format": "pt"})


def convert(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    res = CliRunner().invoke(cli, ["convert", str(src), str(dst), "--to", "marlin", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["verify"]["ok"]
    out = {}
    with safe_open(str(dst / "rank-0" / "model.safetensors"), "pt") as fh:
        meta = fh.metadata()
        for k in fh.keys():  # noqa: SIM118
            out[k] = fh.get_tensor(k)
    assert meta["mxfp4conv.format"] == "marlin-fp4" and meta["mxfp4conv.marlin_layout"] == "v2"
    assert meta["mxfp4conv.tp_size"] == "1" and meta["mxfp4conv.tp_rank"] == "0"
    return out


def test_moe_mxfp4_and_dense_cases(tmp_path: Path) -> None:
    g = golden("moe_mxfp4_e2_h128_i64_bias")
    e, h, i = 2, 128, 64
    src = build("ct-mxfp4", tmp_path / "src", layers=1, experts=e, hidden=h, inter=i, shards=1)
    add: dict[str, torch.Tensor] = {}
    p = "model.layers.0.mlp.experts"
    for x in range(e):
        for proj, rows, w, s, b in (("gate_proj", slice(0, i), "w13_weight", "w13_weight_scale", "w13_bias"),
                                    ("up_proj", slice(i, 2 * i), "w13_weight", "w13_weight_scale", "w13_bias"),
                                    ("down_proj", slice(None), "w2_weight", "w2_weight_scale", "w2_bias")):
            add[f"{p}.{x}.{proj}.weight_packed"] = g[f"in.{w}"][x, rows].clone()
            add[f"{p}.{x}.{proj}.weight_scale"] = g[f"in.{s}"][x, rows].clone()
            add[f"{p}.{x}.{proj}.bias"] = g[f"in.{b}"][x, rows].clone()
    for n, case in enumerate(DENSE_CASES):
        d = golden(case)
        m = f"model.layers.0.golden{n}.proj"
        add[f"{m}.weight_packed"], add[f"{m}.weight_scale"] = d["in.weight"], d["in.weight_scale"]
        if "in.bias" in d:
            add[f"{m}.bias"] = d["in.bias"]
    rewrite(src, p, add)
    out = convert(src, tmp_path / "dst")
    for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias"):
        assert out[f"{p}.{name}"].dtype == g[f"out.{name}"].dtype, name
        assert raw(out[f"{p}.{name}"]) == raw(g[f"out.{name}"]), name
    for n, case in enumerate(DENSE_CASES):
        d = golden(case)
        m = f"model.layers.0.golden{n}.proj"
        for name in ("weight", "weight_scale", "bias"):
            if f"out.{name}" in d:
                assert out[f"{m}.{name}"].shape == d[f"out.{name}"].shape, (case, name)
                assert raw(out[f"{m}.{name}"]) == raw(d[f"out.{name}"]), (case, name)


def test_gpt_oss_case(tmp_path: Path) -> None:
    g = golden("gptoss_moe_mxfp4_e2_h256_i128_bias")
    e, h, i = 2, 256, 128
    src = build("gpt-oss", tmp_path / "src", layers=1, experts=e, hidden=h, inter=i, shards=1)
    p = "model.layers.0.mlp.experts"
    rewrite(src, p + ".", {
        f"{p}.gate_up_proj_blocks": g["in.w13_weight"].reshape(e, 2 * i, h // 32, 16).clone(),
        f"{p}.gate_up_proj_scales": g["in.w13_weight_scale"].clone(),
        f"{p}.gate_up_proj_bias": g["in.w13_bias"].clone(),
        f"{p}.down_proj_blocks": g["in.w2_weight"].reshape(e, h, i // 32, 16).clone(),
        f"{p}.down_proj_scales": g["in.w2_weight_scale"].clone(),
        f"{p}.down_proj_bias": g["in.w2_bias"].clone(),
    })
    out = convert(src, tmp_path / "dst")
    for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias"):
        assert raw(out[f"{p}.{name}"]) == raw(g[f"out.{name}"]), name


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_decode_back(tmp_path: Path, tp: int) -> None:
    """Every rank verifies against its slice of the source, and the slices tile the whole layer."""
    src = build("ct-mxfp4", tmp_path / "src", layers=1, experts=2, hidden=128, inter=256, shards=1)
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "dst"), "--to", "marlin", "--tp-size", str(tp),
                                   "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["verify"]["ok"] and doc["verify"]["units"] == tp * (doc["fused_layers"] + doc["passthrough"])
    assert [s["file"] for s in doc["shards"]] == [f"rank-{r}/model.safetensors" for r in range(tp)]
    from mxfp4conv.formats.marlin import unrepack_fp4_weight

    s = load_file(str(src / "model.safetensors"))
    p = "model.layers.0.mlp.experts"
    down = []
    for r in range(tp):
        out = load_file(str(tmp_path / "dst" / f"rank-{r}" / "model.safetensors"))
        down.append(unrepack_fp4_weight(out[f"{p}.w2_weight"], 128, 256 // tp))
    whole = torch.cat(down, dim=-1)
    for x in range(2):
        assert torch.equal(whole[x], s[f"{p}.{x}.down_proj.weight_packed"])
    res = CliRunner().invoke(cli, ["verify", str(src), str(tmp_path / "dst")])
    assert res.exit_code == 0, res.stderr


def test_nvfp4_kept_as_nvfp4(tmp_path: Path) -> None:
    """`--keep-nvfp4` on a ModelOpt checkpoint built around the NVFP4 golden inputs (MoE + two dense)."""
    g = golden("moe_nvfp4_e2_h256_i128")
    e, h, i = 2, 256, 128
    src = build("modelopt-nvfp4", tmp_path / "src", layers=1, experts=e, hidden=h, inter=i, shards=1)
    p = "model.layers.0.mlp.experts"
    add: dict[str, torch.Tensor] = {}
    for x in range(e):
        for proj, rows, w in (("gate_proj", slice(0, i), "w13"), ("up_proj", slice(i, 2 * i), "w13"),
                              ("down_proj", slice(None), "w2")):
            m = f"{p}.{x}.{proj}"
            add[f"{m}.weight"] = g[f"in.{w}_weight"][x, rows].clone()
            add[f"{m}.weight_scale"] = g[f"in.{w}_weight_scale"][x, rows].clone()
            add[f"{m}.weight_scale_2"] = g[f"in.{w}_weight_scale_2"][x].clone()
            add[f"{m}.input_scale"] = torch.tensor(0.01, dtype=torch.float32)
    cases = ["dense_nvfp4_n256_k128", "dense_nvfp4_rescaled_n128_k256"]
    for n, case in enumerate(cases):
        d = golden(case)
        m = f"model.layers.0.golden{n}.proj"
        add[f"{m}.weight"], add[f"{m}.weight_scale"] = d["in.weight"], d["in.weight_scale"]
        add[f"{m}.weight_scale_2"] = d["in.weight_global_scale"]
    rewrite(src, p, add)
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "dst"), "--to", "marlin", "--keep-nvfp4",
                                   "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["verify"]["ok"]
    out = load_file(str(tmp_path / "dst" / "rank-0" / "model.safetensors"))
    for name in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                 "w2_weight_scale_2"):
        assert out[f"{p}.{name}"].dtype == g[f"out.{name}"].dtype, name
        assert raw(out[f"{p}.{name}"]) == raw(g[f"out.{name}"]), name
    for n, case in enumerate(cases):
        d = golden(case)
        m = f"model.layers.0.golden{n}.proj"
        for name in ("weight", "weight_scale", "weight_global_scale"):
            assert raw(out[f"{m}.{name}"]) == raw(d[f"out.{name}"]), (case, name)
    # a flipped scale byte is caught by verify (re-encoding comparison)
    shard = tmp_path / "dst" / "rank-0" / "model.safetensors"
    blob = bytearray(shard.read_bytes())
    hn = int.from_bytes(blob[:8], "little")
    b0, _ = json.loads(blob[8:8 + hn])[f"{p}.w2_weight_scale"]["data_offsets"]
    blob[8 + hn + b0] ^= 0x08
    shard.write_bytes(bytes(blob))
    res = CliRunner().invoke(cli, ["verify", str(src), str(tmp_path / "dst"), "--device", "cpu"])
    assert res.exit_code == 3


def test_fp8_activation_variant(tmp_path: Path) -> None:
    """`--marlin-act fp8`: vLLM's W4A8 tiling, single scale permutation, E8M0 bytes +6 (dense golden case)."""
    d = golden("dense_mxfp4_fp8act_n128_k256")
    src = build("ct-mxfp4", tmp_path / "src", layers=1, experts=2, hidden=128, inter=128, shards=1)
    m = "model.layers.0.golden.proj"
    rewrite(src, m, {f"{m}.weight_packed": d["in.weight"], f"{m}.weight_scale": d["in.weight_scale"],
                     f"{m}.bias": d["in.bias"]})
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "dst"), "--to", "marlin", "--marlin-act", "fp8",
                                   "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["verify"]["ok"]  # MoE and dense decoded back through the a8 inverse
    with safe_open(str(tmp_path / "dst" / "rank-0" / "model.safetensors"), "pt") as fh:
        assert fh.metadata()["mxfp4conv.act_dtype"] == "fp8_e4m3"
        for name in ("weight", "weight_scale", "bias"):
            assert raw(fh.get_tensor(f"{m}.{name}")) == raw(d[f"out.{name}"]), name
