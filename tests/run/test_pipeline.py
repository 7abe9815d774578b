"""End-to-end: inspect, convert, verify on the builders' checkpoints, through the public CLI."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from mxfp4conv.cli import cli
from mxfp4conv.run import conversion, pipeline
from tests.builders import build

LAYOUTS = ["ct-mxfp4", "gpt-oss", "modelopt-nvfp4", "ct-nvfp4"]


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.stdout, res.stderr


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[k] = fh.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {layout: build(layout, root / layout, shards=3) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_json(srcs: dict[str, Path], layout: str) -> None:
    code, out, _ = run("inspect", str(srcs[layout]), "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["layout"] == layout
    assert doc["schema_version"] == 1
    assert doc["model_type"] == ("gpt_oss" if layout == "gpt-oss" else "qwen3_moe")
    assert (doc["num_layers"], doc["num_moe_layers"], doc["num_experts"]) == (2, 2, 4)
    assert (doc["hidden_size"], doc["intermediate_size"]) == (64, 32)
    assert doc["scheme"] == ("w4a4" if layout == "modelopt-nvfp4" else "w4a16")
    assert doc["problems"] == []
    assert len(doc["files"]) == 3
    # H=64, I=32 experts fail Marlin's tile rules (only GPT-OSS, which vLLM pads, can go to marlin)
    expected = {"gpt-oss": {"gpt-oss", "quark", "marlin", "mlx"}}.get(layout, {"ct", "quark", "mlx"})
    assert set(doc["targets"]) == expected
    assert doc["total_bytes"] == sum(p.stat().st_size for p in srcs[layout].glob("*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in srcs[layout].glob("*.safetensors"))


def test_ct_roundtrip_is_byte_identical(srcs: dict[str, Path], tmp_path: Path) -> None:
    """ct -> canonical -> ct: every tensor keeps its name and bytes."""
    code, _, err = run("convert", str(srcs["ct-mxfp4"]), str(tmp_path / "out"), "--to", "ct")
    assert code == 0, err
    a, b = tensors(srcs["ct-mxfp4"]), tensors(tmp_path / "out")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    cfg_a = json.loads((srcs["ct-mxfp4"] / "config.json").read_text())
    cfg_b = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg_a == cfg_b


def test_gpt_oss_roundtrip_is_byte_identical(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = run("convert", str(srcs["gpt-oss"]), str(tmp_path / "out"))  # auto -> gpt-oss
    assert code == 0, err
    a, b = tensors(srcs["gpt-oss"]), tensors(tmp_path / "out")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_gpt_oss_to_quark_interleaves_per_expert(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = run("convert", str(srcs["gpt-oss"]), str(tmp_path / "q"), "--to", "quark")
    assert code == 0, err
    a, b = tensors(srcs["gpt-oss"]), tensors(tmp_path / "q")
    p = "model.layers.1.mlp.experts"
    blocks = a[f"{p}.gate_up_proj_blocks"]
    for e in range(4):
        assert torch.equal(b[f"{p}.{e}.w13_weight"], blocks[e].reshape(64, 32)), e  # rows stay interleaved
        assert torch.equal(b[f"{p}.{e}.w13_weight_scale"], a[f"{p}.gate_up_proj_scales"][e])
        assert torch.equal(b[f"{p}.{e}.w2_bias"].view(torch.int16), a[f"{p}.down_proj_bias"][e].view(torch.int16))
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "quark"
    assert cfg["global_quant_config"]["weight"]["scale_format"] == "e8m0"


def test_ct_to_quark_renames(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = run("convert", str(srcs["ct-mxfp4"]), str(tmp_path / "q"), "--to", "quark")
    assert code == 0, err
    a, b = tensors(srcs["ct-mxfp4"]), tensors(tmp_path / "q")
    m = "model.layers.0.mlp.experts.3.down_proj"
    assert torch.equal(b[f"{m}.weight"], a[f"{m}.weight_packed"])
    assert torch.equal(b[f"{m}.weight_scale"], a[f"{m}.weight_scale"])
    assert not any(k.endswith("weight_packed") for k in b)
    excl = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["exclude"]
    # the source's ignore patterns keep their meaning (vLLM: exact name or re: + re.match)
    excluded = [m for m in ("lm_head", "model.layers.0.mlp.gate", "model.layers.1.self_attn.q_proj",
                            "model.layers.0.mlp.experts.0.gate_proj")
                if any(re.match(p[3:], m) if p.startswith("re:") else p == m for p in excl)]
    assert excluded == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.self_attn.q_proj"], excl


@pytest.mark.parametrize(("layout", "target", "why"), [
    ("gpt-oss", "ct", "GPT-OSS loader"),
    ("ct-mxfp4", "gpt-oss", "model_type gpt_oss"),
])
def test_nonsense_pairs_refused(srcs: dict[str, Path], tmp_path: Path, layout: str, target: str, why: str) -> None:
    code, _, err = run("convert", str(srcs[layout]), str(tmp_path / "o"), "--to", target)
    assert code == 1
    assert why in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_dry_run_writes_nothing(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, out, _ = run("convert", str(srcs["ct-mxfp4"]), str(tmp_path / "o"), "--dry-run", "--json",
                       "--max-shard-size", "40KB")
    assert code == 0
    doc = json.loads(out)
    assert doc["status"] == "dry-run" and len(doc["shards"]) > 1
    assert doc["fused_layers"] == 2 and doc["passthrough"] > 0
    assert list(tmp_path.iterdir()) == []


def test_sharding_and_index(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, out, _ = run("convert", str(srcs["ct-mxfp4"]), str(tmp_path / "o"), "--max-shard-size", "40KB", "--json")
    assert code == 0
    doc = json.loads(out)
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(s["file"] for s in doc["shards"]) and len(files) > 1
    assert all(s["bytes"] <= 40_000 or s["units"] == 1 for s in doc["shards"])
    assert set(index["weight_map"]) == set(tensors(tmp_path / "o"))
    manifest = json.loads((tmp_path / "o" / "mxfp4conv.json").read_text())
    assert set(manifest["outputs"]) == {p.name for p in (tmp_path / "o").iterdir()} - {"mxfp4conv.json"}
    for name, digest in manifest["outputs"].items():
        assert hashlib.sha256((tmp_path / "o" / name).read_bytes()).hexdigest() == digest
    assert (tmp_path / "o" / "tokenizer_config.json").exists() and (tmp_path / "o" / "generation_config.json").exists()


def test_reruns_are_byte_identical_and_skip_if_current(srcs: dict[str, Path], tmp_path: Path) -> None:
    for name in ("a", "b"):
        assert run("convert", str(srcs["modelopt-nvfp4"]), str(tmp_path / name), "--to", "ct", "--device", "cpu")[0] == 0
    ha, hb = tree_hashes(tmp_path / "a"), tree_hashes(tmp_path / "b")
    assert ha == hb
    for p in (tmp_path / "a").rglob("*"):
        assert str(tmp_path).encode() not in p.read_bytes(), p  # no absolute paths inside outputs
    code, out, _ = run("convert", str(srcs["modelopt-nvfp4"]), str(tmp_path / "a"), "--to", "ct", "--device", "cpu",
                       "--skip-if-current", "--json")
    assert code == 0 and json.loads(out)["status"] == "skipped"
    code, out, _ = run("convert", str(srcs["modelopt-nvfp4"]), str(tmp_path / "a"), "--to", "ct", "--device", "cpu",
                       "--scale-rule", "even", "--skip-if-current", "--json")
    assert code == 0 and json.loads(out)["status"] == "converted"  # options changed: redone
    # an output of an earlier numerics contract (its fingerprint has no "numerics", or another one)
    # is not current either; a lossless conversion's fingerprint has no "numerics" at all
    man_path = tmp_path / "a" / "mxfp4conv.json"
    man = json.loads(man_path.read_text())
    assert man["fingerprint"]["numerics"] == pipeline.REQUANT_NUMERICS
    for old in (None, pipeline.REQUANT_NUMERICS - 1):
        fp = {k: v for k, v in man["fingerprint"].items() if k != "numerics"}
        man_path.write_text(json.dumps({**man, "fingerprint": fp if old is None else {**fp, "numerics": old}}))
        code, out, _ = run("convert", str(srcs["modelopt-nvfp4"]), str(tmp_path / "a"), "--to", "ct", "--device",
                           "cpu", "--scale-rule", "even", "--skip-if-current", "--json")
        assert code == 0 and json.loads(out)["status"] == "converted", old
        man = json.loads(man_path.read_text())
    assert run("convert", str(srcs["gpt-oss"]), str(tmp_path / "q"), "--to", "quark")[0] == 0
    assert "numerics" not in json.loads((tmp_path / "q" / "mxfp4conv.json").read_text())["fingerprint"]


def test_verify_catches_a_flipped_byte(srcs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert run("convert", str(srcs["gpt-oss"]), str(out), "--to", "quark")[0] == 0
    shard = out / "model.safetensors"
    with safe_open(str(shard), "pt") as fh:
        # find the byte offset of one expert scale tensor and flip it
        name = "model.layers.0.mlp.experts.2.w2_weight_scale"
        assert name in fh.keys()  # noqa: SIM118
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    b, _ = header[name]["data_offsets"]
    raw[8 + n + b] ^= 0x01
    shard.write_bytes(bytes(raw))
    code, out_text, _ = run("verify", str(srcs["gpt-oss"]), str(out), "--json")
    assert code == 3
    doc = json.loads(out_text)
    assert not doc["ok"] and doc["mismatches"][0]["tensor"].startswith("model.layers.0.mlp.experts.w2 scales")


def test_nvfp4_report_has_stats(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, out, err = run("convert", str(srcs["ct-nvfp4"]), str(tmp_path / "o"), "--to", "ct", "--json", "--device", "cpu")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["requantized"] == 2 and doc["verify"]["ok"]
    st = doc["requant_stats"]["model.layers.0.mlp.experts.w13"]
    assert 5 < st["sqnr_db"] < 60 and st["blocks"] == 4 * 64 * 2
    manifest = json.loads((tmp_path / "o" / "mxfp4conv.json").read_text())
    assert manifest["requant_stats"] == doc["requant_stats"]
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mxfp4-pack-quantized" and cfg["config_groups"]["group_0"]["weights"]["group_size"] == 32
    from mxfp4conv.files.cbuild import compiler

    kernel = "native" if compiler() is not None else "torch"  # CI and dev machines have a C compiler
    assert doc["compute"] == {"devices": ["cpu"], "cpu_kernel": kernel}
    # per-stage busy seconds: every stage worked, none is negative, none outlasts the wall time
    sec = doc["seconds"]
    assert {"read", "transform", "write", "hash", "verify", "total"} <= set(sec)
    assert all(0 < sec[k] <= sec["total"] for k in ("read", "transform", "write", "hash", "verify")), sec


def test_cpu_kernel_mode_errors_are_usage_errors(srcs: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """MXFP4CONV_CPU_KERNEL=native without a compiler: one line, exit 2, nothing written, before any
    work; renames never look at the kernel; the torch path reports itself."""
    from mxfp4conv.kernels import requant_native

    monkeypatch.setattr(requant_native, "_kernel", None)
    monkeypatch.setattr(requant_native, "_error", None)
    monkeypatch.setenv("MXFP4CONV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "native")
    code, out, err = run("convert", str(srcs["modelopt-nvfp4"]), str(tmp_path / "o"), "--device", "cpu")
    assert code == 2 and not (tmp_path / "o").exists() and not list(tmp_path.glob(".o*"))
    (line,) = [x for x in err.splitlines() if x.strip()]  # the whole of stderr is that one line
    assert "MXFP4CONV_CPU_KERNEL=native but the CPU kernel cannot be built" in line and "fix: unset" in line
    assert "Traceback" not in err
    assert run("convert", str(srcs["ct-mxfp4"]), str(tmp_path / "r"), "--to", "quark")[0] == 0
    monkeypatch.setenv("MXFP4CONV_CPU_KERNEL", "torch")
    code, out, err = run("convert", str(srcs["modelopt-nvfp4"]), str(tmp_path / "t"), "--device", "cpu", "--json")
    assert code == 0, err
    assert json.loads(out)["compute"] == {"devices": ["cpu"], "cpu_kernel": "torch"}


def test_inspect_reads_headers_only(tmp_path: Path) -> None:
    """A 2 GB tensor in a sparse file: inspect takes the same time and memory as for a tiny one."""
    src = build("ct-mxfp4", tmp_path / "big", shards=1)
    shard = src / "model.safetensors"
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data_len = len(raw) - 8 - n
    big = 2 * 1024**3
    header["model.extra_big.weight"] = {"dtype": "U8", "shape": [big], "data_offsets": [data_len, data_len + big]}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(shard, "wb") as fh:
        fh.write(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])
        fh.truncate(8 + len(hb) + data_len + big)  # sparse: nothing is allocated
    code = ("import resource,time,json,sys;from mxfp4conv.plan.inspect import inspect_checkpoint;t=time.perf_counter();"
            "r=inspect_checkpoint(sys.argv[1]);print(json.dumps([time.perf_counter()-t,"
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,r.total_bytes]))")
    t_big, rss_big, total = json.loads(subprocess.check_output([sys.executable, "-c", code, str(src)]))
    assert total > big
    assert t_big < 5.0
    small = build("ct-mxfp4", tmp_path / "small", shards=1)
    _, rss_small, _ = json.loads(subprocess.check_output([sys.executable, "-c", code, str(small)]))
    assert rss_big - rss_small < 50 * 1024  # KiB: far below the 2 GB of data


def test_partitions_then_finish_equal_one_run(srcs: dict[str, Path], tmp_path: Path) -> None:
    args = [str(srcs["ct-nvfp4"]), "--to", "quark", "--max-shard-size", "30KB", "--device", "cpu"]
    assert run("convert", args[0], str(tmp_path / "one"), *args[1:])[0] == 0
    for i in range(3):
        code, out, err = run("convert", args[0], str(tmp_path / "multi"), *args[1:], "--partition", f"{i}/3", "--json")
        assert code == 0 and json.loads(out)["status"] == "partial", err
        assert not (tmp_path / "multi").exists()
    code, out, err = run("convert", args[0], str(tmp_path / "multi"), *args[1:], "--finish", "--json")
    assert code == 0, err
    assert json.loads(out)["verify"]["ok"]
    assert tree_hashes(tmp_path / "one") == tree_hashes(tmp_path / "multi")


def test_finish_refuses_missing_partition(srcs: dict[str, Path], tmp_path: Path) -> None:
    args = [str(srcs["ct-mxfp4"]), str(tmp_path / "o"), "--max-shard-size", "30KB"]
    assert run("convert", *args, "--partition", "0/2")[0] == 0
    code, _, err = run("convert", *args, "--finish")
    assert code == 1 and "missing or damaged" in err
    assert not (tmp_path / "o").exists()


def test_failed_partition_keeps_the_others_shards(srcs: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A partition that fails to write (e.g. a full disk) must not delete the staging folder the other
    partitions share (Ray tasks, batch jobs): its rerun and --finish still give the one-run bytes."""
    from mxfp4conv.errors import OutputError

    args = [str(srcs["ct-mxfp4"]), "--to", "quark", "--max-shard-size", "30KB"]
    assert run("convert", args[0], str(tmp_path / "one"), *args[1:])[0] == 0
    assert run("convert", args[0], str(tmp_path / "o"), *args[1:], "--partition", "0/2")[0] == 0
    staging = tmp_path / ".o.mxfp4conv-staging"
    kept = {p.name: p.read_bytes() for p in staging.glob("*.safetensors")}
    assert kept

    def full_disk(*a: object, **k: object) -> str:
        raise OutputError("cannot write shard: No space left on device", file="x", hint="free disk space")

    with monkeypatch.context() as m:
        m.setattr(conversion, "ShardStream", full_disk)
        code, _, err = run("convert", args[0], str(tmp_path / "o"), *args[1:], "--partition", "1/2")
    assert code != 0 and "No space left" in err
    assert {p.name: p.read_bytes() for p in staging.glob("*.safetensors")} == kept  # partition 0's work survives
    assert run("convert", args[0], str(tmp_path / "o"), *args[1:], "--partition", "1/2")[0] == 0
    assert run("convert", args[0], str(tmp_path / "o"), *args[1:], "--finish")[0] == 0
    assert tree_hashes(tmp_path / "one") == tree_hashes(tmp_path / "o")


def test_resume_reuses_rechecked_shards(srcs: dict[str, Path], tmp_path: Path) -> None:
    """A killed run leaves finished shards in staging; --resume re-hashes and reuses them."""
    args = [str(srcs["modelopt-nvfp4"]), "--to", "ct", "--max-shard-size", "30KB", "--device", "cpu"]
    assert run("convert", args[0], str(tmp_path / "ref"), *args[1:])[0] == 0
    # simulate an interrupted run: partition 0/2 wrote half the shards under the same fingerprint layout
    assert run("convert", args[0], str(tmp_path / "o"), *args[1:], "--partition", "0/2")[0] == 0
    staging = tmp_path / ".o.mxfp4conv-staging"
    progress = json.loads(next(staging.glob(".mxfp4conv-progress*.json")).read_text())
    done = sorted(progress["shards"])
    assert done
    damaged = staging / done[0]
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")  # must be detected and rewritten
    mtimes = {n: (staging / n).stat().st_mtime_ns for n in done[1:]}
    code, _, err = run("convert", args[0], str(tmp_path / "o"), *args[1:], "--resume")
    assert code == 0, err
    assert tree_hashes(tmp_path / "ref") == tree_hashes(tmp_path / "o")
    assert not staging.exists()
    for name, mtime in mtimes.items():  # intact finished shards were reused, not rewritten
        assert (tmp_path / "o" / name).stat().st_mtime_ns == mtime, name


@pytest.mark.parametrize("layout", ["ct-mxfp4", "ct-nvfp4"])
def test_worker_count_does_not_change_bytes(srcs: dict[str, Path], tmp_path: Path, layout: str) -> None:
    """Units spread over several workers (the multi-GPU path, here on CPU) come out byte-identical."""
    from mxfp4conv.run.pipeline import ConvertOptions, convert

    convert(srcs[layout], tmp_path / "one", ConvertOptions(target="quark", device="cpu", max_shard_size=40_000))
    convert(srcs[layout], tmp_path / "three", ConvertOptions(target="quark", device="cpu", max_shard_size=40_000,
                                                            devices=("cpu", "cpu", "cpu")))
    assert tree_hashes(tmp_path / "one") == tree_hashes(tmp_path / "three")


def _flip(shard: Path, name: str) -> None:
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    b, _ = json.loads(raw[8:8 + n])[name]["data_offsets"]
    raw[8 + n + b + 3] ^= 0x10
    shard.write_bytes(bytes(raw))


def test_verify_catches_a_flipped_byte_on_the_rename_path(srcs: dict[str, Path], tmp_path: Path) -> None:
    """ct-mxfp4 -> quark copies byte ranges without decoding; verify still compares every byte."""
    out = tmp_path / "o"
    assert run("convert", str(srcs["ct-mxfp4"]), str(out), "--to", "quark")[0] == 0
    _flip(out / "model.safetensors", "model.layers.1.mlp.experts.3.up_proj.weight")
    code, text, _ = run("verify", str(srcs["ct-mxfp4"]), str(out), "--json")
    assert code == 3
    assert json.loads(text)["mismatches"][0]["tensor"] == "model.layers.1.mlp.experts.3.up_proj.weight"


def test_copy_modes_give_identical_bytes(srcs: dict[str, Path], tmp_path: Path) -> None:
    import os

    for mode in ("readwrite", "copy_file_range"):
        env = {**os.environ, "MXFP4CONV_COPY": mode}
        subprocess.run([sys.executable, "-m", "mxfp4conv", "convert", str(srcs["gpt-oss"]), str(tmp_path / mode)],
                       check=True, env=env, capture_output=True)
    assert tree_hashes(tmp_path / "readwrite") == tree_hashes(tmp_path / "copy_file_range")


def test_inspect_and_lossless_paths_never_import_torch(srcs: dict[str, Path], tmp_path: Path) -> None:
    """Headers, plans, byte-range copies and raw verify need no torch: `inspect`, rename conversions
    and their verify start in a fraction of a second (torch's import alone is 2-4 s). A requant does
    import it (the check below would catch a probe that cannot see imports)."""
    probe = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from mxfp4conv.cli import cli\n"
        "for args in sys.argv[1].split(';'):\n"
        "    r = CliRunner().invoke(cli, args.split())\n"
        "    assert r.exit_code == 0, (args, r.output)\n"
        "print('torch' in sys.modules)\n"
    )
    mx, go, nv = (str(srcs[k]) for k in ("ct-mxfp4", "gpt-oss", "modelopt-nvfp4"))
    lossless = (f"inspect {mx} --json;inspect {go};inspect {nv};convert {mx} {tmp_path / 'a'} --to quark;"
                f"verify {mx} {tmp_path / 'a'};convert {go} {tmp_path / 'b'} --to gpt-oss;"
                f"convert {mx} {tmp_path / 'c'} --dry-run")
    res = subprocess.run([sys.executable, "-c", probe, lossless], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False", res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-c", probe, f"convert {nv} {tmp_path / 'd'} --to ct --device cpu"],
                         capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "True"


def test_untrusted_names_print_as_written() -> None:
    """Names from checkpoint files go through rich: markup in them is escaped, control characters replaced."""
    from mxfp4conv.cli import _err, _safe

    name = "experts.0[bold].w[/]\x1b[2J"
    with _err.capture() as cap:
        _err.print(f"[red]problem:[/] {_safe(name)}", markup=True)
    assert "problem: experts.0[bold].w[/]?[2J" in cap.get()


def test_problem_lines_print_brackets_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan problems print their names and messages literally: shapes in [brackets] in the table mode
    (a real damaged checkpoint), and tag-like names in the one summary line of --json mode."""
    from safetensors.torch import load_file, save_file

    import mxfp4conv.plan.inspect as inspect_mod

    src = build("ct-mxfp4", tmp_path / "src", shards=1)
    f = src / "model.safetensors"
    t = load_file(str(f))
    name = next(n for n in sorted(t) if n.endswith("experts.0.down_proj.weight_scale"))
    t[name] = t[name].reshape(-1)[:-1].clone().reshape(1, -1)  # wrong shape: a plan problem
    save_file(t, str(f), metadata={"format": "pt"})
    res = subprocess.run([sys.executable, "-m", "mxfp4conv", "inspect", str(src)], capture_output=True, text=True)
    assert res.returncode == 1
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("problem:"))
    assert name in line and "scale shape [1, " in line, res.stderr

    class Report:
        exit_code = 1

        def to_dict(self) -> dict[str, object]:
            return {"problems": [{"file": "a[b].safetensors", "tensor": "w.[bold]x[/]", "message": "bad [i]y"}]}

    monkeypatch.setattr(inspect_mod, "inspect_checkpoint", lambda src, revision: Report())
    code, out, err = run("inspect", str(src), "--json")
    assert code == 1 and json.loads(out)["problems"]
    assert "problem: a[b].safetensors: w.[bold]x[/]: bad [i]y" in err, err


def test_human_summary_names_the_busiest_stage(srcs: dict[str, Path], tmp_path: Path) -> None:
    """Without --json, the summary on stderr lists each stage's busy seconds (NVFP4 source: every
    stage worked) and ends with the verified result."""
    code, out, err = run("convert", str(srcs["ct-nvfp4"]), str(tmp_path / "o"), "--to", "ct", "--device", "cpu")
    assert code == 0, err
    assert out == ""
    line = next(x for x in err.splitlines() if x.startswith("busy seconds per stage"))
    stages = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", "))
    assert {"read", "transform", "write", "hash", "verify"} <= set(stages)
    assert all(re.fullmatch(r"\d+\.\d", v) for v in stages.values()), line  # no negative, nan or inf
    last = err.splitlines()[-1]
    assert last.startswith("done: ") and last.endswith(", verified"), last  # ", NOT verified" must fail


def test_the_report_says_where_units_were_requantized(tmp_path: Path) -> None:
    src = build("modelopt-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=128, inter=64)
    report = pipeline.convert(src, tmp_path / "out", pipeline.ConvertOptions(target="ct", device="cpu"))
    assert report.requantized == 2 and report.requantized_on == {"cpu": 2}
    mx = build("ct-mxfp4", tmp_path / "mx", layers=1, experts=4, hidden=128, inter=64)
    renamed = pipeline.convert(mx, tmp_path / "mx-out", pipeline.ConvertOptions(target="ct"))
    assert renamed.requantized_on == {}  # a rename requantizes nothing


def test_human_summary_says_how_several_devices_shared_the_units(srcs: dict[str, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One device: no line (the report says it); several: units per device, a line of its own."""
    code, _, err = run("convert", str(srcs["ct-nvfp4"]), str(tmp_path / "one"), "--to", "ct", "--device", "cpu")
    assert code == 0 and "requantized on" not in err, err
    real = pipeline.convert

    def shared(*args, **kwargs):  # type: ignore[no-untyped-def]
        report = real(*args, **kwargs)
        report.requantized_on = {"cuda:1": 3, "cuda:0": 4}  # as two GPUs would report it
        return report

    monkeypatch.setattr(pipeline, "convert", shared)
    code, _, err = run("convert", str(srcs["ct-nvfp4"]), str(tmp_path / "two"), "--to", "ct", "--device", "cpu")
    assert code == 0, err
    assert "requantized on: cuda:0 4 unit(s), cuda:1 3 unit(s)" in err.splitlines(), err
