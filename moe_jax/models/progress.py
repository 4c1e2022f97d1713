"""Progress bars for long runs: tqdm when it is installed, else a plain one.

    bar = Progress(total=100, label="decode")
    bar(37)          # 37 of 100 done (repeats and steps back are ignored)
    bar.close()

``Progress`` is callable with the number of finished units, so it can be
passed as ``on_step`` to :func:`moe_jax.models.generate.generate` (which
reports each decode step from inside the jitted loop). Only one process
draws: pass ``enabled=False`` elsewhere (e.g. ``jax.process_index() != 0``).
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """A progress bar over `total` units, written to `stream` (stderr).

    Uses ``tqdm`` when it can be imported (``pip install tqdm``, or the
    ``examples`` extra of moe_jax); otherwise draws a fixed-width text bar
    that it rewrites in place with a carriage return.
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True,
                 stream: TextIO | None = None, width: int = 30):
        if not isinstance(total, int) or total < 1:
            raise ValueError(f"total: must be an integer >= 1, got {total!r}")
        self.total, self.label, self.width, self.done = total, label, width, 0
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc=label, unit="step", leave=False,
                                file=self.stream)

    def __call__(self, done) -> None:
        done = min(int(done), self.total)
        if not self.enabled or done <= self.done:  # a step reported by several devices
            return
        if self.bar is not None:
            self.bar.update(done - self.done)
        else:
            filled = self.width * done // self.total
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                              f"{done}/{self.total}")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and 0 < self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
