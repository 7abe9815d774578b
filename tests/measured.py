"""Numbers the tests measure (SQNR, logprob differences, timings), printed in pytest's terminal summary.

``tests/conftest.py`` provides the ``record`` fixture and the summary; suites append set-up figures to
``REPORT`` directly.
"""

from __future__ import annotations

REPORT: list[str] = []
