"""Kimi-K2's tiktoken vocabulary as GGUF tokenizer entries (mxfp4conv/targets/gguf_tiktoken.py).

The source is built as Kimi-K2's releases ship it: ``tiktoken.model`` (base64 token, rank per line), the remote
code's ``pat_str`` and ``num_reserved_special_tokens`` class attributes in ``tokenization_kimi.py`` (written here,
the attributes as the release's file has them), special tokens named in tokenizer_config.json's
``added_tokens_decoder``. Its ranks are trained here with byte-level BPE over a corpus split by that pattern.
The reference is tiktoken itself (``tiktoken.Encoding`` with the same ranks, pattern and special tokens, as the
remote code builds it); llama.cpp tokenizes the written GGUF and must give the same ids."""

from __future__ import annotations

import base64
import itertools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import gguf
import pytest
import regex
import tiktoken
from click.testing import CliRunner

from mxfp4conv.cli import cli
from mxfp4conv.errors import InputError
from mxfp4conv.sources.gguf import KV, VType, header_bytes
from mxfp4conv.targets import gguf_vocab as V
from mxfp4conv.targets.gguf_tiktoken import KIMI_K2
from tests.replicas import deepseek
from tests.targets.test_gguf_vocab import RUNNER, _reader, llama_python

RESERVED = 6  # the release's file says 256: fewer keep the vocabulary small
MERGES = 300
NAMED = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"]
CORPUS = [
    "Hello world, this is a test of the tokenizer. It's what we'll use; they've said I'd go, HE'LL SEE.",
    "The quick brown fox jumps over the lazy dog 1234567890 times, 3.14159 and 2,718 and 10000000.",
    "中文分词测试，我们今天去公园散步。汉字和English混在一起123也要测试。 日本語のテキストと漢字",
    "  leading spaces,\ttabs,\nnewlines\r\nand   runs   of   spaces  \n\n\n",
    "def main():\n    return {'key': [1, 2, 3]}  # code\n\n\nprint(main())  Привет, мир! façade",
] * 6
# Tokens across the K2 pattern's boundaries (a full-width comma and the Han character after it; Han and the Latin
# letter after it): tiktoken never produces them, a pattern that does not split Han off (gpt-4o's, Qwen's) would.
ACROSS = ["，我", "和E"]
TEXTS = [
    "中文，我",
    "汉字和E",
    "中文，我们去公园 汉字和English",
    "Hello world, it's 12345 and 3.14!",
    "I'VE been told he'll SEE 1000000 things in 2024, 123456789",
    "中文分词测试，我们今天去公园散步。汉字和English混在一起123",
    "日本語のテキストと漢字 ÉCOLE école Straße Привет мир façade 🙂",
    "  runs   of\n\n\tspaces  \r\n end   ",
    "def f(x):\n    return [x, x*2]  # ok\n",
    "<|im_user|>user: hi there<|im_end|><|im_assistant|>",
    "",
    " ",
]

CODE = '''"""Tokenization classes for a tiktoken-based model (the attributes the conversion reads)."""
import tiktoken


class TikTokenTokenizer:
    vocab_files_names = {"vocab_file": "tiktoken.model"}

    num_reserved_special_tokens = %d

    pat_str = "|".join(
        [
%s
        ]
    )
'''


def _train() -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair merged, MERGES times, inside
    the chunks the K2 pattern splits the corpus into."""
    pat = regex.compile(KIMI_K2, flags=regex.V1)
    chunks = [[bytes([b]) for b in m.encode()] for text in CORPUS for m in pat.findall(text)]
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(MERGES):
        counts: dict[tuple[bytes, bytes], int] = {}
        for c in chunks:
            for pair in itertools.pairwise(c):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = max(sorted(counts), key=lambda p: counts[p])
        ranks[best[0] + best[1]] = len(ranks)
        for c in chunks:
            i = 0
            while i < len(c) - 1:
                if (c[i], c[i + 1]) == best:
                    c[i:i + 2] = [best[0] + best[1]]
                i += 1
    for text in ACROSS:
        _reach(ranks, text)
    return ranks


def _reach(ranks: dict[bytes, int], text: str) -> None:
    """Make ``text`` one token BPE reaches: each character's bytes merged left to right, then the characters."""
    def add(token: bytes) -> None:
        ranks.setdefault(token, len(ranks))

    for ch in text:
        for k in range(2, len(ch.encode()) + 1):
            add(ch.encode()[:k])
    for k in range(2, len(text) + 1):
        add(text[:k].encode())


def _parts_of(pattern: str) -> list[str]:
    """``pattern`` cut at its top-level alternatives (the release's file lists them one per line)."""
    out, depth, cur = [], 0, ""
    for ch in pattern:
        depth += ch in "([" and not cur.endswith("\\")
        depth -= ch in ")]" and not cur.endswith("\\")
        if ch == "|" and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def _source(root: Path, ranks: dict[bytes, int], pattern: str = KIMI_K2, code: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    if code:
        lines = "\n".join(f'            r"""{p}""",' for p in _parts_of(pattern))
        (root / "tokenization_kimi.py").write_text(CODE % (RESERVED, lines))
    base = len(ranks)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(base + i): {"content": t, "special": True} for i, t in enumerate(NAMED)},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer",
        "chat_template": "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}"}))
    return root


def _config(ranks: dict[bytes, int]) -> dict[str, Any]:
    base = len(ranks)
    # Kimi-K2's vocab_size ends at the reserved tokens: the remote code's two extra ids are outside it
    return {"model_type": "kimi_k2", "vocab_size": base + RESERVED, "bos_token_id": base, "eos_token_id": base + 1}


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return _train()


def test_the_pattern_parts_rejoin_to_the_pattern() -> None:
    assert "|".join(_parts_of(KIMI_K2)) == KIMI_K2 and len(_parts_of(KIMI_K2)) == 8


def test_kvs_read_back_by_gguf(ranks: dict[bytes, int], tmp_path: Path) -> None:
    root = _source(tmp_path / "kimi", ranks)
    assert V.tokenizer_refusal(_reader(root)) is None
    kvs = V.tokenizer_kvs(_reader(root), _config(ranks))
    path = tmp_path / "kimi.gguf"
    path.write_bytes(header_bytes([], [KV("general.architecture", VType.STRING, "deepseek2"), *kvs]))
    f = {n: x.contents() for n, x in gguf.GGUFReader(path).fields.items() if not n.startswith("GGUF.")}
    base = len(ranks)
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "kimi-k2"
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == base + RESERVED
    assert tokens[base:base + len(NAMED)] == NAMED
    assert tokens[base + len(NAMED):] == [f"<|reserved_token_{i}|>" for i in range(base + len(NAMED), base + RESERVED)]
    assert types[:base] == [V.NORMAL] * base and types[base:] == [V.CONTROL] * RESERVED
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "\u0120"  # byte-level texts
    merges = f["tokenizer.ggml.merges"]  # those tiktoken's lowest-rank-first merging reaches, as the converter's
    assert MERGES // 2 < len(merges) <= MERGES and all(m.replace(" ", "") in tokens[:base] for m in merges)
    assert f["tokenizer.ggml.bos_token_id"] == base and f["tokenizer.ggml.eos_token_id"] == base + 1
    assert "<|im_user|>" in f["tokenizer.chat_template"]


def test_refusals_name_the_file(ranks: dict[bytes, int], tmp_path: Path) -> None:
    want = "a tokenizer.json with a byte-level BPE model, or Kimi-K2's tiktoken.model and tokenization_kimi.py, would work"
    root = _source(tmp_path / "nocode", ranks, code=False)
    line = V.tokenizer_refusal(_reader(root))
    assert line == f"tiktoken.model: a tiktoken vocabulary without tokenization_kimi.py, so its split pattern is unknown; {want}"
    with pytest.raises(InputError) as err:
        V.tokenizer_kvs(_reader(root), _config(ranks))
    assert str(err.value) == line
    other = KIMI_K2.replace(r"\p{N}{1,3}", r"\p{N}{1,2}")  # one character off
    root = _source(tmp_path / "other", ranks, pattern=other)
    assert V.tokenizer_refusal(_reader(root)) == (
        f"tokenization_kimi.py: its pat_str ({json.dumps(other)[:120]}) is not Kimi-K2's, the one llama.cpp "
        f"implements (kimi-k2); {want}")
    (root / "tokenization_kimi.py").write_text("pat_str = compute()\n")
    assert "its pat_str (none found)" in str(V.tokenizer_refusal(_reader(root)))
    code = _source(tmp_path / "twice", ranks) / "tokenization_kimi.py"
    code.write_text(code.read_text() + "\n    def __init__(self):\n        self.pat_str = other()\n")
    assert V.tokenizer_refusal(_reader(code.parent)) == (
        f"tokenization_kimi.py: pat_str is assigned 2 times, so which one the tokenizer uses is not read from the "
        f"file; {want}")
    root = _source(tmp_path / "gap", {t: r for t, r in ranks.items() if t != b"z"} | {b"z": len(ranks)})
    assert "ranks are not the ids" in str(V.tokenizer_refusal(_reader(root)))


def test_a_kimi_release_converts_and_verifies_with_its_tiktoken_vocabulary(
        ranks: dict[bytes, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DeepSeek-R1 NVFP4 replica as Kimi-K2 ships (model_type kimi_k2, tiktoken files, no tokenizer.json),
    its embedding as many rows as the vocabulary: planned, converted and verified through the CLI."""
    n = 400  # the trained ranks' first 400 (a prefix of BPE ranks is a BPE vocabulary)
    monkeypatch.setattr(deepseek, "VOCAB", n + RESERVED)
    src = deepseek.modelopt_nvfp4_r1(tmp_path / "kimi").path
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2", "bos_token_id": n,
                                                 "eos_token_id": n + 1}))
    assert not (src / "tokenizer.json").exists()
    _source(src, {t: r for t, r in ranks.items() if r < n})
    dst = tmp_path / "out"
    res = CliRunner().invoke(cli, ["convert", str(src), str(dst), "--to", "gguf", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    f = {k: x.contents() for k, x in gguf.GGUFReader(dst / "model.gguf").fields.items() if not k.startswith("GGUF.")}
    assert f["general.architecture"] == "deepseek2" and f["tokenizer.ggml.pre"] == "kimi-k2"
    assert len(f["tokenizer.ggml.tokens"]) == n + RESERVED and f["tokenizer.ggml.tokens"][n] == NAMED[0]
    assert f["tokenizer.ggml.bos_token_id"] == n
    res = CliRunner().invoke(cli, ["verify", str(src), str(dst), "--device", "cpu"])
    assert res.exit_code == 0, res.output


@pytest.mark.gguf
def test_llama_cpp_tokenizes_like_tiktoken(ranks: dict[bytes, int], tmp_path: Path) -> None:
    py = llama_python()
    if py is None:
        if os.environ.get("MXFP4CONV_REQUIRE_LLAMA"):
            pytest.fail("MXFP4CONV_REQUIRE_LLAMA is set but no llama-cpp-python (MXFP4CONV_LLAMA_PYTHON, .venv-llama)")
        pytest.skip("no llama-cpp-python: set MXFP4CONV_LLAMA_PYTHON or make .venv-llama")
    root = _source(tmp_path / "kimi", ranks)
    path = tmp_path / "kimi.gguf"
    path.write_bytes(header_bytes([], [KV("general.architecture", VType.STRING, "deepseek2"),
                                       *V.tokenizer_kvs(_reader(root), _config(ranks))]))
    base = len(ranks)
    specials = {t: base + i for i, t in enumerate(NAMED)}
    specials |= {f"<|reserved_token_{i}|>": i for i in range(base + len(NAMED), base + RESERVED + 2)}
    enc = tiktoken.Encoding(name="kimi", pat_str=KIMI_K2, mergeable_ranks=ranks, special_tokens=specials)
    want = [enc.encode(t, allowed_special="all") for t in TEXTS]
    assert any(len(w) < len(t.encode()) for w, t in zip(want, TEXTS, strict=True))  # the merges are used
    (tmp_path / "cases.json").write_text(json.dumps([{"name": "kimi", "gguf": str(path), "texts": TEXTS}]))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([py, "-c", RUNNER, str(tmp_path / "cases.json")], capture_output=True, text=True,
                          env=env, timeout=120)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, f"llama.cpp rc={proc.returncode}:\n{proc.stderr[-3000:]}"
    got = json.loads(line[len("RESULT"):])["kimi"]
    for text, w, ids, back in zip(TEXTS, want, got["ids"], got["back"], strict=True):
        assert ids == w, (text, ids, w)
        assert back == text, text
