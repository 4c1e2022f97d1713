#!/usr/bin/env bash
# The project's test command: the Python tests (8 CPU devices), then Bazel's
# C++ unit tests and Python test targets. GPU tests are skipped without GPUs
# (run them on a GPU host with: python -m pytest -m "gpu or multi_gpu").
set -euo pipefail
cd "$(dirname "$0")"
python -m pytest -q "$@"
bazel test //... --test_output=errors
