"""The source's tokenizer as GGUF ``tokenizer.*`` metadata, the way llama.cpp reads it back.

llama.cpp tokenizes from the GGUF alone: ``tokenizer.ggml.model`` ("gpt2": byte-level BPE), a pre-tokenizer
*name* (``tokenizer.ggml.pre``) that selects split regexes compiled into llama.cpp (``src/llama-vocab.cpp``),
the token texts in id order with a type per token (control and user-defined tokens are matched whole before
BPE), the merges by rank, the special-token ids, whether BOS/EOS are added, and the chat template.
Nothing of the tokenizer.json's own pre-tokenizer travels, so a source is written only when its pre-tokenizer
is one llama.cpp implements under some name; the regexes are compared as strings, exactly, and anything else
(another model type, a normalizer llama.cpp lacks, an unknown regex) is refused with a one-line reason rather
than approximated (Kimi-K2's tiktoken vocabulary, which has no tokenizer.json, is read by
``targets/gguf_tiktoken.py``). The entries follow llama.cpp's own converter (``convert_hf_to_gguf.py``: ``get_vocab_base``,
``_set_vocab_gpt2``, ``gguf.SpecialVocab``) so that a GGUF written here reads like one written there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from mxfp4conv.errors import InputError
from mxfp4conv.sources.gguf import KV, VType
from mxfp4conv.targets.gguf_tiktoken import Refused as _Refused
from mxfp4conv.targets.gguf_tiktoken import TiktokenVocab, tiktoken_vocab

__all__ = ["PRE_TOKENIZERS", "Read", "tokenizer_kvs", "tokenizer_refusal"]

Read = Callable[[str], bytes | None]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
WANT = "a tokenizer.json with a byte-level BPE model would work"

# llama.cpp's token types (llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# What ByteLevel(use_regex=true) splits with (the tokenizers library's GPT-2 pattern).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# The tokenizer.json strings llama.cpp's pre types stand for ("original regex from tokenizer.json" there;
# llama.cpp compiles a rewritten but equivalent form of the case-insensitive groups).
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3 holds literal CR and LF characters (and literal CJK ranges) in its patterns, as llama.cpp does.
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
LLAMA3_LIKE = "llama-bpe"  # resolved to "glm4" for GLM configs (same regex, llama.cpp defaults differ)

# The split patterns of a pre-tokenizer, in order -> the tokenizer.ggml.pre name llama.cpp maps to them.
PRE_TOKENIZERS: dict[tuple[str, ...], str] = {
    (GPT2,): "gpt-2",
    (r"\p{N}", GPT2): "starcoder",  # Digits(individual_digits) before ByteLevel(use_regex): StarCoder, Granite
    (QWEN2,): "qwen2",
    (QWEN35,): "qwen35",
    (LLAMA3,): LLAMA3_LIKE,
    (GPT4O,): "gpt-4o",
    (TEKKEN,): "tekken",
    DEEPSEEK3: "deepseek-v3",
}

# Added tokens the converter types as control though the source does not mark them special.
_LOOKS_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")

# tokenizer_config.json's <typ>_token -> the GGUF key of its id (SpecialVocab's types that llama.cpp reads).
_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                 "sep": "seperator_token_id", "pad": "padding_token_id", "mask": "mask_token_id"}
_ADD_KEYS = ("bos", "eos", "sep")



def _json(read: Read, name: str) -> Any:
    raw = read(name)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Refused(f"{name}: not valid JSON ({e})") from e


def _no_tokenizer_json(read: Read) -> str:
    """Why a source without tokenizer.json is refused, naming what it has instead."""
    tail = f"; {WANT} (save one with transformers' AutoTokenizer.save_pretrained)"
    if read("tokenizer.tiktoken") is not None:  # (tiktoken.model is Kimi-K2's: targets/gguf_tiktoken.py)
        return f"tokenizer.tiktoken: a tiktoken vocabulary, not a Hugging Face fast tokenizer{tail}"
    sp = read("tokenizer.model")
    if sp is not None:
        # Llama-3 and Kimi ship tiktoken ranks ("<base64> <rank>" lines) under this name too.
        head = sp[:200].split(b"\n", 1)[0]
        kind = "a tiktoken vocabulary" if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", head) else "a SentencePiece model"
        return f"tokenizer.model: {kind} only, no tokenizer.json{tail}"
    if read("vocab.json") is not None:
        return f"vocab.json: a slow tokenizer's vocabulary only, no tokenizer.json{tail}"
    return f"{TOKENIZER_JSON}: absent, the source has no tokenizer{tail}"


def _split_patterns(pre: Any) -> tuple[str, ...]:
    """The regexes a tokenizer.json pre_tokenizer splits with, in order; ByteLevel must end it."""
    where = f"{TOKENIZER_JSON}: pre_tokenizer"
    if not isinstance(pre, dict):
        raise _Refused(f"{where} is {json.dumps(pre)}, not byte-level; {WANT}")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
        raise _Refused(f"{where} is a malformed Sequence; {WANT}")
    last = steps[-1]
    if last.get("type") != "ByteLevel":
        raise _Refused(f"{where} does not end with ByteLevel (it ends with {last.get('type')}); {WANT}")
    if last.get("add_prefix_space"):
        raise _Refused(f"{where} ByteLevel adds a prefix space, which llama.cpp's BPE does not; {WANT}")
    out: list[str] = []
    for step in steps[:-1]:
        kind = step.get("type")
        if kind == "Split":
            pattern = step.get("pattern") or {}
            if "Regex" not in pattern or step.get("behavior") != "Isolated" or step.get("invert"):
                raise _Refused(f"{where} has a Split llama.cpp does not implement (only an isolating regex Split "
                               f"is, not {json.dumps(step)[:120]}); {WANT}")
            out.append(pattern["Regex"])
        elif kind == "Digits":
            out.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
        else:
            raise _Refused(f"{where} has a {kind} step, which llama.cpp does not implement; {WANT}")
    if last.get("use_regex", True):
        out.append(GPT2)
    return tuple(out)


def _check(tok: Any, tc: Mapping[str, Any]) -> str:
    """The pre-tokenizer name of a tokenizer.json llama.cpp tokenizes exactly, or raise _Refused."""
    if not isinstance(tok, dict) or not isinstance(tok.get("model"), dict):
        raise _Refused(f"{TOKENIZER_JSON}: no model object; {WANT}")
    model = tok["model"]
    if model.get("type") != "BPE":
        raise _Refused(f"{TOKENIZER_JSON}: a {model.get('type')} model, which llama.cpp's gpt2 vocabulary cannot "
                       f"hold; {WANT}")
    if model.get("byte_fallback") or model.get("dropout") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        raise _Refused(f"{TOKENIZER_JSON}: a BPE model with byte_fallback, dropout or subword affixes "
                       f"(SentencePiece-style), which llama.cpp's byte-level BPE does not do; {WANT}")
    if not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges", []), list):
        raise _Refused(f"{TOKENIZER_JSON}: BPE model without a vocab object and merges list; {WANT}")
    decoder = tok.get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    if [d.get("type") for d in parts] != ["ByteLevel"]:
        raise _Refused(f"{TOKENIZER_JSON}: decoder {json.dumps(decoder)[:80]} is not ByteLevel; {WANT}")
    norm = tok.get("normalizer") or None
    if norm is not None and not isinstance(norm, dict):
        raise _Refused(f"{TOKENIZER_JSON}: malformed normalizer; {WANT}")
    # llama.cpp does no NFC either; the converter writes Qwen's NFC tokenizers all the same (text already in NFC,
    # nearly all text, tokenizes identically).
    if norm is not None and norm.get("type") != "NFC":
        raise _Refused(f"{TOKENIZER_JSON}: normalizer {norm.get('type')}, which llama.cpp's byte-level BPE does not "
                       f"apply; {WANT} and no normalizer")
    for t in tok.get("added_tokens") or []:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            raise _Refused(f"{TOKENIZER_JSON}: added token {t.get('content')!r} strips or matches single words, "
                           f"which llama.cpp does not read from GGUF; {WANT} and plain added tokens")
    _post_processor(tok.get("post_processor"), tc)  # refuses what GGUF cannot express
    patterns = _split_patterns(tok.get("pre_tokenizer"))
    if patterns not in PRE_TOKENIZERS:
        shown = json.dumps(list(patterns), ensure_ascii=False)
        raise _Refused(f"{TOKENIZER_JSON}: pre-tokenizer splits with {shown[:160]}, not one llama.cpp implements; "
                       f"{WANT} and a pre-tokenizer llama.cpp knows (one of "
                       f"{', '.join(sorted(set(PRE_TOKENIZERS.values()) | {'glm4'}))})")
    return PRE_TOKENIZERS[patterns]


def tokenizer_refusal(read: Read) -> str | None:
    """Why the source's tokenizer cannot be written into GGUF exactly (one line naming the file and what would
    work), or None."""
    try:
        tok = _json(read, TOKENIZER_JSON)
        if tok is None:
            return None if _tiktoken(read, _json(read, TOKENIZER_CONFIG) or {}, None) else _no_tokenizer_json(read)
        _check(tok, _json(read, TOKENIZER_CONFIG) or {})
        _tokens(tok, None)
    except _Refused as e:
        return " ".join(str(e).split())
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"{TOKENIZER_JSON}: malformed ({type(e).__name__}: {e}); {WANT}"
    return None


def _tiktoken(read: Read, tc: Mapping[str, Any], vocab_size: int | None) -> TiktokenVocab | None:
    return tiktoken_vocab(read, tc, vocab_size, (NORMAL, CONTROL, UNUSED))


def _looks_special(text: str) -> bool:
    """The converter's does_token_look_special: added tokens typed control though not marked special."""
    return (text in _LOOKS_SPECIAL or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _tokens(tok: Mapping[str, Any], vocab_size: int | None) -> tuple[list[str], list[int]]:
    """Token texts in id order and their llama.cpp types, gaps filled as the converter does."""
    by_id: dict[int, tuple[str, int]] = {i: (text, NORMAL) for text, i in tok["model"]["vocab"].items()}
    for t in tok.get("added_tokens") or []:
        text = t["content"]
        # Kept verbatim: the converter's U+2581 -> space rewrite of user-defined tokens is for SentencePiece-style
        # vocabularies; a byte-level BPE matches an added token's text as written.
        by_id[int(t["id"])] = (text, CONTROL if t.get("special") or _looks_special(text) else USER_DEFINED)
    n = max(by_id) + 1 if by_id else 0
    if vocab_size is not None:
        if vocab_size < n:
            raise InputError(f"token id {n - 1} is outside config.json's vocab_size {vocab_size}", file=TOKENIZER_JSON,
                             hint="a config whose vocab_size covers every token id")
        n = vocab_size
    texts = [by_id[i][0] if i in by_id else f"[PAD{i}]" for i in range(n)]
    seen: dict[str, int] = {}
    for i, text in enumerate(texts):
        if text in seen:
            # llama.cpp keys its vocabulary by text and asserts one id per text
            raise _Refused(f"{TOKENIZER_JSON}: token {text!r} at ids {seen[text]} and {i}; llama.cpp needs distinct "
                           f"token texts")
        seen[text] = i
    return texts, [by_id[i][1] if i in by_id else UNUSED for i in range(n)]


def _merges(merges: list[Any]) -> list[str]:
    """Merges as llama.cpp reads them, "a b" (pairs' spaces as the byte-level space U+0120, as the converter)."""
    if all(isinstance(m, str) for m in merges):
        return list(merges)
    if all(isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) for s in m) for m in merges):
        return [" ".join(s.replace(" ", "\u0120") for s in m) for m in merges]
    raise InputError("merges are neither 'a b' strings nor [a, b] pairs", file=TOKENIZER_JSON)


def _content(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return str(entry["content"])
    return None


def _post_processor(post: Any, tc: Mapping[str, Any]) -> tuple[dict[str, bool], dict[str, str]]:
    """add_bos / add_eos as the post-processor implies (SpecialVocab's reading), and the BOS/EOS texts its
    template names where tokenizer_config.json names none; refuses what GGUF cannot say."""
    add: dict[str, bool] = {}
    implied: dict[str, str] = {}
    if not post:
        return add, implied
    where = f"{TOKENIZER_JSON}: post_processor"
    for p in post.get("processors", [post]) if post.get("type") == "Sequence" else [post]:
        kind = p.get("type")
        if kind == "ByteLevel":
            add.setdefault("bos", False)
            add.setdefault("eos", False)
        elif kind == "TemplateProcessing":
            single = p.get("single") or []
            bos, eos = _content(tc.get("bos_token")) or _content(tc.get("cls_token")), _content(tc.get("eos_token"))
            specials = [s["SpecialToken"]["id"] for s in single if "SpecialToken" in s]
            seq = [i for i, s in enumerate(single) if "Sequence" in s]
            if len(seq) != 1 or len(specials) != len(single) - 1 or seq[0] > 1 or len(single) - seq[0] > 2:
                raise _Refused(f"{where} template {json.dumps(single)[:120]} is more than an optional leading and "
                               f"trailing special token; llama.cpp adds only BOS and EOS")
            first = specials[0] if seq[0] == 1 else None
            last = single[-1]["SpecialToken"]["id"] if len(single) - seq[0] == 2 else None
            for typ, text, named in (("bos", first, bos), ("eos", last, eos)):
                if text is not None and named is not None and text != named:
                    raise _Refused(f"{where} adds {text!r}, which tokenizer_config.json does not name as its "
                                   f"{typ}_token; llama.cpp adds only BOS and EOS")
                if text is not None and named is None:
                    implied[typ] = text
                add[typ] = text is not None
        else:
            raise _Refused(f"{where} {kind} adds tokens llama.cpp does not; a ByteLevel or TemplateProcessing "
                           f"post-processor would work")
    return add, implied


def _special_ids(tok: Mapping[str, Any], tc: Mapping[str, Any], implied: Mapping[str, str],
                 config: Mapping[str, Any], n_vocab: int) -> dict[str, int]:
    """Special-token ids: tokenizer_config.json's tokens (or the post-processor's) resolved among the added
    tokens, then config.json's <typ>_token_id where those have none (SpecialVocab's order: the first found wins)."""
    tc = {**{f"{typ}_token": text for typ, text in implied.items()}, **{k: v for k, v in tc.items() if v}}
    if not _content(tc.get("bos_token")) and _content(tc.get("cls_token")):
        tc["bos_token"] = tc["cls_token"]
    if not _content(tc.get("eos_token")) and _content(tc.get("sep_token")):
        tc["eos_token"] = tc["sep_token"]
    added = tok.get("added_tokens") or []
    ids: dict[str, int] = {}
    for typ in _SPECIAL_KEYS:
        text = _content(tc.get(f"{typ}_token"))
        found = next((int(t["id"]) for t in added if t.get("content") == text), None) if text else None
        if found is None:
            cand = config.get(f"{typ}_token_id", (config.get("text_config") or {}).get(f"{typ}_token_id"))
            # a list (several EOS ids) is not written, as the converter; llama.cpp finds end-of-generation tokens
            # by their text
            found = cand if isinstance(cand, int) and not isinstance(cand, bool) else None
        if found is not None and 0 <= found < n_vocab:
            ids[typ] = found
    return ids


def _chat_templates(read: Read, tc: Mapping[str, Any]) -> list[KV]:
    """tokenizer_config.json's chat_template, else chat_template.jinja, else chat_template.json's."""
    if "chat_template" in tc:
        value = tc["chat_template"]
    elif (raw := read("chat_template.jinja")) is not None:
        value = raw.decode()
    else:
        value = (_json(read, "chat_template.json") or {}).get("chat_template")
    if isinstance(value, str):
        return [KV("tokenizer.chat_template", VType.STRING, value)]
    if not isinstance(value, list):
        return []
    out: list[KV] = []
    names: list[str] = []
    for choice in value:
        name = re.sub(r"[^A-Za-z0-9]", "_", str(choice.get("name", "")))
        template = choice.get("template")
        if not name or not isinstance(template, str):
            continue
        if name == "default":
            out.insert(0, KV("tokenizer.chat_template", VType.STRING, template))
        else:
            names.append(name)
            out.append(KV(f"tokenizer.chat_template.{name}", VType.STRING, template))
    if names:
        out.append(KV("tokenizer.chat_templates", VType.ARRAY, sorted(names), VType.STRING))
    return out


def _config_vocab_size(config: Mapping[str, Any]) -> int | None:
    n = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def tokenizer_kvs(read: Read, config: Mapping[str, Any]) -> list[KV]:
    """The tokenizer.* metadata llama.cpp reads, from tokenizer.json, tokenizer_config.json (and
    chat_template.jinja / generation_config.json where present).

    generation_config.json is read for nothing: llama.cpp's converter takes no token ids from it for these
    vocabularies (its EOS lists stay unwritten; llama.cpp finds <|im_end|>, <|return|>, ... by their text).
    Raises ``InputError`` with ``tokenizer_refusal``'s line for a tokenizer it refuses."""
    try:
        tok = _json(read, TOKENIZER_JSON)
        tc = _json(read, TOKENIZER_CONFIG) or {}
        if tok is None:
            if (tik := _tiktoken(read, tc, _config_vocab_size(config))) is None:
                raise _Refused(_no_tokenizer_json(read))
            return _tiktoken_kvs(read, tik, tc, config)
        pre = _check(tok, tc)
        texts, types = _tokens(tok, _config_vocab_size(config))
        add, implied = _post_processor(tok.get("post_processor"), tc)
    except _Refused as e:
        raise InputError(" ".join(str(e).split())) from None
    if pre == LLAMA3_LIKE and str(config.get("model_type", "")).startswith("glm"):
        pre = "glm4"  # GLM-4/4.5 split like Llama-3; llama.cpp's glm4 name keeps their BOS-less defaults
    kvs = [
        KV("tokenizer.ggml.model", VType.STRING, "gpt2"),
        KV("tokenizer.ggml.pre", VType.STRING, pre),
        KV("tokenizer.ggml.tokens", VType.ARRAY, texts, VType.STRING),
        KV("tokenizer.ggml.token_type", VType.ARRAY, types, VType.INT32),
        KV("tokenizer.ggml.merges", VType.ARRAY, _merges(tok["model"].get("merges", [])), VType.STRING),
    ]
    for typ, tid in _special_ids(tok, tc, implied, config, len(texts)).items():
        kvs.append(KV(f"tokenizer.ggml.{_SPECIAL_KEYS[typ]}", VType.UINT32, tid))
    for typ in _ADD_KEYS:
        # the post-processor wins over tokenizer_config.json's add_<typ>_token, as in SpecialVocab
        flag = add.get(typ, tc.get(f"add_{typ}_token"))
        if isinstance(flag, bool):
            kvs.append(KV(f"tokenizer.ggml.add_{typ}_token", VType.BOOL, flag))
    if tc:  # SpecialVocab reads chat templates only beside a tokenizer_config.json
        kvs += _chat_templates(read, tc)
    return kvs


def _tiktoken_kvs(read: Read, tik: TiktokenVocab, tc: Mapping[str, Any], config: Mapping[str, Any]) -> list[KV]:
    """Kimi-K2's vocabulary as its converter writes it: special ids from config.json (SpecialVocab finds no
    tokenizer.json added tokens to resolve tokenizer_config.json's texts among), add_* flags and chat
    templates from tokenizer_config.json."""
    kvs = [
        KV("tokenizer.ggml.model", VType.STRING, "gpt2"),
        KV("tokenizer.ggml.pre", VType.STRING, "kimi-k2"),
        KV("tokenizer.ggml.tokens", VType.ARRAY, tik.texts, VType.STRING),
        KV("tokenizer.ggml.token_type", VType.ARRAY, tik.types, VType.INT32),
        KV("tokenizer.ggml.merges", VType.ARRAY, tik.merges, VType.STRING),
    ]
    for typ, tid in _special_ids({}, tc, {}, config, len(tik.texts)).items():
        kvs.append(KV(f"tokenizer.ggml.{_SPECIAL_KEYS[typ]}", VType.UINT32, tid))
    for typ in _ADD_KEYS:
        if isinstance(flag := tc.get(f"add_{typ}_token"), bool):
            kvs.append(KV(f"tokenizer.ggml.add_{typ}_token", VType.BOOL, flag))
    return kvs + (_chat_templates(read, tc) if tc else [])
