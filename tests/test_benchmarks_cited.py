"""BENCHMARKS.md cites every raw file under benchmarks/results (in backquotes: by name, under
``results/`` or not, by a ``*`` pattern, a ``{a,b}`` list or a leading ``...`` for the name just
cited), and every name it cites exists: no figure without its file, no file without its figure."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"`(?:results/)?([\w.*{},-]+\.(?:jsonl|json|txt))`")


def expand(pattern: str) -> list[str]:
    """``a_{x,y}.txt`` -> ``a_x.txt``, ``a_y.txt`` (one brace group at a time)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [n for alt in m.group(1).split(",") for n in expand(pattern[: m.start()] + alt + pattern[m.end():])]


def citations(text: str) -> list[str]:
    return [re.sub(r"^\.\.\.", "*", p) for m in CITED.finditer(text) for p in expand(m.group(1))]


def test_expand_and_citations_read_the_forms_used() -> None:
    text = "raw `results/a_{x,y}.txt` and `results/b_*.jsonl`; `c.json` (`..._d.jsonl`), not `e.py`."
    assert citations(text) == ["a_x.txt", "a_y.txt", "b_*.jsonl", "c.json", "*_d.jsonl"]


def test_every_result_is_cited_and_every_citation_exists() -> None:
    names = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    cited = citations((ROOT / "BENCHMARKS.md").read_text())
    uncited = [n for n in names if not any(fnmatch.fnmatchcase(n, c) for c in cited)]
    missing = [c for c in cited if not any(fnmatch.fnmatchcase(n, c) for n in names)]
    assert not uncited, f"files under benchmarks/results that BENCHMARKS.md does not cite: {uncited}"
    assert not missing, f"BENCHMARKS.md cites files that are not under benchmarks/results: {missing}"
