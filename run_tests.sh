#!/usr/bin/env bash
# The project's test command: every Python test once (pytest, 8 CPU devices,
# spread over MOE_JAX_TEST_WORKERS processes: 2 by default, 0 for one
# process), then Bazel's C++ unit tests. Bazel's pytest targets (one per
# tests/test_*.py) are for GPU hosts (`bazel test //... --config=gpu`); here
# pytest already ran those files. GPU tests are skipped without GPUs; on a
# GPU host run them in one process (python -m pytest -m "gpu or multi_gpu",
# or tools/gpu_checks.sh OUT_DIR tests): parallel workers would share the GPUs.
set -euo pipefail
cd "$(dirname "$0")"
python -m pytest -q -n "${MOE_JAX_TEST_WORKERS:-2}" "$@"
bazel test //... --test_tag_filters=-gpu,-multi_gpu,-pytest --test_output=errors
