"""The package's imports flow one way (docs/ARCHITECTURE.md): the lower modules never import the
higher ones, at module level or inside a function. ``cbuild`` (the C build helper) sits below both
``io/`` and ``kernels/``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mxfp4conv"
# module group -> the package groups it may import (besides itself)
ALLOWED = {
    "cbuild": set(),
    "errors": set(),
    "formats": {"errors"},
    "io": {"errors", "cbuild"},
    "kernels": {"errors", "cbuild", "formats", "io"},
}


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path, source: str | None = None) -> set[str]:
    """The mxfp4conv modules a file imports, relative imports (``from ..io import x``) resolved
    against the file's own package."""
    rel = path.relative_to(PKG.parent).with_suffix("").parts
    package = rel if rel[-1] == "__init__" else rel[:-1]
    package = package[:-1] if package and package[-1] == "__init__" else package
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1])
            if node.module:
                out.add(f"{base}.{node.module}")
            else:
                out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "mxfp4conv" or m.startswith("mxfp4conv.")}


def test_relative_imports_are_resolved() -> None:
    """A relative import cannot escape the check: ``from ..pipeline import x`` in io/ names mxfp4conv.pipeline."""
    where = PKG / "io" / "source.py"
    assert imports(where, "from ..pipeline import convert\nfrom . import hub\nfrom .fetch import x\n") == {
        "mxfp4conv.pipeline", "mxfp4conv.io.hub", "mxfp4conv.io.fetch"}
    assert imports(PKG / "io" / "__init__.py", "from .. import errors\n") == {"mxfp4conv.errors"}


@pytest.mark.parametrize("low", sorted(ALLOWED))
def test_lower_modules_import_nothing_above_them(low: str) -> None:
    files = [PKG / f"{low}.py"] if (PKG / f"{low}.py").exists() else sorted((PKG / low).rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(PKG)} imports {m}" for f in files for m in sorted(imports(f))
           if group(m) != low and group(m) not in ALLOWED[low]]
    assert not bad, bad
