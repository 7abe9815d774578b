"""The one policy every Hub request follows, reads and uploads alike: which failures are retried, how
long to wait between tries, and the error text a user sees.

* Retried: 429 (waiting as the RateLimit / Retry-After headers say, as huggingface_hub's
  ``http_backoff`` does), 5xx, and network errors with no answer at all; ``RETRIES`` more tries, the
  wait doubling from 0.5 s up to 8 s. Any other answer (401, 403, 404, ...) is final at once.
* The text: the first line of the innermost huggingface_hub / httpx error, at most 300 characters,
  with every token this process could send (the caller's, and huggingface_hub's own from
  ``HF_TOKEN`` or the login file) replaced by ``***``. No message of the tool shows a token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["RETRIES", "inner", "pause", "retried", "status_of", "why"]

RETRIES = 5  # per request, as huggingface_hub's http_backoff
T = TypeVar("T")


def pause(attempt: int) -> float:
    """Seconds to wait before try ``attempt`` (1 = the first retry) when the answer says nothing."""
    return min(8.0, 0.5 * 2 ** (attempt - 1))


def inner(exc: BaseException) -> BaseException:
    """The failure itself: huggingface_hub wraps upload failures in RuntimeError("Error while uploading
    ...") and a failed HEAD with no cached copy in LocalEntryNotFoundError, each from the cause."""
    while exc.__cause__ is not None and (isinstance(exc, RuntimeError) or type(exc).__name__ == "LocalEntryNotFoundError"):
        exc = exc.__cause__
    return exc


def status_of(exc: BaseException) -> int | None:
    """The HTTP status the Hub answered with, or None when no answer came."""
    resp = getattr(inner(exc), "response", None)
    return resp.status_code if resp is not None else None


def _retryable(exc: BaseException) -> bool:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    cause = inner(exc)
    if not isinstance(cause, HfHubHTTPError | httpx.HTTPError):
        return False
    status = status_of(cause)
    return status is None or status == 429 or status >= 500


def _wait(exc: BaseException, attempt: int) -> float:
    from huggingface_hub.utils import parse_ratelimit_headers

    resp: Any = getattr(inner(exc), "response", None)
    if resp is not None and resp.status_code == 429:
        rl = parse_ratelimit_headers(resp.headers)
        if rl is not None and rl.remaining == 0:
            return float(rl.reset_in_seconds) + 1
        if (ra := resp.headers.get("Retry-After", "").strip()).isdigit():
            return float(ra)
    return pause(attempt)


def retried(fn: Callable[[], T]) -> T:
    """``fn`` (a huggingface_hub call), tried again on the failures this policy retries; the last
    failure, or any other, is raised as it came."""
    for attempt in range(1, RETRIES + 2):
        try:
            return fn()
        except Exception as exc:
            if attempt > RETRIES or not _retryable(exc):
                raise
            time.sleep(_wait(exc, attempt))
    raise AssertionError("unreachable")


def why(exc: BaseException, token: str | bool | None = None) -> str:
    """The error's first line, every token masked."""
    cause = inner(exc)
    text = " ".join(str(cause).split("\n\n")[0].split()) or type(cause).__name__
    for secret in _tokens(token):
        text = text.replace(secret, "***")
    return text[:300]


def _tokens(token: str | bool | None) -> list[str]:
    out = [token] if isinstance(token, str) and token else []
    try:
        from huggingface_hub import get_token

        own = get_token()
    except Exception:  # masking must never fail the error path
        return out
    return out + ([own] if own else [])
