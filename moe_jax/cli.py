"""Command-line entry points: a bad flag or value is one line, not a help
dump or a traceback.

    from moe_jax import cli
    if __name__ == "__main__":
        cli.run(main)

`cli.run` runs `main` under absl's `app.run`; an `app.UsageError`, a
`ValueError` (the library's validation names the offending argument) or a
missing file ends the program with `<program>: error: <message>` on stderr
and exit status 2. Set MOE_JAX_TRACEBACK=1 to get the traceback instead.
"""

from __future__ import annotations

import os
import sys

from absl import app

ERRORS = (app.UsageError, ValueError, FileNotFoundError, NotADirectoryError)


def fail(message: str) -> None:
    """Ends the program with one line naming the problem (exit status 2)."""
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {message}\n")
    sys.exit(2)


def run(main) -> None:
    def wrapped(argv):
        try:
            return main(argv)
        except ERRORS as err:
            if os.environ.get("MOE_JAX_TRACEBACK"):
                raise
            fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    app.run(wrapped)


def make_parent(flag: str, path: str | None) -> None:
    """Creates `path`'s folder now, or fails now (not after the run) when it
    cannot be created."""
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            fail(f"--{flag}={path}: cannot create its folder {folder} ({err.strerror})")


def require_file(flag: str, path: str | None) -> None:
    if path and not os.path.isfile(path):
        fail(f"--{flag}={path}: no such file")
