"""The manifest a conversion writes into DST (``mxfp4conv.json``): what was converted, from what, how,
and the sha256 of every output file. ``verify`` reads its options back; ``--skip-if-current``
compares its fingerprint."""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["MANIFEST", "Manifest", "ManifestSource"]

MANIFEST = "mxfp4conv.json"


class ManifestSource(TypedDict):
    name: str  # SRC's folder name (or repo id)
    repo_id: str | None
    revision: str | None
    layout: str
    files: dict[str, Any]  # the source fingerprint: config files' sha256, shards' header sha256 and size


class Manifest(TypedDict):
    schema_version: int
    tool: str
    version: str
    source: ManifestSource
    target: str
    options: dict[str, Any]  # the fingerprint's options, and device_independent: True
    fingerprint: dict[str, Any]  # tool version, source fingerprint, options (and the requant contract)
    outputs: dict[str, str]  # output file -> sha256
    requant_stats: dict[str, dict[str, Any]]
    verified: bool
