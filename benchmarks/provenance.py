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
