"""Repository rules that bind the build to the project's Python environment.

Both rules pick the interpreter the same way (nothing is hard-coded):

  1. $MOE_JAX_PYTHON, when set (a path, or a command name looked up on PATH);
  2. <workspace>/.venv/bin/python, when it exists (what CI creates);
  3. `python3` from PATH.

The chosen interpreter is canonicalized to its `sys.executable` (so a pyenv
shim becomes the real binary, while a virtualenv's bin/python stays as is).

  moe_jax_python_repository: a Python toolchain (py_runtime) for that
      interpreter, plus pytest_main.py, the entry point of the py_test targets
      made by //:bazel/pytest.bzl. Register its toolchain in WORKSPACE.
  xla_ffi_headers_repository: the XLA FFI headers shipped with jaxlib
      (`jax.ffi.include_dir()` of that interpreter) as a cc_library.

Both are `local` and `configure` repositories: Bazel re-runs them when
MOE_JAX_PYTHON or PATH change, after a server restart and on
`bazel sync --configure`. To pick up a .venv created after the first build,
run `bazel shutdown` (or `bazel sync --configure`).
"""

_ENV_VAR = "MOE_JAX_PYTHON"

_PROBE = "import sys; print(sys.executable); print('%d.%d.%d' % sys.version_info[:3])"

def _workspace_root(rctx):
    return rctx.path(Label("//:WORKSPACE")).dirname

def find_python(rctx):
    """Returns struct(path, version, source) of the project's Python interpreter."""
    requested = rctx.os.environ.get(_ENV_VAR, "").strip()
    if requested:
        source = "$" + _ENV_VAR
        if "/" in requested:
            candidate = rctx.path(requested)
            if not candidate.exists:
                candidate = rctx.path("%s/%s" % (_workspace_root(rctx), requested))
        else:
            candidate = rctx.which(requested)
        if candidate == None or not candidate.exists:
            fail("%s=%s: no such interpreter" % (_ENV_VAR, requested))
    else:
        candidate = rctx.path("%s/.venv/bin/python" % _workspace_root(rctx))
        source = "<workspace>/.venv"
        if not candidate.exists:
            candidate = rctx.which("python3")
            source = "python3 on PATH"
            if candidate == None:
                fail("No Python found: set %s, create <workspace>/.venv, or put python3 on PATH" % _ENV_VAR)

    result = rctx.execute([str(candidate), "-c", _PROBE])
    if result.return_code != 0:
        fail("Cannot run the Python interpreter %s (from %s):\n%s" %
             (candidate, source, result.stderr))
    lines = result.stdout.strip().split("\n")
    executable = lines[0].strip() or str(candidate)
    return struct(path = executable, version = lines[-1].strip(), source = source)

_PYTEST_MAIN = '''"""Entry point of the py_test targets of //:bazel/pytest.bzl (generated).

Usage: pytest_main.py TEST_FILE [PYTEST_ARGS...]; TEST_FILE is relative to the
test's working directory (the workspace's runfiles directory). More pytest
arguments: `bazel test --test_arg=...`; `bazel test --test_filter=EXPR` is
pytest's `-k EXPR`.

Runs `python -m pytest TEST_FILE` with this same interpreter ({python}),
after removing the runfiles directories Bazel's launcher put on PYTHONPATH, so
that `moe_jax` is the package installed in the environment (editable install)
and not something from the runfiles tree. pytest puts the test file's folder
(tests/, next to conftest.py and moe_testing.py) on sys.path itself, and finds
the project's [tool.pytest.ini_options] in the pyproject.toml of the runfiles.
"""

import os
import sys
import tempfile


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: pytest_main.py TEST_FILE [PYTEST_ARGS...]")
    test_file = os.path.abspath(sys.argv[1])
    runfiles = [os.path.abspath(p) for p in (os.environ.get("TEST_SRCDIR"),
                                             os.environ.get("RUNFILES_DIR")) if p]
    # This file is <runfiles>/<this repository>/pytest_main.py.
    runfiles.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def in_runfiles(entry):
        entry = os.path.abspath(entry or ".")
        return any(entry == r or entry.startswith(r + os.sep) for r in runfiles)

    env = dict(os.environ)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not in_runfiles(p)]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        env.pop("PYTHONPATH", None)

    args = [sys.executable, "-m", "pytest", test_file, "-p", "no:cacheprovider", "-ra"]
    if env.get("XML_OUTPUT_FILE"):
        args.append("--junitxml=" + env["XML_OUTPUT_FILE"])
    if env.get("TESTBRIDGE_TEST_ONLY"):  # bazel test --test_filter=EXPR
        args += ["-k", env["TESTBRIDGE_TEST_ONLY"]]
    args += sys.argv[2:]

    # Run from the test's private temporary directory (a fresh one under
    # `bazel run`): nothing (.hypothesis, caches) is written into the runfiles
    # tree, and the working directory (first on sys.path under `-m`) is not the
    # runfiles tree, whose moe_jax/ sources would shadow the installed package.
    tmp = env.get("TEST_TMPDIR")
    if tmp:
        os.makedirs(tmp, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="pytest_main.")
    os.chdir(tmp)
    print("pytest_main: %s %s" % (sys.executable, " ".join(args[1:])), flush=True)
    os.execve(sys.executable, args, env)


if __name__ == "__main__":
    main()
'''

_PYTHON_BUILD = '''# Generated by //:bazel/python_env.bzl (moe_jax_python_repository).
# Interpreter: {python} (Python {version}, chosen from {source}).
load("@rules_python//python:defs.bzl", "py_runtime", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

exports_files(["pytest_main.py", "interpreter.txt"])

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
'''

def _moe_jax_python_repository_impl(rctx):
    python = find_python(rctx)
    fields = dict(python = python.path, version = python.version, source = python.source)
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    rctx.file("BUILD", _PYTHON_BUILD.format(**fields))
    rctx.file("pytest_main.py", _PYTEST_MAIN.format(**fields))
    rctx.file("interpreter.txt", "%s\n%s\n%s\n" % (python.path, python.version, python.source))

moe_jax_python_repository = repository_rule(
    implementation = _moe_jax_python_repository_impl,
    environ = [_ENV_VAR, "PATH"],
    local = True,
    configure = True,
    doc = "The project's Python interpreter as a py_runtime toolchain, and the pytest entry point.",
)

_XLA_FFI_BUILD = '''# Generated by //:bazel/python_env.bzl (xla_ffi_headers_repository).
# include/ -> {include} (jax.ffi.include_dir() of {python}).
load("@rules_cc//cc:defs.bzl", "cc_library")

package(default_visibility = ["//visibility:public"])

cc_library(
    name = "{name}",
    hdrs = glob(["include/xla/ffi/api/*.h"]),
    includes = ["include"],
)
'''

def _xla_ffi_headers_repository_impl(rctx):
    python = find_python(rctx)
    result = rctx.execute([python.path, "-c", "import jax.ffi; print(jax.ffi.include_dir())"])
    if result.return_code != 0:
        fail(("Cannot find the XLA FFI headers: `import jax.ffi` failed with %s (from %s). " +
              "Install the project's Python environment (pip install -e .) or set %s.\n%s") %
             (python.path, python.source, _ENV_VAR, result.stderr))
    include = result.stdout.strip().split("\n")[-1].strip()
    if not rctx.path(include + "/xla/ffi/api/ffi.h").exists:
        fail("jax.ffi.include_dir() = %s has no xla/ffi/api/ffi.h" % include)
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    rctx.symlink(include, "include")
    rctx.file("BUILD", _XLA_FFI_BUILD.format(name = rctx.name, include = include, python = python.path))

xla_ffi_headers_repository = repository_rule(
    implementation = _xla_ffi_headers_repository_impl,
    environ = [_ENV_VAR, "PATH"],
    local = True,
    configure = True,
    doc = "The XLA FFI headers of the project's jaxlib, as cc_library @<name>//:<name>.",
)
