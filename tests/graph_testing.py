"""CUDA-graph replay checks shared by the GPU tests: a test file run as a
script saves the results of replays of one compiled call; this runs it with
XLA's command buffers on and off and compares the bits."""

import os
import subprocess
import sys

import numpy as np

from moe_testing import bits

GRAPH_FLAGS = {
    "graphs": "--xla_gpu_graph_min_graph_size=1 "
              "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL",
    "no_graphs": "--xla_gpu_enable_command_buffer=",
}


def assert_replays_match_without_graphs(script: str, tmp_path) -> None:
    """Runs `python script OUT.npz` in both modes (the script prints PASS) and
    checks every saved array is bitwise the same. XLA 0.11.2 forms command
    buffers from the thunk sequence, after HLO, so the compiled HLO cannot
    show whether a call was captured; this compares the results instead."""
    saved = {}
    for mode, flags in GRAPH_FLAGS.items():
        path = str(tmp_path / f"{mode}.npz")
        proc = subprocess.run([sys.executable, os.path.abspath(script), path],
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, XLA_FLAGS=flags))
        assert proc.returncode == 0 and "PASS" in proc.stdout, \
            f"{mode}:\n{proc.stdout}\n{proc.stderr}"
        saved[mode] = dict(np.load(path))
    assert saved["graphs"].keys() == saved["no_graphs"].keys()
    for name, got in saved["graphs"].items():
        np.testing.assert_array_equal(bits(got), bits(saved["no_graphs"][name]), err_msg=name)
