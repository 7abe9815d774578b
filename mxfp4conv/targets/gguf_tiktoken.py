"""A tiktoken vocabulary (Kimi-K2's ``tiktoken.model`` + ``tokenization_kimi.py``) as GGUF tokenizer entries.

Kimi-K2 and its successors ship no tokenizer.json: their tokenizer is remote code that builds a tiktoken
``Encoding`` from ``tiktoken.model`` (one ``<base64 bytes> <rank>`` line per token, ranks being ids), a split
pattern (the class attribute ``pat_str``) and special tokens (``num_reserved_special_tokens`` + 2 ids after the
ranks, named by tokenizer_config.json's ``added_tokens_decoder``, ``<|reserved_token_N|>`` otherwise).
llama.cpp implements that one pattern under the pre-tokenizer name ``kimi-k2`` (``src/unicode.cpp`` quotes it),
and its converter writes the ranks as a byte-level BPE vocabulary with merges recovered from them
(``conversion/deepseek.py`` ``set_vocab``, ``QwenModel.bpe``). Here the remote code is read, never run:
its ``pat_str`` must be that pattern exactly, as parsed from the file's syntax tree, or the source is refused.
"""

from __future__ import annotations

import ast
import base64
import binascii
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["KIMI_K2", "TIKTOKEN_MODEL", "TOKENIZER_CODE", "TiktokenVocab", "tiktoken_vocab"]

TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CODE = "tokenization_kimi.py"
# The split pattern llama.cpp's kimi-k2 pre-tokenizer implements (its unicode.cpp quotes this string).
KIMI_K2 = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
WANT = "a tokenizer.json with a byte-level BPE model, or Kimi-K2's tiktoken.model and tokenization_kimi.py, would work"

Read = Callable[[str], bytes | None]


class Refused(Exception):
    """One line: the file and why its vocabulary cannot be written exactly."""


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE's token texts)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _class_constants(code: bytes) -> tuple[str | None, int | None]:
    """``pat_str`` (a string, or ``"|".join([...strings])``) and ``num_reserved_special_tokens`` of the file's
    classes, read from its syntax tree."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError) as e:
        raise Refused(f"{TOKENIZER_CODE}: not Python ({e}); {WANT}") from e
    found: dict[str, list[ast.expr | None]] = {"pat_str": [], "num_reserved_special_tokens": []}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign | ast.AugAssign) else []
        for t in targets:
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name in found:  # self.pat_str = ... counts too: the code could replace the class's pattern
                found[name].append(node.value if isinstance(node, ast.Assign) and len(targets) == 1 else None)
    for name, values in found.items():
        if len(values) > 1:
            raise Refused(f"{TOKENIZER_CODE}: {name} is assigned {len(values)} times, so which one the tokenizer "
                          f"uses is not read from the file; {WANT}")
    pat, res = (v[0] if v else None for v in found.values())
    reserved = res.value if isinstance(res, ast.Constant) and type(res.value) is int else None
    return (None if pat is None else _string(pat)), reserved


def _string(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.List | ast.Tuple)):
        parts = [_string(e) for e in node.args[0].elts]
        if all(p is not None for p in parts):
            return node.func.value.value.join(p for p in parts if p is not None)
    return None


def _ranks(raw: bytes) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (IndexError, ValueError, binascii.Error) as e:
            raise Refused(f"{TIKTOKEN_MODEL}: line {n} is not '<base64 token> <rank>'") from e
        if len(parts) != 2 or not token or rank < 0 or token in ranks:
            raise Refused(f"{TIKTOKEN_MODEL}: line {n} is not '<base64 token> <rank>' of a new token")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise Refused(f"{TIKTOKEN_MODEL}: ranks are not the ids 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise Refused(f"{TIKTOKEN_MODEL}: not every single byte is a token, so not every text can be encoded")
    return ranks


def _parts(ranks: Mapping[bytes, int], token: bytes, below: int) -> list[bytes]:
    """``token`` split by applying, lowest rank first, the merges of rank below ``below`` (tiktoken's BPE)."""
    parts = [bytes([b]) for b in token]
    while True:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < below and (best is None or r < best):
                best, at = r, i
        if best is None:
            return parts
        parts[at:at + 2] = [parts[at] + parts[at + 1]]


@functools.lru_cache(maxsize=2)
def _bpe(raw: bytes) -> tuple[dict[bytes, int], dict[bytes, str], list[str]]:
    """The ranks, each token's byte-level text and the merges recovered from the ranks (seconds for a
    160k-token vocabulary: computed once per run, though planning and writing both ask; read only)."""
    ranks = _ranks(raw)
    chars = _byte_chars()
    text_of = {token: "".join(chars[b] for b in token) for token in ranks}
    merges = []
    for token, rank in ranks.items():
        if len(token) > 1 and len(pair := _parts(ranks, token, rank)) == 2:
            merges.append(f"{text_of[pair[0]]} {text_of[pair[1]]}")
    return ranks, text_of, merges


class TiktokenVocab:
    """Token texts, types, merges and the special-token table of a Kimi-K2 tiktoken vocabulary."""

    def __init__(self, texts: list[str], types: list[int], merges: list[str], specials: dict[str, int]) -> None:
        self.texts, self.types, self.merges, self.specials = texts, types, merges, specials


def tiktoken_vocab(read: Read, tc: Mapping[str, Any], vocab_size: int | None, types: tuple[int, int, int]
                   ) -> TiktokenVocab | None:
    """The vocabulary of a source with ``tiktoken.model`` and no tokenizer.json, as llama.cpp's converter writes
    it (``types``: llama.cpp's normal, control and unused token types); None when the source has no
    tiktoken.model. Raises ``Refused`` for one llama.cpp would not tokenize as the source does."""
    raw = read(TIKTOKEN_MODEL)
    if raw is None:
        return None
    code = read(TOKENIZER_CODE)
    if code is None:
        raise Refused(f"{TIKTOKEN_MODEL}: a tiktoken vocabulary without {TOKENIZER_CODE}, so its split pattern is "
                      f"unknown; {WANT}")
    pattern, reserved = _class_constants(code)
    if pattern != KIMI_K2:
        shown = "none found" if pattern is None else json.dumps(pattern)[:120]
        raise Refused(f"{TOKENIZER_CODE}: its pat_str ({shown}) is not Kimi-K2's, the one llama.cpp implements "
                      f"(kimi-k2); {WANT}")
    if reserved is None or reserved < 0:
        raise Refused(f"{TOKENIZER_CODE}: no num_reserved_special_tokens integer; {WANT}")
    ranks, text_of, merges = _bpe(raw)
    names = {}
    for k, v in (tc.get("added_tokens_decoder") or {}).items():
        content = v.get("content") if isinstance(v, dict) else v
        if isinstance(content, str) and str(k).isdigit():
            names[int(k)] = content
    base = len(ranks)
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + reserved + 2)}
    by_id = {rank: text_of[token] for token, rank in ranks.items()} | {i: t for t, i in specials.items()}
    n = vocab_size if vocab_size is not None else max(by_id) + 1
    normal, control, unused = types
    texts = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    if len(set(texts)) != n:
        raise Refused(f"{TOKENIZER_CODE}: a special token's text is also a vocabulary token's; llama.cpp needs "
                      f"distinct token texts")
    special_ids = set(specials.values())
    kinds = [unused if i not in by_id else control if i in special_ids else normal for i in range(n)]
    return TiktokenVocab(texts, kinds, list(merges), specials)
