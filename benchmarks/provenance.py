"""Which code produced a benchmark result."""

from __future__ import annotations

import hashlib
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_digest() -> str:
    """sha256 (16 hex digits) over moe_jax's Python and C++/CUDA sources."""
    digest = hashlib.sha256()
    for folder in ("moe_jax", "xla_ffi", "cuda"):
        for dirpath, _, files in sorted(os.walk(os.path.join(_ROOT, folder))):
            for name in sorted(files):
                if name.endswith((".py", ".cc", ".h", ".cu", ".cuh")):
                    with open(os.path.join(dirpath, name), "rb") as f:
                        digest.update(name.encode() + f.read())
    return digest.hexdigest()[:16]


def extension_digest() -> dict[str, str]:
    """sha256 (16 hex digits) of each compiled moe_jax extension that loads
    ({module: digest}; absent modules are left out)."""
    import importlib

    out = {}
    for name in ("_ffi_cpu", "_ffi_cuda"):
        try:
            module = importlib.import_module(f"moe_jax.{name}")
        except ImportError:
            continue
        with open(module.__file__, "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()[:16]
    return out


def commit() -> str:
    """The commit the sources come from: $MOE_JAX_COMMIT when set (a copy of
    the tree without .git), else `git rev-parse HEAD`, with "+dirty" when the
    tree has uncommitted changes; "unknown" without either."""
    import subprocess

    env = os.environ.get("MOE_JAX_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=_ROOT, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def portable_command(command: str) -> str:
    """A recorded command without the machine's paths: the script as a path
    relative to the repository, the output folder as OUT_DIR."""
    out = []
    for arg in command.split():
        if arg.startswith("--out="):
            arg = "--out=OUT_DIR"
        elif arg.endswith(".py") and "/benchmarks/" in arg and arg.startswith("/"):
            arg = "benchmarks/" + arg.rsplit("/benchmarks/", 1)[1]
        out.append(arg)
    return " ".join(out)


def code_meta() -> dict:
    """What every record stores about its code: the commit ("+dirty" for an
    uncommitted tree), the sources' digest and each built extension's."""
    return dict(commit=commit(), moe_jax_source_sha256=source_digest(),
                extension_sha256=extension_digest())
