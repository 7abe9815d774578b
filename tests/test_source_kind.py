"""Only the source package knows which kind of source a conversion reads (issue #50): a ``Source``
(``mxfp4conv/sources/source.py``) answers every question that differs between a local folder and a Hub
repo, and no module outside ``mxfp4conv/sources/`` names the Hub source's classes, reaches for
``Checkpoint.remote`` or asks the Hub's own questions (``paced``, ``read_from``, ``checked_against``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mxfp4conv"
SOURCES = PKG / "sources"
NAMES = {"RemoteRepo", "CachedRepo", "HubSource", "LocalSource"}  # the kinds, by name
ATTRIBUTES = {"remote", "paced", "read_from", "checked_against"}  # asking a source which kind it is
KEYS = {"read_from", "checked_against"}  # the same, asked of a report's hub section


def _ray(node: ast.Attribute) -> bool:
    """Ray's API, not a source: ``ray.remote(fn)``, ``handle.options(...).remote(...)``."""
    if node.attr != "remote":
        return False
    return isinstance(node.value, ast.Call) or (isinstance(node.value, ast.Name) and node.value.id == "ray")


def kind_questions(source: str) -> list[str]:
    """Where ``source`` (a module's text) asks which kind of source it has."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in NAMES:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] in NAMES:
            found.append(f"{node.lineno}: import {node.name}")
        elif isinstance(node, ast.Attribute) and (node.attr in NAMES or node.attr in ATTRIBUTES) and not _ray(node):
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in KEYS:
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops) and (
                isinstance(node.left, ast.Name) and node.left.id in ("repo", "remote")):
            found.append(f"{node.lineno}: {node.left.id} is ...")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def outside_sources() -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py")) if SOURCES not in p.parents]


@pytest.mark.parametrize("path", outside_sources(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_outside_the_sources_asks_which_kind_of_source_it_has(path: Path) -> None:
    assert kind_questions(path.read_text()) == []


def test_the_check_sees_each_way_of_asking() -> None:
    text = ("from mxfp4conv.sources.hub import RemoteRepo\nrepo = ckpt.remote\nif repo is None: pass\n"
            "x = job.ckpt.source.repo.paced\ny = hub['read_from']\nz = hub_cache.CachedRepo\n"
            "f = ray.remote(g)\nh = f.options(name='x').remote(1)\n")
    assert kind_questions(text) == ["1: import RemoteRepo", "2: .remote", "3: repo is ...", "4: .paced",
                                    "5: 'read_from'", "6: .CachedRepo"]
