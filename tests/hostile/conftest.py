"""tests/hostile: the builders (examples/tiny.py) and this folder's helpers on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parents[1] / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
