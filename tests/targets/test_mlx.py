"""mxfp4conv/targets/mlx.py: mlx-lm's MXFP4 layout (stacked switch_mlp experts, uint32 words, E8M0 scales),
its config, the tensors it does not write, and refusals. MLX itself runs the outputs in tests/mlx_runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from mxfp4conv.cli import cli
from mxfp4conv.model.canonical import DenseFP4, FP4Weight, ModelFacts, MoELayer, Passthrough, UnitSpec
from mxfp4conv.model.precision import Fp8Linear, PrecisionModel
from mxfp4conv.targets import WriterContext, get_target
from mxfp4conv.targets.base import TargetOptions
from mxfp4conv.targets.mlx import KEEP_NVFP4_REFUSAL, QUANTIZATION
from tests.targets.helpers import context

MLX = get_target("mlx")


def _ctx(model_type: str, units: list[UnitSpec], precision: PrecisionModel | None = None,
         options: TargetOptions | None = None, pt: dict[str, tuple[str, tuple[int, ...]]] | None = None) -> WriterContext:
    facts = ModelFacts(model_type, "X", "w4a16", "mxfp4", 2, 4, 64, 32)
    return WriterContext(facts, "ct-mxfp4", units, pt or {}, options or TargetOptions(), precision or PrecisionModel())


def test_the_uint32_words_are_the_ocp_bytes() -> None:
    """MLX reads 8 codes per little-endian uint32, element 0 in the low nibble: OCP bytes 0x21 0x43 0x65 0x87
    (elements 1, 2, ..., 8) are the word 0x87654321."""
    packed = torch.tensor([[0x21, 0x43, 0x65, 0x87]], dtype=torch.uint8)
    spec = UnitSpec("dense", "m", (), (1, 8))
    words, _ = MLX.encode(DenseFP4("m", FP4Weight("mxfp4", packed, torch.tensor([[127]], dtype=torch.uint8))),
                          spec, _ctx("qwen3_moe", [spec]))
    assert words.dtype == torch.uint32 and words.shape == (1, 1)
    assert int(words.view(torch.int32).item()) == 0x87654321 - (1 << 32)


@pytest.mark.parametrize(("model_type", "key", "where"), [
    ("qwen3_moe", "model.layers.0.mlp.experts", "model.layers.0.mlp.switch_mlp"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts", "model.layers.0.block_sparse_moe.switch_mlp"),
    ("gpt_oss", "model.layers.0.mlp.experts", "model.layers.0.mlp.experts"),
])
def test_experts_are_stacked_where_mlx_lm_holds_them(model_type: str, key: str, where: str) -> None:
    spec = UnitSpec("moe", key, (), (4, 64, 32), model_type == "gpt_oss", {"bias_dtype": "BF16"})
    outs = MLX.out_specs(spec, _ctx(model_type, [spec]))
    want: list[tuple[str, str, tuple[int, ...]]] = []
    for proj, n, k in (("gate_proj", 32, 64), ("up_proj", 32, 64), ("down_proj", 64, 32)):
        want += [(f"{where}.{proj}.weight", "U32", (4, n, k // 8)), (f"{where}.{proj}.scales", "U8", (4, n, k // 32))]
        if model_type == "gpt_oss":
            want.append((f"{where}.{proj}.bias", "BF16", (4, n)))
    assert [tuple(o) for o in outs] == want


def test_a_moe_unit_decodes_to_its_bytes() -> None:
    g = torch.Generator().manual_seed(0)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)

    spec = UnitSpec("moe", "model.layers.0.mlp.experts", (), (4, 64, 32), True, {"bias_dtype": "BF16"})
    ctx = _ctx("gpt_oss", [spec])
    unit = MoELayer(spec.key, FP4Weight("mxfp4", u8(4, 64, 32), u8(4, 64, 2)), FP4Weight("mxfp4", u8(4, 64, 16), u8(4, 64, 1)),
                    torch.randn(4, 64, generator=g).bfloat16(), torch.randn(4, 64, generator=g).bfloat16())
    written = dict(zip([o.name for o in MLX.out_specs(spec, ctx)], MLX.encode(unit, spec, ctx), strict=True))
    got = MLX.decode(spec, ctx, lambda n: written[n].contiguous())
    assert isinstance(got, MoELayer)
    for a, b in ((got.w13.packed, unit.w13.packed), (got.w13.scales, unit.w13.scales), (got.w2.packed, unit.w2.packed),
                 (got.w13_bias, unit.w13_bias), (got.w2_bias, unit.w2_bias)):
        assert a is not None and b is not None and torch.equal(a, b)
    gate = written["model.layers.0.mlp.experts.gate_proj.weight"]
    assert torch.equal(gate.view(torch.uint8), unit.w13.packed[:, :32])  # gate rows first, as bytes


def test_config_is_mlx_s_quantization_over_the_source_s(ct_mxfp4: Path) -> None:
    ctx, cfg = context(ct_mxfp4)
    out = MLX.config(cfg, ctx)
    assert out["quantization"] == out["quantization_config"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert list(out) == sorted(out)
    assert {k: v for k, v in out.items() if k not in ("quantization", "quantization_config")} == {
        **{k: v for k, v in cfg.items() if k != "quantization_config"}, "rope_scaling": None}


def test_a_transformers_5_config_gets_the_keys_mlx_lm_reads() -> None:
    src: dict[str, object] = {"model_type": "qwen3_moe", "num_local_experts": 8,
                              "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}
    out = MLX.config(src, _ctx("qwen3_moe", []))
    assert out["num_experts"] == 8 and out["rope_theta"] == 1e6
    assert out["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0}
    assert QUANTIZATION == {"group_size": 32, "bits": 4, "mode": "mxfp4"}


def test_an_fp8_kv_cache_s_scales_are_not_written() -> None:
    spec = UnitSpec("passthrough", "model.layers.0.self_attn.k_proj.k_scale", ("t",))
    ctx = _ctx("qwen3_moe", [spec], PrecisionModel(kv_cache="fp8"), pt={spec.key: ("F32", ())})
    assert MLX.out_specs(spec, ctx) == []
    assert MLX.encode(Passthrough(spec.key, torch.tensor(0.5)), spec, ctx) == []
    assert MLX.verify_unit(Passthrough(spec.key, torch.tensor(0.5)), spec, ctx, lambda n: torch.zeros(())) == []
    plain = _ctx("qwen3_moe", [spec], pt={spec.key: ("F32", ())})
    assert [o.name for o in MLX.out_specs(spec, plain)] == [spec.key]


def test_deepseek_s_mtp_layer_is_not_written() -> None:
    """mlx-lm's deepseek_v3 builds num_hidden_layers (here 2) decoder layers and drops the MTP layer."""
    mtp = UnitSpec("moe", "model.layers.2.mlp.experts", (), (4, 64, 32))
    norm = UnitSpec("passthrough", "model.layers.2.enorm.weight", ("t",))
    kept = UnitSpec("moe", "model.layers.1.mlp.experts", (), (4, 64, 32))
    ctx = _ctx("deepseek_v3", [mtp, norm, kept], pt={norm.key: ("BF16", (64,))})
    assert MLX.out_specs(mtp, ctx) == [] and MLX.out_specs(norm, ctx) == []
    assert len(MLX.out_specs(kept, ctx)) == 6
    assert [o.name for o in MLX.out_specs(norm, _ctx("qwen3_moe", [norm], pt=ctx.passthrough_dtypes))] == [norm.key]


def test_refusals() -> None:
    moe = UnitSpec("moe", "model.layers.0.mlp.experts", (), (4, 64, 32))
    assert MLX.refuse(_ctx("qwen3_moe", [moe])) is None
    why = MLX.refuse(_ctx("llama4", [moe]))
    assert why is not None and "not 'llama4'" in why and "qwen3_moe" in why and "deepseek_v3" in why
    assert MLX.refuse(_ctx("qwen3_moe", [moe], options=TargetOptions(keep_nvfp4=True))) == KEEP_NVFP4_REFUSAL
    o = "model.layers.0.self_attn.o_proj"
    fp8 = PrecisionModel(fp8={o: Fp8Linear(o, "fp8-block", "scale", "F8_E8M0")})
    assert MLX.refuse(_ctx("qwen3_moe", [moe], fp8)) == (
        f"{o}: fp8-block (scale F8_E8M0) has no exact MLX form (mlx-lm's FP8 is mxfp8: E8M0 scales per 32 inputs); "
        "--to ct or --to quark carry it")


def test_cli_inspect_convert_verify(ct_mxfp4: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["inspect", str(ct_mxfp4), "--json"])
    assert res.exit_code == 0 and "mlx" in json.loads(res.stdout)["targets"]
    dst = tmp_path / "out"
    res = runner.invoke(cli, ["convert", str(ct_mxfp4), str(dst), "--to", "mlx", "--device", "cpu"])
    assert res.exit_code == 0, res.stderr
    assert json.loads((dst / "config.json").read_text())["quantization"]["mode"] == "mxfp4"
    assert (dst / "tokenizer_config.json").exists()
    index = json.loads((dst / "model.safetensors.index.json").read_text())  # one shard: indexed, as mlx-lm writes it
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert runner.invoke(cli, ["verify", str(ct_mxfp4), str(dst)]).exit_code == 0
    from safetensors.torch import load_file, save_file

    t = load_file(str(dst / "model.safetensors"))
    name = "model.layers.1.mlp.switch_mlp.down_proj.scales"
    t[name] = t[name] + 1  # every down_proj weight of layer 1 doubled
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "mlx"})
    res = runner.invoke(cli, ["verify", str(ct_mxfp4), str(dst)])
    assert res.exit_code == 3 and "model.layers.1.mlp" in res.output + res.stderr


def test_keep_nvfp4_is_refused_for_mlx_at_planning(tmp_path: Path) -> None:
    from tests import builders

    src = builders.build("modelopt-nvfp4", tmp_path / "src", shards=1)
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "out"), "--to", "mlx", "--keep-nvfp4"])
    assert res.exit_code != 0 and "--keep-nvfp4: MLX's nvfp4" in res.stderr
    assert not (tmp_path / "out").exists()


def test_a_split_mxfp4_source_is_copied_expert_after_expert(ct_mxfp4: Path) -> None:
    """Stacked experts from a lossless source are source ranges one after the other (no decoding): expert
    e's tensor is row block e of the stacked one."""
    from mxfp4conv.plan.job import ConvertOptions, prepare
    from mxfp4conv.plan.shards import direct_runs

    job = prepare(ct_mxfp4, ConvertOptions(target="mlx"))
    moe = [u for _, s in job.output.shards() for u in s.units if u.spec.kind == "moe"]
    assert moe and all(u.direct is not None for u in moe)
    unit = moe[0]
    assert unit.direct is not None
    runs = direct_runs(unit.outs, unit.direct)
    assert [(o.name.rsplit(".", 2)[-2:], len(p)) for o, p in runs][:2] == [(["gate_proj", "weight"], 4),
                                                                          (["gate_proj", "scales"], 4)]
    e = f"{unit.key}.{{}}.gate_proj.weight_packed"
    assert [s.name for s in runs[0][1]] == [e.format(i) for i in range(4)]
    assert all(sum(s.length for s in p) == o.nbytes for o, p in runs)
