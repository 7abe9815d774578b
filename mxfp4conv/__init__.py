"""mxfp4conv: offline conversion of FP4 mixture-of-experts checkpoints.

Public API::

    from mxfp4conv import ConvertOptions, PushOptions, convert, inspect_checkpoint, verify_output

    report = inspect_checkpoint("./ckpt")                        # InspectReport (header-only)
    result = convert("./ckpt", "./out", ConvertOptions(target="ct"))  # ConvertReport
    check = verify_output("./ckpt", "./out")                     # VerifyReport
    # what `mxfp4conv convert ... --ray HOST:PORT --push-to-hub ORG/NAME` does: on Ray, then pushed
    result = convert("./ckpt", "./out", ConvertOptions(target="ct"), ray="10.0.0.1:6379",
                     push=PushOptions("my-org/out", private=True))  # result.push: the commit

and the ``ConvertError`` family (``InputError``, ``UsageError``, ``OutputError``, ``StagingError``,
``EnvironmentProblem``, ``VerificationFailed``), each carrying the process exit code the CLI uses (``exit_code``).

``import mxfp4conv`` stays light: the functions and report classes are imported on first use
(PEP 562), so neither torch nor the pipeline is loaded until one of them is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxfp4conv.errors import (
    ConvertError,
    EnvironmentProblem,
    InputError,
    OutputError,
    StagingError,
    UsageError,
    VerificationFailed,
)

__version__ = "0.1.0"

__all__ = [
    "ConvertError",
    "ConvertOptions",
    "ConvertReport",
    "EnvironmentProblem",
    "InputError",
    "InspectReport",
    "OutputError",
    "PushOptions",
    "StagingError",
    "UsageError",
    "VerificationFailed",
    "VerifyReport",
    "__version__",
    "convert",
    "inspect_checkpoint",
    "verify_output",
]

# name -> the module that defines it (imported on first access)
_LAZY = {
    "ConvertOptions": "mxfp4conv.run.pipeline",
    "ConvertReport": "mxfp4conv.run.pipeline",
    "convert": "mxfp4conv.publish.release",
    "PushOptions": "mxfp4conv.publish.push",
    "InspectReport": "mxfp4conv.plan.inspect",
    "inspect_checkpoint": "mxfp4conv.plan.inspect",
    "VerifyReport": "mxfp4conv.proof.verify",
    "verify_output": "mxfp4conv.proof.verify",
}

if TYPE_CHECKING:
    from mxfp4conv.plan.inspect import InspectReport, inspect_checkpoint
    from mxfp4conv.proof.verify import VerifyReport, verify_output
    from mxfp4conv.publish.push import PushOptions
    from mxfp4conv.publish.release import convert
    from mxfp4conv.run.pipeline import ConvertOptions, ConvertReport


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mxfp4conv' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
