"""The package's public API: every name in ``mxfp4conv.__all__`` resolves, and ``import mxfp4conv``
loads neither torch nor the pipeline (the CLI's rename and inspect paths depend on that)."""

from __future__ import annotations

import subprocess
import sys

import mxfp4conv


def test_every_public_name_resolves() -> None:
    for name in mxfp4conv.__all__:
        assert getattr(mxfp4conv, name) is not None, name
    assert callable(mxfp4conv.convert) and callable(mxfp4conv.inspect_checkpoint)
    assert callable(mxfp4conv.verify_output)
    assert issubclass(mxfp4conv.InputError, mxfp4conv.ConvertError)
    assert set(mxfp4conv.__all__) <= set(dir(mxfp4conv))


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        mxfp4conv.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_light() -> None:
    code = ("import sys, mxfp4conv; from mxfp4conv import ConvertError, __version__; "
            "print(sorted(m for m in ('torch', 'mxfp4conv.run.pipeline', 'click') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
