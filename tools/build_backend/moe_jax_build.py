"""PEP 517 backend of moe_jax: scikit-build-core, plus the CUTLASS headers
(the nvidia-cutlass wheel) as a build requirement when the CUDA handlers
will be built.

The CUDA handlers are built when MOE_JAX_CUDA is ON, or AUTO (the default)
and nvcc is found; the -C cmake.define.MOE_JAX_CUDA=... setting overrides
the environment, as it does for CMake.
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)

CUTLASS_REQUIREMENT = "nvidia-cutlass==4.2.0.0"


def _cuda_setting(config_settings) -> str:
    settings = config_settings or {}
    for key in ("cmake.define.MOE_JAX_CUDA", "cmake.define.MOE_JAX_CUDA:STRING"):
        if key in settings:
            return str(settings[key]).upper()
    return os.environ.get("MOE_JAX_CUDA", "AUTO").upper()


def _nvcc_found() -> bool:
    cudacxx = os.environ.get("CUDACXX")
    if cudacxx and os.path.exists(cudacxx):
        return True
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


def _builds_cuda(config_settings) -> bool:
    setting = _cuda_setting(config_settings)
    if setting in ("OFF", "0", "FALSE", "NO"):
        return False
    return setting in ("ON", "1", "TRUE", "YES") or _nvcc_found()


def _with_cutlass(requires, config_settings):
    return list(requires) + ([CUTLASS_REQUIREMENT] if _builds_cuda(config_settings) else [])


def get_requires_for_build_wheel(config_settings=None):
    return _with_cutlass(_scikit_build.get_requires_for_build_wheel(config_settings),
                         config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _with_cutlass(_scikit_build.get_requires_for_build_editable(config_settings),
                         config_settings)
