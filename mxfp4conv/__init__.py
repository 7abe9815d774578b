"""mxfp4conv: offline conversion of FP4 mixture-of-experts checkpoints.

Public API: ``inspect_checkpoint``, ``convert``, ``verify_output`` and the ``ConvertError`` family.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
