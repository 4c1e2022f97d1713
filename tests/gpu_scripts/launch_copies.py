"""Starts N copies of a check script as the processes of one jax.distributed
run on this host: `python SCRIPT N I PORT` for I in 0..N-1, PORT a free local
port for process 0's coordinator."""

import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_copies(script: str, num: int, timeout: float) -> int:
    """Runs the N copies and waits for them; returns the largest |exit code|."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, str(num), str(i), str(port)])
             for i in range(num)]
    codes = [p.wait(timeout=timeout) for p in procs]
    return max(abs(c) for c in codes)
