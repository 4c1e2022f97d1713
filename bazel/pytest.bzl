"""py_test targets that run pytest on one test file each.

The tests run with the project's Python environment (see bazel/python_env.bzl
and the toolchain registered in //:WORKSPACE), in which moe_jax is
pip-installed; Bazel does not build moe_jax itself.

Tags:
  "pytest"            every target made here (CI can skip them all with
                      --test_tag_filters=-gpu,-multi_gpu,-pytest);
  "gpu"               tests/test_gpu_*.py;
  "gpu", "multi_gpu"  tests/test_gpu_multi_*.py.
GPU targets are also "exclusive" (one at a time: JAX preallocates most of the
GPU memory). //:.bazelrc skips gpu/multi_gpu unless --config=gpu.
"""

load("@rules_python//python:defs.bzl", "py_test")

_PYTEST_MAIN = "@moe_jax_python//:pytest_main.py"

def gpu_tags(src):
    """The tags implied by a test file's name."""
    base = src.split("/")[-1]
    if base.startswith("test_gpu_multi_"):
        return ["gpu", "multi_gpu", "exclusive"]
    if base.startswith("test_gpu_"):
        return ["gpu", "exclusive"]
    return []

def pytest_test(name, src, deps = [], data = [], args = [], tags = [], size = "large", **kwargs):
    """One py_test running `python -m pytest <src>` (pytest_main.py).

    Args:
      name: target name.
      src: the test file (in this package).
      deps: py_library targets (e.g. conftest.py and shared helpers).
      data: other files the test reads (e.g. //:pyproject.toml for pytest's config).
      args: extra pytest arguments.
      tags: extra tags; "pytest" and the gpu tags of gpu_tags(src) are added.
      size: test size (default "large": 15-minute timeout).
      **kwargs: passed to py_test (env, timeout, flaky, ...).
    """
    all_tags = ["pytest"] + [t for t in gpu_tags(src) if t not in tags] + tags
    py_test(
        name = name,
        srcs = [src, _PYTEST_MAIN],
        main = _PYTEST_MAIN,
        args = ["$(rootpath %s)" % src] + args,
        deps = deps,
        data = data,
        legacy_create_init = 0,  # no __init__.py in runfiles: tests/ stays a plain folder for pytest
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        tags = all_tags,
        **kwargs
    )

def pytest_suite(srcs, deps = [], data = [], tags = [], **kwargs):
    """A pytest_test per file of srcs, each named after its file (test_foo.py -> :test_foo).

    Args:
      srcs: test files, e.g. glob(["test_*.py"]).
      deps, data, tags, **kwargs: passed to every pytest_test.
    """
    for src in srcs:
        pytest_test(
            name = src.split("/")[-1][:-len(".py")],
            src = src,
            deps = deps,
            data = data,
            tags = tags,
            **kwargs
        )
