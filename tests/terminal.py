"""A command run on a pseudo-terminal (120 columns), as a user's shell runs it: its exit status and what
it wrote to the terminal (stderr; stdout goes nowhere)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios


def on_terminal(cmd: list[str], env: dict[str, str], timeout: float = 180) -> tuple[int, str]:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return proc.wait(timeout=timeout), out.decode(errors="replace")
