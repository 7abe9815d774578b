"""``targets/gguf_vocab``: the tokenizer as GGUF metadata, read back by the ``gguf`` package and by llama.cpp.

The sources are tiny byte-level BPE tokenizers trained here with the ``tokenizers`` library, one per
pre-tokenizer llama.cpp implements (their split patterns exactly as the hub's tokenizer.json files hold them).
The runtime test loads each KV-only GGUF in llama.cpp (llama-cpp-python, its own venv: ``MXFP4CONV_LLAMA_PYTHON``,
else ``.venv-llama``; absent -> skipped unless ``MXFP4CONV_REQUIRE_LLAMA``) and compares its token ids with the
``tokenizers`` library's on text chosen to cross every split rule: digits, contractions, CJK, Cyrillic, emoji,
whitespace runs, CR/LF, and the special tokens.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mxfp4conv.errors import InputError
from mxfp4conv.sources.gguf import KV, VType, header_bytes
from mxfp4conv.targets import gguf_vocab as V

REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = "<tool_call>"  # an added token not marked special: user-defined in llama.cpp
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = [
    "Hello world, this is a test of the tokenizer. It's what we'll use; they've said I'd go, HE'LL SEE.",
    "The quick brown fox jumps over the lazy dog 1234567890 times, 3.14159 and 2,718 and 10000000.",
    "数字と漢字のテスト、そして한국어 문장도 있어요. 中文分词测试。 Привет, мир! Ünïcödé façade naïve",
    "  leading spaces,\ttabs,\nnewlines\r\nand   runs   of   spaces  \n\n\n",
    "def main():\n    return {'key': [1, 2, 3]}  # code\n\n\nprint(main())  🙂🌊 emoji",
    # digit runs merge (so splitting digits one by one, by threes or whole tells the patterns apart), and
    # combining marks (decomposed accents, Devanagari vowel signs) that only some patterns keep with letters
    "2024 2025 1234 123456 999 100 1000 10000 12 34 56 78 90 123 456 789 4567 89012",
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301 नमस्ते हिन्दी भाषा कि कु के",
] * 8
TEXTS = [
    "Hello world, it's 12345 and 3.14!",
    "I'VE been told he'll SEE 1000000 things in 2024, 123456789",
    "x\u0301\u0302y ÉCOLE école Straße ǅungla ＡＢＣ ａｂｃ",
    "数字と漢字 中文 한국어 Привет мир façade 🙂🌊🦓",
    "  runs   of\n\n\tspaces  \r\n end   ",
    "def f(x):\n    return [x, x*2]  # ok\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<tool_call>{}<|endoftext|>",
    "",
    " ",
    "\n\n\n",
]
# Combining marks after a letter (decomposed accents, Devanagari vowel signs): o200k's tokenizer.json pattern
# keeps them with the letter ([\p{Ll}\p{Lm}\p{Lo}\p{M}]+); llama.cpp's gpt-4o rewrite of it
# (((?=[\p{L}])([^A-Z]))+) does not, so llama.cpp splits them off. The converter writes "gpt-4o" all the same
# (as do the published GPT-OSS GGUFs); asserted as a divergence so that a llama.cpp fix shows here.
MARKS = "cafe\u0301 nai\u0308ve नमस्ते हिन्दी"
DIVERGES = {("gpt-4o", MARKS)}


def _isolated(*patterns: str) -> list[pre_tokenizers.PreTokenizer]:
    return [pre_tokenizers.Split(Regex(p), "isolated") for p in patterns]


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


# one source per pre-tokenizer name: (pre_tokenizer steps, config.json model_type)
PRES: dict[str, tuple[Callable[[], list[pre_tokenizers.PreTokenizer]], str]] = {
    "qwen2": (lambda: [*_isolated(V.QWEN2), _byte_level(False)], "qwen3_moe"),
    "gpt-2": (lambda: [_byte_level(True)], "gpt2"),
    "deepseek-v3": (lambda: [*_isolated(*V.DEEPSEEK3), _byte_level(False)], "deepseek_v3"),
    "gpt-4o": (lambda: [*_isolated(V.GPT4O), _byte_level(False)], "gpt_oss"),
    "llama-bpe": (lambda: [*_isolated(V.LLAMA3), _byte_level(False)], "llama"),
    "glm4": (lambda: [*_isolated(V.LLAMA3), _byte_level(False)], "glm4_moe"),
    "starcoder": (lambda: [pre_tokenizers.Digits(individual_digits=True), _byte_level(True)], "granitemoe"),
}


@functools.cache
def _vocab() -> str:
    """One vocabulary for every pre-tokenizer, trained unsplit so that its merges cross digit runs, marks and
    case changes: the patterns then give different ids wherever they split differently."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _byte_level(False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([USER])
    return str(tok.to_str())


def _train(steps: list[pre_tokenizers.PreTokenizer], post: processors.PostProcessor | None = None) -> Tokenizer:
    tok = Tokenizer.from_str(_vocab())
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    if post is not None:
        tok.post_processor = post
    return tok


def _save(root: Path, tok: Tokenizer, tc: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    if tc is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tc))
    return root


def _reader(root: Path) -> V.Read:
    def read(name: str) -> bytes | None:
        p = root / name
        return p.read_bytes() if p.is_file() else None
    return read


def _edit(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    p = root / "tokenizer.json"
    j = json.loads(p.read_text())
    change(j)
    p.write_text(json.dumps(j, ensure_ascii=False))


QWEN_TC = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"},
           "unk_token": None, "chat_template": TEMPLATE, "add_bos_token": True}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer]:
    tok = _train(PRES["qwen2"][0]())
    return _save(tmp_path_factory.mktemp("qwen"), tok, QWEN_TC), tok


def _gguf(path: Path, kvs: list[KV], arch: str = "qwen3moe") -> Path:
    # a KV-only GGUF: llama.cpp's vocab_only load reads general.architecture and the tokenizer keys only
    path.write_bytes(header_bytes([], [KV("general.architecture", VType.STRING, arch), *kvs]))
    return path


def _fields(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(path)
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


# ---- the metadata, read back by the gguf package


def test_kvs_read_back_by_gguf(qwen: tuple[Path, Tokenizer], tmp_path: Path) -> None:
    root, tok = qwen
    read = _reader(root)
    assert V.tokenizer_refusal(read) is None
    n_vocab = tok.get_vocab_size(with_added_tokens=True) + 7  # config pads the embedding past the tokenizer
    f = _fields(_gguf(tmp_path / "v.gguf", V.tokenizer_kvs(read, {"vocab_size": n_vocab, "model_type": "qwen3"})))

    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == "qwen2"
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == n_vocab
    inverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    assert tokens[:len(inverse)] == [inverse[i] for i in range(len(inverse))]
    assert tokens[len(inverse):] == [f"[PAD{i}]" for i in range(len(inverse), n_vocab)]
    for i, text in enumerate(tokens):
        want = 3 if text in SPECIALS else 4 if text == USER else 5 if text.startswith("[PAD") else 1
        assert types[i] == want, (i, text)

    merges = json.loads((root / "tokenizer.json").read_text())["model"]["merges"]
    assert f["tokenizer.ggml.merges"] == [f"{a} {b}" for a, b in merges]
    assert f["tokenizer.ggml.eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert f["tokenizer.ggml.padding_token_id"] == tok.token_to_id("<|endoftext|>")
    assert "tokenizer.ggml.bos_token_id" not in f and "tokenizer.ggml.unknown_token_id" not in f
    # the ByteLevel post-processor adds nothing, and wins over tokenizer_config.json's add_bos_token
    assert f["tokenizer.ggml.add_bos_token"] is False and f["tokenizer.ggml.add_eos_token"] is False
    assert f["tokenizer.chat_template"] == TEMPLATE
    assert gguf.GGUFReader(tmp_path / "v.gguf").fields["tokenizer.ggml.eos_token_id"].types == [
        gguf.GGUFValueType.UINT32]


def test_merges_as_strings_and_template_file(qwen: tuple[Path, Tokenizer], tmp_path: Path) -> None:
    root, _ = qwen
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    _edit(src, lambda j: j["model"].update(merges=[" ".join(m) for m in j["model"]["merges"]]))
    # transformers 5 keeps the template beside the config, and names tokens by id in config.json only
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    (src / "chat_template.jinja").write_text(TEMPLATE)
    config = {"eos_token_id": 2, "bos_token_id": [1, 2], "model_type": "qwen3"}
    got = {kv.key: kv for kv in V.tokenizer_kvs(_reader(src), config)}
    want = {kv.key: kv for kv in V.tokenizer_kvs(_reader(root), {})}
    assert got["tokenizer.ggml.merges"] == want["tokenizer.ggml.merges"]
    assert got["tokenizer.ggml.tokens"] == want["tokenizer.ggml.tokens"]  # no config vocab_size: no padding
    assert got["tokenizer.chat_template"].value == TEMPLATE
    assert got["tokenizer.ggml.eos_token_id"].value == 2
    assert "tokenizer.ggml.bos_token_id" not in got  # an id list is not one id


@pytest.mark.parametrize("pre", sorted(PRES))
def test_pre_tokenizer_names(pre: str, tmp_path: Path) -> None:
    steps, model_type = PRES[pre]
    root = _save(tmp_path, _train(steps()), {})
    assert V.tokenizer_refusal(_reader(root)) is None
    kvs = {kv.key: kv.value for kv in V.tokenizer_kvs(_reader(root), {"model_type": model_type})}
    assert kvs["tokenizer.ggml.pre"] == pre
    assert "tokenizer.chat_template" not in kvs


def test_template_post_processor_adds_bos(tmp_path: Path) -> None:
    post = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
                                         special_tokens=[("<|endoftext|>", 0)])
    root = _save(tmp_path, _train(PRES["llama-bpe"][0](), post), {"bos_token": "<|endoftext|>"})
    kvs = {kv.key: kv.value for kv in V.tokenizer_kvs(_reader(root), {"model_type": "llama"})}
    assert kvs["tokenizer.ggml.add_bos_token"] is True and kvs["tokenizer.ggml.add_eos_token"] is False
    assert kvs["tokenizer.ggml.bos_token_id"] == 0


def test_chat_template_list(qwen: tuple[Path, Tokenizer], tmp_path: Path) -> None:
    root, _ = qwen
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    tc = {"chat_template": [{"name": "default", "template": "A"}, {"name": "tool-use", "template": "B"}]}
    (src / "tokenizer_config.json").write_text(json.dumps(tc))
    kvs = {kv.key: kv.value for kv in V.tokenizer_kvs(_reader(src), {})}
    assert kvs["tokenizer.chat_template"] == "A"
    assert kvs["tokenizer.chat_template.tool_use"] == "B"
    assert kvs["tokenizer.chat_templates"] == ["tool_use"]


# ---- refusals: one exact line each


def _wordlevel(root: Path) -> Path:
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return _save(root, tok, {})


WANT = "a tokenizer.json with a byte-level BPE model would work"


def test_refuses_wordlevel(tmp_path: Path) -> None:
    assert V.tokenizer_refusal(_reader(_wordlevel(tmp_path))) == (
        f"tokenizer.json: a WordLevel model, which llama.cpp's gpt2 vocabulary cannot hold; {WANT}")


def test_refuses_unknown_regex(qwen: tuple[Path, Tokenizer], tmp_path: Path) -> None:
    root, _ = qwen
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    # Qwen's pattern with \p{N}{1,2}: one character off every pattern llama.cpp has
    _edit(src, lambda j: j["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(
        Regex=V.QWEN2.replace(r"\p{N}|", r"\p{N}{1,2}|")))
    line = V.tokenizer_refusal(_reader(src))
    assert line == (
        "tokenizer.json: pre-tokenizer splits with "
        + json.dumps([V.QWEN2.replace(r"\p{N}|", r"\p{N}{1,2}|")])[:160]
        + ", not one llama.cpp implements; " + WANT + " and a pre-tokenizer llama.cpp knows (one of deepseek-v3, "
        "glm4, gpt-2, gpt-4o, llama-bpe, qwen2, qwen35, starcoder, tekken)")
    with pytest.raises(InputError) as err:
        V.tokenizer_kvs(_reader(src), {})
    assert str(err.value) == line


def test_refuses_missing_tokenizer_json(tmp_path: Path) -> None:
    tail = f"; {WANT} (save one with transformers' AutoTokenizer.save_pretrained)"
    assert V.tokenizer_refusal(_reader(tmp_path)) == f"tokenizer.json: absent, the source has no tokenizer{tail}"
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    assert V.tokenizer_refusal(_reader(tmp_path)) == (
        f"tokenizer.model: a SentencePiece model only, no tokenizer.json{tail}")
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")
    assert V.tokenizer_refusal(_reader(tmp_path)) == (
        f"tokenizer.model: a tiktoken vocabulary only, no tokenizer.json{tail}")


def test_refuses_config_vocab_smaller_than_tokenizer(qwen: tuple[Path, Tokenizer]) -> None:
    root, _ = qwen
    with pytest.raises(InputError, match=r"outside config\.json's vocab_size 100"):
        V.tokenizer_kvs(_reader(root), {"vocab_size": 100})


# ---- llama.cpp itself

RUNNER = r"""
import json, sys
import llama_cpp
out = {}
for case in json.load(open(sys.argv[1])):
    m = llama_cpp.Llama(model_path=case["gguf"], vocab_only=True, verbose=False)
    ids = [m.tokenize(t.encode(), add_bos=False, special=True) for t in case["texts"]]
    back = [m.detokenize(i, special=True).decode("utf-8", "replace") for i in ids]
    out[case["name"]] = {"ids": ids, "back": back, "add_bos": m._model.add_bos_token()}
print("RESULT" + json.dumps(out))
"""


def llama_python() -> str | None:
    env = os.environ.get("MXFP4CONV_LLAMA_PYTHON")
    if env:
        return env
    cand = REPO / ".venv-llama" / "bin" / "python"
    return str(cand) if cand.exists() else None


@pytest.mark.gguf
def test_llama_cpp_tokenizes_like_hf(tmp_path: Path) -> None:
    py = llama_python()
    if py is None:
        if os.environ.get("MXFP4CONV_REQUIRE_LLAMA"):
            pytest.fail("MXFP4CONV_REQUIRE_LLAMA is set but no llama-cpp-python (MXFP4CONV_LLAMA_PYTHON, .venv-llama)")
        pytest.skip("no llama-cpp-python: set MXFP4CONV_LLAMA_PYTHON or make .venv-llama")
    cases, hf = [], {}
    for pre, (steps, model_type) in PRES.items():
        tok = _train(steps())
        root = _save(tmp_path / pre, tok, QWEN_TC)
        path = _gguf(tmp_path / f"{pre}.gguf", V.tokenizer_kvs(_reader(root), {"model_type": model_type}))
        assert _fields(path)["tokenizer.ggml.pre"] == pre
        cases.append({"name": pre, "gguf": str(path), "texts": [*TEXTS, MARKS]})
        hf[pre] = [tok.encode(t).ids for t in [*TEXTS, MARKS]]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([py, "-c", RUNNER, str(tmp_path / "cases.json")], capture_output=True, text=True,
                          env=env, timeout=120)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, f"llama.cpp rc={proc.returncode}:\n{proc.stderr[-3000:]}"
    got = json.loads(line[len("RESULT"):])
    for pre in PRES:
        for text, want, ids, back in zip([*TEXTS, MARKS], hf[pre], got[pre]["ids"], got[pre]["back"], strict=True):
            assert (ids != want) if (pre, text) in DIVERGES else (ids == want), (pre, text, ids, want)
            assert back == text, (pre, text)
        assert got[pre]["add_bos"] is False, pre  # written from the ByteLevel post-processor
