"""The package's imports flow one way (docs/ARCHITECTURE.md): every package, and every module of the
package root, imports only the packages its row of ``ALLOWED`` names, at module level, under
``TYPE_CHECKING`` or inside a function; the table has no cycle, so no package imports one above it.

The root holds only the public API (``__init__.py``), the CLI, ``errors.py`` and ``__main__.py``.
``from mxfp4conv import __version__`` counts as ``__version__``, not as the public API: ``__init__.py``
binds it when the package is first imported (before any submodule runs), while the API's names are
imported only when asked for (PEP 562), so it is not an import of the modules behind them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mxfp4conv"
ROOT_MODULES = ["__init__", "__main__", "cli", "errors"]
VERSION = "__version__"
# package (or root module) -> the packages and root modules it may import (besides itself), from the
# bottom of the flow to its top
ALLOWED: dict[str, set[str]] = {
    VERSION: set(),
    "errors": set(),
    "formats": set(),
    "device": set(),
    "model": set(),
    "vllm_plugin": set(),
    "files": {"errors", "device"},
    "sources": {"errors", "files"},
    "kernels": {"formats", "device", "files"},
    "layouts": {"errors", "formats", "files", "sources", "model"},
    "targets": {VERSION, "errors", "formats", "files", "sources", "model", "kernels", "layouts"},
    "plan": {"errors", "files", "sources", "model", "kernels", "layouts", "targets"},
    "numerics": {"errors", "formats", "device", "sources", "model", "kernels", "targets", "plan"},
    "proof": {"errors", "device", "files", "sources", "model", "targets", "plan", "numerics"},
    "run": {VERSION, "errors", "device", "files", "sources", "kernels", "targets", "plan", "numerics", "proof"},
    "publish": {VERSION, "errors", "sources", "proof", "run"},
    "__init__": {"errors", "plan", "proof", "run", "publish"},
    "cli": {VERSION, "errors", "targets", "plan", "proof", "run", "publish"},
    "__main__": {"cli"},
}


def group(module: str) -> str:
    """``mxfp4conv.run.pipeline`` -> ``run``, ``mxfp4conv.cli`` -> ``cli``, ``mxfp4conv`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, source: str | None = None) -> set[str]:
    """The mxfp4conv modules a file imports, relative imports (``from ..run import x``) resolved
    against the file's own package; a name imported from the package root is named under it
    (``from mxfp4conv import __version__`` -> ``mxfp4conv.__version__``)."""
    rel = path.relative_to(PKG.parent).with_suffix("").parts
    package = rel if rel[-1] == "__init__" else rel[:-1]
    package = package[:-1] if package and package[-1] == "__init__" else package
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or "" if node.level == 0 else ".".join(package[: len(package) - node.level + 1])
            module = node.module if node.level == 0 else f"{base}.{node.module}" if node.module else base
            if module == "mxfp4conv" or (node.level and not node.module):
                out.update(f"{module}.{a.name}" for a in node.names)
            elif module:
                out.add(module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "mxfp4conv" or m.startswith("mxfp4conv.")}


def files_of(name: str) -> list[Path]:
    return [PKG / f"{name}.py"] if name in ROOT_MODULES else sorted((PKG / name).rglob("*.py"))


def test_relative_imports_are_resolved() -> None:
    """A relative import cannot escape the check: ``from ..run.pipeline import x`` in sources/ names
    mxfp4conv.run.pipeline."""
    where = PKG / "sources" / "checkpoint.py"
    assert imports(where, "from ..run.pipeline import convert\nfrom . import hub\nfrom .fetch import x\n") == {
        "mxfp4conv.run.pipeline", "mxfp4conv.sources.hub", "mxfp4conv.sources.fetch"}
    assert imports(PKG / "sources" / "__init__.py", "from .. import errors\n") == {"mxfp4conv.errors"}
    assert imports(PKG / "cli.py", "from mxfp4conv import __version__, errors\nimport mxfp4conv\n") == {
        "mxfp4conv.__version__", "mxfp4conv.errors", "mxfp4conv"}
    assert {group(m) for m in imports(PKG / "cli.py", "from mxfp4conv import __version__\n")} == {VERSION}


def test_the_root_holds_only_the_api_the_cli_and_the_errors() -> None:
    assert sorted(p.stem for p in PKG.glob("*.py")) == ROOT_MODULES


def test_the_table_names_every_package_and_root_module() -> None:
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    assert sorted(set(ALLOWED) - {VERSION}) == sorted([*packages, *ROOT_MODULES])
    assert all(allowed <= set(ALLOWED) for allowed in ALLOWED.values())


def test_the_table_has_no_cycle() -> None:
    """Packages taken bottom-up, each once everything it may import is taken: all of them are."""
    taken: list[str] = []
    while len(taken) < len(ALLOWED):
        ready = [name for name, allowed in ALLOWED.items() if name not in taken and allowed <= set(taken)]
        assert ready, f"a cycle among {sorted(set(ALLOWED) - set(taken))}"
        taken.extend(ready)


@pytest.mark.parametrize("name", sorted(set(ALLOWED) - {VERSION}))
def test_each_package_imports_only_what_its_row_allows(name: str) -> None:
    files = files_of(name)
    assert files and all(f.is_file() for f in files)
    found = {group(m) for f in files for m in imports(f)} - {name}
    bad = [f"{f.relative_to(PKG)} imports {m}" for f in files for m in sorted(imports(f))
           if group(m) != name and group(m) not in ALLOWED[name]]
    assert not bad, bad
    # the table is the package's actual imports, not a looser bound
    assert found == ALLOWED[name], f"{name}: imports {sorted(found)}, the table says {sorted(ALLOWED[name])}"


LONGEST_FUNCTION = 60
LONGEST_MODULE = 500


def _sizes(root: Path = PKG) -> tuple[list[str], list[str]]:
    """Modules over LONGEST_MODULE lines and functions over LONGEST_FUNCTION, outside kernels/ (its
    Triton JIT code is written for the compiler, not split for reading)."""
    modules, functions = [], []
    for path in sorted(root.rglob("*.py")):
        if "kernels" in path.relative_to(root).parts:
            continue
        text = path.read_text()
        rel = str(path.relative_to(root.parent))
        if len(text.splitlines()) > LONGEST_MODULE:
            modules.append(f"{rel} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > LONGEST_FUNCTION:
                    functions.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return modules, functions


def test_no_module_or_function_is_too_long_to_read() -> None:
    modules, functions = _sizes()
    assert not modules, f"modules over {LONGEST_MODULE} lines: {modules}"
    assert not functions, f"functions over {LONGEST_FUNCTION} lines: {functions}"


def test_the_size_check_sees_a_long_function_and_module(tmp_path: Path) -> None:
    """The check counts what it should: a 61-line function and a 501-line module are each one too
    many; the same in kernels/ passes."""
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST_FUNCTION))
    pad = "\n" * (LONGEST_MODULE - LONGEST_FUNCTION)
    for where in ("pkg/long.py", "pkg/kernels/long.py"):
        (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / where).write_text(f"def f():\n{body}\n{pad}")
    modules, functions = _sizes(tmp_path / "pkg")
    assert modules == [f"pkg/long.py ({LONGEST_MODULE + 1} lines)"]
    assert functions == [f"pkg/long.py:1 f ({LONGEST_FUNCTION + 1} lines)"]
