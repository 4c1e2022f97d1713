"""Starts examples/generate.py as N local processes of one jax.distributed run.

    # CPU: 2 processes x 2 CPU devices, one mesh of 4 (gloo collectives)
    python examples/launch.py --num_processes=2 --devices_per_process=2 -- \\
        --strategy=cap_and_spill --transport=lax
    # GPU host: one process per GPU
    python examples/launch.py --platform=cuda --num_processes=4 -- \\
        --strategy=cap_and_spill --transport=custom_call

Everything after ``--`` goes to every process of examples/generate.py; the
launcher adds --coordinator (a free local port), --num_processes,
--process_id, --tokens_out (one file per process) and, on GPUs,
--local_device_ids. Process 0's output is shown as it runs; every
process's output goes to OUT_DIR/process_<i>.log. When one process fails or
the time limit passes, the others are stopped. At the end the launcher
checks that every process generated the same tokens and prints PASS or FAIL
(exit status 0 or 1). OUT_DIR/tokens.json holds process 0's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent / "generate.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(platform: str, devices_per_process: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=platform, PYTHONUNBUFFERED="1")
    if platform == "cpu":
        kept = [f for f in env.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(
            kept + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    return env


def child_command(args, index: int, port: int, out_dir: Path) -> list[str]:
    cmd = [sys.executable, str(EXAMPLE), f"--coordinator=127.0.0.1:{port}",
           f"--num_processes={args.num_processes}", f"--process_id={index}",
           f"--tokens_out={out_dir / 'tokens.{process}.json'}"]
    if args.platform != "cpu":
        first = index * args.devices_per_process
        ids = ",".join(str(first + d) for d in range(args.devices_per_process))
        cmd.append(f"--local_device_ids={ids}")
    return cmd + args.example_flags


def _tee(stream, log, echo: bool) -> None:
    for line in iter(stream.readline, ""):
        log.write(line)
        log.flush()
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def run_processes(args, out_dir: Path) -> list[int | None]:
    """Starts the processes and waits; returns their exit codes (None:
    stopped by the launcher)."""
    port = free_port()
    env = child_env(args.platform, args.devices_per_process)
    procs, threads, logs = [], [], []
    for i in range(args.num_processes):
        log = open(out_dir / f"process_{i}.log", "w", encoding="utf-8")
        proc = subprocess.Popen(child_command(args, i, port, out_dir), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        thread = threading.Thread(target=_tee, args=(proc.stdout, log, i == 0 and not args.quiet),
                                  daemon=True)
        thread.start()
        procs.append(proc)
        threads.append(thread)
        logs.append(log)
    deadline = time.monotonic() + args.timeout
    codes: list[int | None] = [None] * len(procs)
    try:
        while any(c is None for c in codes):
            for i, proc in enumerate(procs):
                if codes[i] is None:
                    codes[i] = proc.poll()
            if any(c not in (None, 0) for c in codes):
                print(f"launch: process {[i for i, c in enumerate(codes) if c not in (None, 0)]}"
                      " failed; stopping the others", file=sys.stderr)
                break
            if time.monotonic() > deadline:
                print(f"launch: time limit of {args.timeout} s passed; stopping the processes",
                      file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        for i, proc in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for thread, log in zip(threads, logs):
            thread.join(timeout=5)
            log.close()
    return codes


def check_tokens(num_processes: int, out_dir: Path) -> tuple[bool, str]:
    """(all agree, message) from the processes' tokens files."""
    tokens = []
    for i in range(num_processes):
        path = out_dir / f"tokens.{i}.json"
        if not path.exists():
            return False, f"process {i} wrote no tokens ({path})"
        tokens.append(json.loads(path.read_text())["tokens"])
    shutil.copyfile(out_dir / "tokens.0.json", out_dir / "tokens.json")
    differ = [i for i, t in enumerate(tokens) if t != tokens[0]]
    if differ:
        return False, f"processes {differ} generated other tokens than process 0"
    return True, f"{num_processes} processes generated the same tokens"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, default=1,
                        help="CPU devices (cpu) or GPUs (cuda) per process")
    parser.add_argument("--platform", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out_dir", default=None,
                        help="logs and tokens files (default: a new temporary directory)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    parser.add_argument("--quiet", action="store_true", help="do not echo process 0's output")
    parser.add_argument("example_flags", nargs="*", help="flags of examples/generate.py")
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error(f"--num_processes: must be >= 1, got {args.num_processes}")
    if args.devices_per_process < 1:
        parser.error(f"--devices_per_process: must be >= 1, got {args.devices_per_process}")
    reserved = ("--coordinator", "--num_processes", "--process_id", "--tokens_out",
                "--local_device_ids")
    taken = [f for f in args.example_flags if f.split("=")[0] in reserved]
    if taken:
        parser.error(f"example flags: {taken} are set by the launcher")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="moe_jax_launch_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("tokens*.json"):
        stale.unlink()
    print(f"launch: {args.num_processes} processes x {args.devices_per_process} "
          f"{args.platform} device(s); logs in {out_dir}", flush=True)
    codes = run_processes(args, out_dir)
    if any(c != 0 for c in codes):
        for i, c in enumerate(codes):
            if c != 0:
                tail = (out_dir / f"process_{i}.log").read_text().splitlines()[-15:]
                print(f"--- process {i} (exit {c}), last lines:\n" + "\n".join(tail),
                      file=sys.stderr)
        print(f"FAIL: processes exited with {codes}", flush=True)
        return 1
    ok, message = check_tokens(args.num_processes, out_dir)
    print(f"{'PASS' if ok else 'FAIL'}: {message}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
