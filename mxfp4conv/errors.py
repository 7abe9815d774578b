"""One exception family; the CLI maps it to a one-line message and an exit code."""

from __future__ import annotations

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_USAGE",
    "EXIT_VERIFY",
    "ConvertError",
    "EnvironmentProblem",
    "InputError",
    "OutputError",
    "StagingError",
    "UsageError",
    "VerificationFailed",
]

EXIT_OK = 0
EXIT_INVALID = 1  # input rejected, unreadable, unsupported pair, output or environment problem
EXIT_USAGE = 2  # a flag or setting that cannot be honoured (click's own code for bad command lines)
EXIT_VERIFY = 3  # the output does not match the source
EXIT_INTERNAL = 123  # a bug in mxfp4conv


class ConvertError(Exception):
    """Base class. ``str(err)`` is one line: what is wrong, where (file, tensor) and the fix."""

    exit_code = EXIT_INVALID

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 hint: str | None = None) -> None:
        self.message = message
        self.file = file
        self.tensor = tensor
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = []
        if self.file:
            where.append(self.file)
        if self.tensor:
            where.append(f"tensor {self.tensor}")
        text = f"{': '.join(where)}: {self.message}" if where else self.message
        if self.hint:
            text += f" (fix: {self.hint})"
        return " ".join(text.split())  # exactly one line, whatever the inputs held


class InputError(ConvertError):
    """The source checkpoint is unreadable, inconsistent or unsupported."""


class UsageError(ConvertError):
    """A flag or setting mxfp4conv cannot honour (an ``MXFP4CONV_*`` mode, a target name, a ``--ray``
    address): exit 2, as click's own usage errors."""

    exit_code = EXIT_USAGE


class StagingError(ConvertError):
    """A staging folder of ``--resume`` / ``--partition`` / ``--finish`` that belongs to another conversion
    or lacks a shard (kept as it is: other partitions may own it)."""


class EnvironmentProblem(ConvertError):
    """The machine cannot run the job as asked (a package missing, a cluster unreachable)."""


class OutputError(ConvertError):
    """The destination cannot be written (exists, inside the source, disk full)."""


class VerificationFailed(ConvertError):
    """The written output does not reproduce the source."""

    exit_code = EXIT_VERIFY
