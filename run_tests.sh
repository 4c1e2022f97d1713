#!/usr/bin/env bash
# The project's test command: every Python test once (pytest, 8 CPU devices),
# then Bazel's C++ unit tests. Bazel's pytest targets (one per tests/test_*.py)
# are for GPU hosts (`bazel test //... --config=gpu`); here pytest already ran
# those files. GPU tests are skipped without GPUs (on a GPU host:
# python -m pytest -m "gpu or multi_gpu", or tools/gpu_checks.sh OUT_DIR tests).
set -euo pipefail
cd "$(dirname "$0")"
python -m pytest -q "$@"
bazel test //... --test_tag_filters=-gpu,-multi_gpu,-pytest --test_output=errors
