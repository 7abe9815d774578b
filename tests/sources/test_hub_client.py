"""The one Hub client policy (mxfp4conv/sources/hub_client.py): what is retried, what is final at
once, and error text that never shows a token. The failures are huggingface_hub's and httpx's own
exception types, raised by the call under test."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import httpx
import pytest
from huggingface_hub.errors import HfHubHTTPError

from mxfp4conv.sources import hub_client


def _answer(status: int, headers: dict[str, str] | None = None, text: str = "") -> HfHubHTTPError:
    resp = httpx.Response(status, headers=headers, request=httpx.Request("GET", "http://127.0.0.1/api/models/o/m"))
    return HfHubHTTPError(f"{status} for http://127.0.0.1/api/models/o/m {text}", response=resp)


def _flaky(faults: Sequence[BaseException]) -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []
    failures = list(faults)

    def fn() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return "ok"

    return calls, fn


def test_5xx_429_and_lost_connections_are_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(hub_client.time, "sleep", waits.append)
    calls, fn = _flaky([_answer(503), httpx.ConnectError("connection refused"), _answer(429, {"Retry-After": "3"})])
    assert hub_client.retried(fn) == "ok"
    assert len(calls) == 4
    assert waits == [0.5, 1.0, 3.0]  # doubling, then what Retry-After says


@pytest.mark.parametrize("status", [401, 403, 404])
def test_other_answers_are_final_at_once(monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    monkeypatch.setattr(hub_client.time, "sleep", lambda s: pytest.fail("no retry for a final answer"))
    calls, fn = _flaky([_answer(status)])
    with pytest.raises(HfHubHTTPError):
        hub_client.retried(fn)
    assert len(calls) == 1


def test_retries_end_with_the_last_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_client.time, "sleep", lambda s: None)
    calls, fn = _flaky([_answer(500) for _ in range(hub_client.RETRIES + 1)] + [_answer(502)])
    with pytest.raises(HfHubHTTPError, match="500"):
        hub_client.retried(fn)
    assert len(calls) == hub_client.RETRIES + 1


def test_the_error_text_masks_every_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fromtheenvironment0123")
    exc = RuntimeError("Error while uploading")
    exc.__cause__ = _answer(403, text="token hf_passedbythecaller0123 and hf_fromtheenvironment0123\n\nmore")
    text = hub_client.why(exc, "hf_passedbythecaller0123")
    assert "hf_" not in text and text.count("***") == 2
    assert text.startswith("403 for http://127.0.0.1/api/models/o/m")  # the cause's first line, unwrapped
    assert hub_client.status_of(exc) == 403
