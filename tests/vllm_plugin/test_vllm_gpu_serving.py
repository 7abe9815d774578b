"""``--to marlin`` outputs served by vLLM 0.33's GPU build with the plugin, against vLLM's own path on the sources.

Needs a CUDA GPU (compute capability 9.0: the bundle keeps sm_90 machine code and PTX) and the
folder ``make gpu-bundle`` writes (``.vllm-gpu``, or ``MXFP4CONV_VLLM_BUNDLE``); skipped, with the
reason, when either is absent. The bundle is unpacked into ``MXFP4CONV_VLLM_SITE`` (default
``/tmp/mxfp4conv-vllm-site``) and the engine runs in a child process of this python
(``tests/gpu_serving/engine.py``), the unpacked vLLM and mxfp4conv wheel first on its path.

Sources (tests/serving/serving_sources.py; hidden 128, 4 experts, 2 layers, vocabulary 256):
Qwen3-MoE and Mixtral compressed-tensors MXFP4, GPT-OSS native MXFP4, Qwen3-MoE compressed-tensors
NVFP4 (converted twice: requantized to MXFP4, and ``--keep-nvfp4``), and Qwen3-MoE MXFP4 with FP4
attention (dense FP4 Linears). Each source is served by vLLM's own path (``moe_backend="marlin"``:
vLLM prepares and repacks the weights for Marlin at start-up) and its ``--to marlin`` output by the
plugin. Checked:

* the plugin's next-token logprobs over the whole vocabulary, its greedy tokens and its loaded Marlin
  parameters (sha256) equal vLLM's own path on the source, bit for bit;
* both against a float32 ``transformers`` forward of the dequantized source (for the requantized
  NVFP4 output: of the requantized weights), top-20 logprobs within the bf16 bound of the CPU serving
  tests, positions where bf16 may route to another expert left out;
* the calls of vLLM's Marlin preparation / repack functions counted inside the engine's process: none
  for the plugin, some for vLLM's own path on the same weights (so the counter is shown to count);
* refusals inside real vLLM, each one line: a rank of a ``--tp-size 2`` output served at TP 1, a
  rank folder whose metadata names another TP rank, a truncated shard, and a vLLM release the
  plugin was not tested with (``vllm.__version__`` reading 0.99.0 while the plugins load).

``MXFP4CONV_GPU_SERVING_REPORT=FILE`` writes every number measured; ``MXFP4CONV_GPU_BENCH=1`` adds
the start-up of one GPT-OSS-120B-shaped MoE layer (128 experts, H = I = 2880) both ways.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.builders import build
from tests.gpu_serving.bundle import plugin_digest
from tests.gpu_serving.unpack import unpack
from tests.vllm_plugin.conftest import ATTN, convert
from tests.vllm_plugin.test_plugin_cpu import with_metadata

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "tests" / "gpu_serving" / "engine.py"
ROUTING_TIE = 0.03
REPORT: dict[str, Any] = {}
PAIRS = {  # plugin case -> vLLM's own path on its source
    "qwen3_moe-ct-mxfp4--marlin": "qwen3_moe-ct-mxfp4",
    "mixtral-ct-mxfp4--marlin": "mixtral-ct-mxfp4",
    "gpt_oss--marlin": "gpt_oss",
    "qwen3_moe-ct-nvfp4--marlin-keep-nvfp4": "qwen3_moe-ct-nvfp4",
    "qwen3_moe-fp4-attention--marlin": "qwen3_moe-fp4-attention",
}
REFS = {  # case -> float32 reference it is compared with
    "qwen3_moe-ct-mxfp4": "qwen3_moe-ct-mxfp4", "qwen3_moe-ct-mxfp4--marlin": "qwen3_moe-ct-mxfp4",
    "mixtral-ct-mxfp4": "mixtral-ct-mxfp4", "mixtral-ct-mxfp4--marlin": "mixtral-ct-mxfp4",
    "gpt_oss": "gpt_oss", "gpt_oss--marlin": "gpt_oss",
    "qwen3_moe-ct-nvfp4": "qwen3_moe-ct-nvfp4", "qwen3_moe-ct-nvfp4--marlin-keep-nvfp4": "qwen3_moe-ct-nvfp4",
    "qwen3_moe-ct-nvfp4--marlin": "qwen3_moe-ct-nvfp4-requantized",
    "qwen3_moe-fp4-attention": "qwen3_moe-fp4-attention", "qwen3_moe-fp4-attention--marlin": "qwen3_moe-fp4-attention",
}
REFUSALS = {
    "refuse-tp-size": "mxfp4conv.tp_size is '2', the server needs '1'",
    "refuse-tp-rank": "mxfp4conv.tp_rank is '1', the server needs '0'",
    "refuse-truncated-shard": "the file holds",
    "refuse-untested-vllm": "tested with vLLM 0.32-0.33, this is vLLM 0.99.0",
}


# ----------------------------------------------------------------------------- environment
def bundle_dir() -> Path:
    return Path(os.environ.get("MXFP4CONV_VLLM_BUNDLE") or ROOT / ".vllm-gpu")


@pytest.fixture(scope="module")
def site() -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (vLLM 0.33's Marlin kernels); this host has none")
    bundle = bundle_dir()
    if not (bundle / "bundle.json").exists():
        pytest.skip(f"no vLLM 0.33 bundle at {bundle}: run `make gpu-bundle` (or set MXFP4CONV_VLLM_BUNDLE)")
    manifest = json.loads((bundle / "bundle.json").read_text())
    if manifest["plugin_sha256"] != plugin_digest(ROOT):
        pytest.fail(f"{bundle}: its mxfp4conv wheel holds another vllm_plugin than this checkout: run `make gpu-bundle`")
    t = time.perf_counter()
    out = unpack(bundle, Path(os.environ.get("MXFP4CONV_VLLM_SITE") or "/tmp/mxfp4conv-vllm-site"))
    REPORT["seconds: unpack"] = round(time.perf_counter() - t, 1)
    REPORT["gpu"] = torch.cuda.get_device_name()
    REPORT["torch"] = torch.__version__
    return out


@pytest.fixture(scope="module", autouse=True)
def write_report() -> Any:
    yield
    if out := os.environ.get("MXFP4CONV_GPU_SERVING_REPORT"):
        Path(out).write_text(json.dumps(REPORT, indent=1, sort_keys=True))


# ----------------------------------------------------------------------------- sources
def fp4_attention(src: Path, dst: Path) -> Path:
    """A copy of a compressed-tensors MXFP4 source whose q/k/v/o projections are MXFP4 too (dense FP4 Linears)."""
    from safetensors.torch import load_file, save_file

    from tests.builders import quant_mxfp4

    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        t = load_file(str(f))
        for name in [n for n in t if n.endswith(".weight") and n.rsplit(".", 2)[-2] in ATTN]:
            m = name.removesuffix(".weight")
            t[f"{m}.weight_packed"], t[f"{m}.weight_scale"] = quant_mxfp4(t.pop(name).float())
        save_file(t, str(f), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        wm: dict[str, str] = {}
        for k, v in doc["weight_map"].items():
            if k.endswith(".weight") and k.rsplit(".", 2)[-2] in ATTN:
                m = k.removesuffix(".weight")
                wm[f"{m}.weight_packed"] = wm[f"{m}.weight_scale"] = v
            else:
                wm[k] = v
        doc["weight_map"] = wm
        index.write_text(json.dumps(doc, indent=2))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = [i for i in cfg["quantization_config"]["ignore"] if "self_attn" not in i]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return dst


def truncated(rank_dir: Path, dst: Path) -> Path:
    """A copy of a rank folder whose largest shard lost its last 4 KiB (an interrupted copy)."""
    shutil.copytree(rank_dir, dst)
    f = max(dst.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 4096)
    return dst


def ct_mxfp4_reference(folder: Path) -> torch.nn.Module:
    """float32 transformers model of a compressed-tensors MXFP4 checkpoint: codes unpacked by compressed-tensors'
    own FP4 unpacker (at float32), times 2^(E8M0 - 127), every block of 32. (compressed-tensors 0.17, the
    release vLLM 0.33 pins, has no MXFP4 in its dequantizer: it asks for NVFP4's global scales.)"""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    from tests.producers.producers_lib import load_tensors, reference_model

    t = load_tensors(folder)
    dense: dict[str, torch.Tensor] = {}
    for k, v in t.items():
        if k.endswith(".weight_packed"):
            m = k.removesuffix(".weight_packed")
            n, kh = v.shape
            codes = unpack_fp4_from_uint8(v, n, kh * 2, dtype=torch.float32)
            dense[f"{m}.weight"] = codes * torch.exp2(t[f"{m}.weight_scale"].float() - 127).repeat_interleave(32, 1)
        elif not k.endswith(".weight_scale"):
            dense[k] = v.float()
    return reference_model(folder, dense)


def add_site_packages(site: Path) -> None:
    """compressed-tensors (the references' dequantizer) and its pydantic come from the bundle, after this
    python's own packages."""
    if str(site) not in sys.path:
        sys.path.append(str(site))


# ----------------------------------------------------------------------------- the engine run
def start_engine(site: Path, cases: list[dict[str, Any]], root: Path, results: Path) -> subprocess.Popen[bytes]:
    (root / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(site), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    log = open(root / "engine.log", "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, str(ENGINE), str(root / "cases.json"), str(results)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(root))


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {d["name"]: d for d in (json.loads(ln) for ln in path.read_text().splitlines() if ln.strip())}


@pytest.fixture(scope="module")
def served(site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.serving import serving_sources as S

    t0 = time.perf_counter()
    root = tmp_path_factory.mktemp("gpu_serving")
    prompts = S.prompts()
    moe = {arch: S.build_moe(arch, root / "src", seed) for arch, seed in (("qwen3_moe", 1), ("mixtral", 2))}
    gpt = S.build_gpt_oss(root / "src")
    q3, nv = moe["qwen3_moe"].paths["ct-mxfp4"], moe["qwen3_moe"].paths["ct-nvfp4"]
    attn = fp4_attention(q3, root / "src" / "qwen3_moe-fp4-attention")
    out = root / "out"
    out.mkdir()
    sources = {"qwen3_moe-ct-mxfp4": q3, "mixtral-ct-mxfp4": moe["mixtral"].paths["ct-mxfp4"], "gpt_oss": gpt,
               "qwen3_moe-ct-nvfp4": nv, "qwen3_moe-fp4-attention": attn}
    marlin = {f"{n}--marlin": convert(p, out / f"{n}--marlin") for n, p in sources.items()}
    marlin["qwen3_moe-ct-nvfp4--marlin-keep-nvfp4"] = convert(nv, out / "nvfp4-keep", "--keep-nvfp4")
    del marlin["qwen3_moe-ct-nvfp4--marlin"]
    marlin["qwen3_moe-ct-nvfp4--marlin"] = convert(nv, out / "nvfp4-requant")
    # Marlin needs I per rank % 64 == 0: the TP-2 output comes from the plugin tests' larger Qwen3-MoE (I = 128)
    tp2 = convert(build("ct-mxfp4", root / "src" / "qwen3-i128", layers=2, experts=4, hidden=256, inter=128, shards=1),
                  out / "qwen3-tp2", "--tp-size", "2")
    REPORT["seconds: build + convert"] = round(time.perf_counter() - t0, 1)

    def case(name: str, model: Path, **kw: Any) -> dict[str, Any]:
        return {"name": name, "model": str(model), "vocab": S.VOCAB, "prompts": prompts, **kw}

    cases = []
    for name, src in sources.items():
        cases.append(case(name, src, engine_args={"moe_backend": "marlin"}))
        if f"{name}--marlin" in marlin:
            cases.append(case(f"{name}--marlin", marlin[f"{name}--marlin"] / "rank-0"))
    cases.append(case("qwen3_moe-ct-nvfp4--marlin-keep-nvfp4", marlin["qwen3_moe-ct-nvfp4--marlin-keep-nvfp4"] / "rank-0"))
    q3m = marlin["qwen3_moe-ct-mxfp4--marlin"] / "rank-0"
    refusals = {
        "refuse-tp-size": case("refuse-tp-size", tp2 / "rank-1", prompts=[]),
        "refuse-tp-rank": case("refuse-tp-rank", with_metadata(q3m, root / "wrong-rank" / "rank-0", tp_rank="1"),
                               prompts=[]),
        "refuse-truncated-shard": case("refuse-truncated-shard", truncated(q3m, root / "truncated" / "rank-0"),
                                       prompts=[]),
        "refuse-untested-vllm": case("refuse-untested-vllm", q3m, prompts=[], vllm_version="0.99.0"),
    }
    cases += list(refusals.values())
    if os.environ.get("MXFP4CONV_GPU_BENCH"):
        big = gpt_oss_120b_layer(root / "src" / "gpt-oss-120b-layer")
        big_m = convert(big, out / "gpt-oss-120b-layer--marlin")
        cases += [case("bench-gpt-oss-120b-layer", big, prompts=[], params=False, engine_args={"moe_backend": "marlin"}),
                  case("bench-gpt-oss-120b-layer--marlin", big_m / "rank-0", prompts=[], params=False),
                  case("bench-gpt-oss-120b-layer#2", big, prompts=[], params=False, engine_args={"moe_backend": "marlin"}),
                  case("bench-gpt-oss-120b-layer--marlin#2", big_m / "rank-0", prompts=[], params=False)]

    results_file = root / "results.jsonl"
    t = time.perf_counter()
    proc = start_engine(site, cases, root, results_file)
    refs: dict[str, torch.Tensor] = {}
    gaps: dict[str, torch.Tensor] = {}
    bf16: dict[str, float] = {}
    try:
        add_site_packages(site)
        tr = time.perf_counter()

        def ref(key: str, model: torch.nn.Module, bf16_bound: bool = False) -> None:
            refs[key], gaps[key] = S.forward(model, prompts)
            if bf16_bound:
                half = S.log_probs(torch.nn.Module.to(model, torch.bfloat16), prompts)
                bf16[key] = S.top20_error(refs[key], half, gaps[key] >= ROUTING_TIE)

        for arch in moe:
            ref(f"{arch}-ct-mxfp4", ct_mxfp4_reference(moe[arch].paths["ct-mxfp4"]), bf16_bound=True)
        ref("qwen3_moe-ct-nvfp4", S.reference("ct-nvfp4", nv))
        ref("qwen3_moe-ct-nvfp4-requantized", S.requantized_reference(nv))
        ref("qwen3_moe-fp4-attention", ct_mxfp4_reference(attn), bf16_bound=True)
        ref("gpt_oss", S.reference("gpt-oss", gpt), bf16_bound=True)
        REPORT["seconds: float32 references"] = round(time.perf_counter() - tr, 1)
        rc = proc.wait(timeout=900)
        if rc != 0 and len(read_results(results_file)) - 1 < len(cases):  # a crash: the rest in a new process
            REPORT["engine restarted after"] = sorted(read_results(results_file))
            proc = start_engine(site, cases, root, results_file)
            proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    REPORT["seconds: engine process (wall)"] = round(time.perf_counter() - t, 1)
    results = read_results(results_file)
    log = (root / "engine.log").read_text(errors="replace")
    process = results.pop("_process", None)
    if process is None:
        pytest.fail(f"the engine process wrote no results:\n{log[-6000:]}")
    REPORT["engine"] = process
    REPORT["seconds: LLM() per case"] = {n: r.get("t_init") for n, r in results.items()}
    REPORT["seconds: total"] = round(time.perf_counter() - t0, 1)
    return {"results": results, "refs": refs, "gaps": gaps, "bf16": bf16, "log": log, "cases": cases,
            "process": process}


def gpt_oss_120b_layer(root: Path) -> Path:
    """GPT-OSS-120B's MoE layer shapes (128 experts, H = I = 2880, 64 heads of 64, 8 KV heads), one layer,
    random FP4 codes and scales (start-up time does not depend on the values)."""
    src = build("gpt-oss", root, layers=1, experts=4, hidden=64, inter=64, shards=1, seed=5)
    from safetensors.torch import load_file, save_file

    t = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if ".mlp." not in k and ".self_attn." not in k}
    g = torch.Generator().manual_seed(7)
    e, h, i, heads, kv, hd, vocab = 128, 2880, 2880, 64, 8, 64, 256

    def bf(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    p = "model.layers.0"
    t["model.embed_tokens.weight"], t["lm_head.weight"] = bf(vocab, h), bf(vocab, h)
    t["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    t[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for name, rows, cols in (("q_proj", heads * hd, h), ("k_proj", kv * hd, h), ("v_proj", kv * hd, h),
                             ("o_proj", h, heads * hd)):
        t[f"{p}.self_attn.{name}.weight"], t[f"{p}.self_attn.{name}.bias"] = bf(rows, cols), bf(rows)
    t[f"{p}.self_attn.sinks"] = bf(heads)
    t[f"{p}.mlp.router.weight"], t[f"{p}.mlp.router.bias"] = bf(e, h), bf(e)
    m = f"{p}.mlp.experts"
    t[f"{m}.gate_up_proj_blocks"] = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8, generator=g)
    t[f"{m}.gate_up_proj_scales"] = torch.randint(118, 124, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g)
    t[f"{m}.gate_up_proj_bias"] = bf(e, 2 * i)
    t[f"{m}.down_proj_blocks"] = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, generator=g)
    t[f"{m}.down_proj_scales"] = torch.randint(118, 124, (e, h, i // 32), dtype=torch.uint8, generator=g)
    t[f"{m}.down_proj_bias"] = bf(e, h)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=h, intermediate_size=i, num_local_experts=e, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=hd, experts_per_token=4, num_experts_per_tok=4)
    (src / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return src


# ----------------------------------------------------------------------------- comparisons
def result(served: dict[str, Any], name: str) -> dict[str, Any]:
    res = served["results"].get(name)
    assert res is not None, f"{name} was not served; engine log:\n{served['log'][-4000:]}"
    return res


def served_ok(served: dict[str, Any], name: str) -> dict[str, Any]:
    res = result(served, name)
    assert "error" not in res, f"vLLM refused {name}: {res['error']}\n{res.get('traceback', '')}"
    return res


def dense_logprobs(res: dict[str, Any]) -> torch.Tensor:
    """[prompts, positions - 1, vocab] float64: vLLM's prompt logprob of every token at positions 1..N-1."""
    rows = [[[float("nan") if v is None else v for v in pos] for pos in p[1:]] for p in res["prompt_logprobs"]]
    return torch.tensor(rows, dtype=torch.float64)


def vs_reference(res: dict[str, Any], ref: torch.Tensor, gaps: torch.Tensor) -> dict[str, Any]:
    """Top-20 (of the reference) max |dlogprob| and top-1 agreement, positions at routing near ties left out."""
    got = dense_logprobs(res)
    r = ref[:, : got.shape[1]]
    keep = gaps[:, : got.shape[1]] >= ROUTING_TIE
    idx = r.topk(20, dim=-1).indices
    d = (r.gather(-1, idx) - got.gather(-1, idx)).abs().amax(-1)
    top1 = r.argmax(-1) == got.nan_to_num(-1e9).argmax(-1)
    best2 = r.topk(2, dim=-1).values
    margin = best2[..., 0] - best2[..., 1]
    return {"max_top20": float(d[keep].max()), "mean_top20": float(d[keep].mean()),
            "top1_equal": f"{int(top1[keep].sum())}/{int(keep.sum())}", "routing_ties_left_out": int((~keep).sum()),
            "nan": int(d[keep].isnan().sum()), "_d": d[keep], "_top1": top1[keep], "_margin": margin[keep]}


def bound(served: dict[str, Any], ref_key: str) -> float:
    """The CPU serving tests' bound: 3x what bf16 compute alone costs these weights, at least 0.03."""
    key = {"qwen3_moe-ct-nvfp4": "qwen3_moe-ct-mxfp4", "qwen3_moe-ct-nvfp4-requantized": "qwen3_moe-ct-mxfp4"
           }.get(ref_key, ref_key)
    return max(0.03, 3 * served["bf16"][key])


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(REFS))
def test_served_within_float32_reference(served: dict[str, Any], name: str) -> None:
    res = served_ok(served, name)
    key = REFS[name]
    c = vs_reference(res, served["refs"][key], served["gaps"][key])
    b = bound(served, key)
    REPORT.setdefault("vs float32 reference", {})[name] = {**{k: v for k, v in c.items() if not k.startswith("_")},
                                                          "bound": round(b, 4), "reference": key}
    assert c["nan"] == 0, f"{name}: a top-20 token of the reference has no logprob"
    assert c["max_top20"] <= b, f"{name}: max |dlogprob| {c['max_top20']:.4f} over the top 20 > {b:.4f}"
    wrong = (~c["_top1"]) & (c["_margin"] >= b)
    assert not bool(wrong.any()), f"{name}: {int(wrong.sum())} positions pick another top-1 token than the reference"


@pytest.mark.parametrize("plugin", list(PAIRS))
def test_plugin_equals_vllm_own_path_on_the_source(served: dict[str, Any], plugin: str) -> None:
    src, out = served_ok(served, PAIRS[plugin]), served_ok(served, plugin)
    a, b = dense_logprobs(src), dense_logprobs(out)
    assert a.shape == b.shape
    same_nan = torch.equal(a.isnan(), b.isnan())
    worst = float((a - b).abs().nan_to_num(0).max())
    # every Marlin parameter the plugin loaded holds the bytes vLLM's own preparation made of the source
    marlin = {n: v for n, v in out["params"].items() if v[0] in ("torch.int32", "torch.float8_e8m0fnu")
              or n.endswith(("weight_scale", "weight_scale_2", "weight_global_scale"))}
    differ = sorted(n for n, v in marlin.items() if src["params"].get(n) != v)
    REPORT.setdefault("plugin vs vLLM's own path", {})[plugin] = {
        "max_abs_logprob_diff_all_vocab": worst, "generated_equal": src["generated"] == out["generated"],
        "marlin_params_compared": len(marlin), "marlin_params_differ": differ[:10],
        "t_init_plugin": out["t_init"], "t_init_source": src["t_init"]}
    assert out["model"]["moe_kernels"] and all("MarlinExperts" in k for k in out["model"]["moe_kernels"]), out["model"]
    assert src["model"]["moe_kernels"] and all("MarlinExperts" in k for k in src["model"]["moe_kernels"]), src["model"]
    assert "MarlinReadyMoEMethod" in out["model"]["methods"]
    assert "MarlinReadyMoEMethod" not in src["model"]["methods"]
    if "fp4-attention" in plugin:
        assert "MarlinReadyLinearMethod" in out["model"]["methods"], out["model"]
    assert same_nan and worst == 0.0, f"{plugin}: logprobs differ from vLLM's own path by up to {worst}"
    assert src["generated"] == out["generated"]
    assert marlin and not differ, f"{plugin}: {len(differ)} of {len(marlin)} Marlin parameters differ, e.g. {differ[:4]}"


@pytest.mark.parametrize("name", [n for n in REFS if "--marlin" in n])
def test_no_marlin_preparation_in_the_engine_for_the_plugin(served: dict[str, Any], name: str) -> None:
    res = served_ok(served, name)
    REPORT.setdefault("Marlin preparation calls in the engine", {})[name] = res["calls"]
    assert res["engine_core"] == "InprocClient", res["engine_core"]  # the engine core ran in the counting process
    assert res["calls"] == {}, f"{name}: vLLM's Marlin preparation ran: {res['calls']}"


@pytest.mark.parametrize("name", sorted(set(PAIRS.values())))
def test_the_counter_counts_on_vllm_own_path(served: dict[str, Any], name: str) -> None:
    res = served_ok(served, name)
    REPORT.setdefault("Marlin preparation calls in the engine", {})[name] = res["calls"]
    assert served["process"]["wrapped"], served["process"]
    assert sum(res["calls"].values()) > 0, f"{name}: no call counted on vLLM's own path: the counter counts nothing"
    assert res["call_pids"] == [res["engine_pid"]]
    repacks = sum(v for k, v in res["calls"].items() if k.endswith("gptq_marlin_repack"))
    assert repacks > 0, res["calls"]


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusal_is_one_line(served: dict[str, Any], name: str) -> None:
    res = result(served, name)
    assert "error" in res, f"{name}: vLLM served it"
    chain = res["causes"]
    REPORT.setdefault("refusals", {})[name] = chain[-1]
    hits = [msg for _, msg in chain if REFUSALS[name] in msg]
    assert hits, f"{name}: {REFUSALS[name]!r} not in the error chain {chain}\n{res['traceback']}"
    assert all("\n" not in h for h in hits), hits
    assert res["calls"] == {}, res["calls"]


def test_gpt_oss_120b_layer_start_up(served: dict[str, Any]) -> None:
    if not os.environ.get("MXFP4CONV_GPU_BENCH"):
        pytest.skip("set MXFP4CONV_GPU_BENCH=1 to time one GPT-OSS-120B-shaped layer")
    rows = {n: served_ok(served, n) for n in served["results"] if n.startswith("bench-")}
    REPORT["GPT-OSS-120B layer start-up"] = {n: {"t_init": r["t_init"], "calls": r["calls"]} for n, r in rows.items()}
    assert sum(rows["bench-gpt-oss-120b-layer"]["calls"].values()) > 0
    assert rows["bench-gpt-oss-120b-layer--marlin"]["calls"] == {}
