"""A throwaway Ray cluster for the tests: a head on 127.0.0.1 with two CPU slots."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

RAY_CLI = Path(sys.executable).with_name("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def ray_head(env: dict[str, str] | None = None) -> Iterator[str]:
    """`ray start --head --block` in its own process group (its workers get ``env``, when given); on
    exit that group only is ended.

    (`ray stop` would stop every Ray process of this machine, not just ours.) The temp dir is short:
    Ray's unix sockets live under it and socket paths are limited to ~107 bytes.
    """
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")
    port = free_port()
    cmd = [str(RAY_CLI), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--num-cpus", "2", "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats",
           "--temp-dir", temp, "--object-store-memory", str(100 * 1000**2),
           "--dashboard-agent-listen-port", str(free_port()), "--log-style", "record"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # keep reading so the head never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        ready.wait(90)
        assert proc.poll() is None and any("Ray runtime started" in ln for ln in lines), "".join(lines)[-3000:]
        yield f"127.0.0.1:{port}"
    finally:
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):  # a throwaway cluster: no long grace
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                proc.poll()  # reap the group leader so the group can disappear
                time.sleep(0.2)
        proc.wait(timeout=10)
        shutil.rmtree(temp, ignore_errors=True)


