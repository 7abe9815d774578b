"""One exception family; the CLI maps it to a one-line message and an exit code."""

from __future__ import annotations

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_USAGE",
    "EXIT_VERIFY",
    "ConvertError",
    "InputError",
    "OutputError",
    "UsageError",
    "VerificationFailed",
]

EXIT_OK = 0
EXIT_INVALID = 1  # input rejected, unreadable, unsupported pair, output problem
EXIT_USAGE = 2  # bad command line (click's own code)
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
    """Options that make no sense together (e.g. a (source, target) pair that cannot be served)."""


class OutputError(ConvertError):
    """The destination cannot be written (exists, inside the source, disk full)."""


class VerificationFailed(ConvertError):
    """The written output does not reproduce the source."""

    exit_code = EXIT_VERIFY
