"""On 2 and 4 GPUs (and a 2 x 2 data x expert mesh): every strategy and
transport delivers the rows `dense` delivers, bit for bit; CUDA-graph
replays and 2 processes stay exact."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax as mj
from moe_testing import (ROUTINGS, bits, expected_rank_rows, mesh_of, needs_gpus, random_case,
                         rel_error, run_dense, run_strategy)

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
HIDDEN, FFN = 256, 128
SCRIPTS = os.path.join(os.path.dirname(__file__), "gpu_scripts")


CASES = [("max_counts", None, None), ("cap_and_spill", 1, 1), ("cap_and_spill", 3, 2),
         ("ragged", None, None)]


# (data groups, ranks per group): the 2 x 2 mesh runs one expert-parallel
# group per data index (NCCL communicators and NVLink channels per group).
LAYOUTS = [(1, 2), (1, 4), (2, 2)]


@pytest.mark.parametrize("data, ranks", LAYOUTS)
@pytest.mark.parametrize("strategy, capacity, spill", CASES)
@pytest.mark.parametrize("transport", ["lax", "custom_call", "nvlink"])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_rows_match_dense_on_gpus(data, ranks, strategy, capacity, spill, transport, kind):
    needs_gpus(data * ranks)
    if transport == "nvlink" and strategy == "max_counts":
        pytest.skip("max_counts pads by definition; the NVLink transport moves real rows")
    if transport == "custom_call" and strategy == "ragged":
        pytest.skip("no ragged exchange over NCCL (an error; tests/test_transport.py)")
    num_experts = 2 * ranks
    seed = 100 * ranks + 1000 * data + ROUTINGS.index(kind)
    x, ids, w = random_case(seed, data * ranks, 24, num_experts, 2, HIDDEN, kind, jnp.bfloat16)
    experts = mj.init_expert_weights(jax.random.key(3), num_experts, HIDDEN, FFN)
    out, rows, valid, stats = run_strategy(strategy, x, ids, w, experts, ranks,
                                           capacity=capacity, spill=spill, transport=transport,
                                           backend="gpu", data=data)
    group_tokens = 24 * ranks
    for g in range(data):
        part = slice(g * group_tokens, (g + 1) * group_tokens)
        ref_out, ref_rows, ref_sizes = run_dense(x[part], ids[part], w[part], experts)
        for r, expected in enumerate(expected_rank_rows(ref_rows, ref_sizes, ranks)):
            rank, n = g * ranks + r, expected.shape[0]
            assert valid[rank, :n].all() and not valid[rank, n:].any()
            np.testing.assert_array_equal(bits(rows[rank, :n]), bits(expected),
                                          err_msg=f"group {g} rank {r}: rows differ from dense")
        assert rel_error(out[part], ref_out) < 1e-2
        assert int(np.asarray(stats.rows).reshape(-1)[g]) == ids[part].size


@pytest.mark.parametrize("data, ranks", LAYOUTS)
@pytest.mark.parametrize("strategy, capacity, spill", CASES)
@pytest.mark.parametrize("transport", ["lax", "custom_call", "nvlink"])
def test_row_invariant_layer_output_is_the_dense_bits(data, ranks, strategy, capacity, spill,
                                                      transport):
    """With MoEConfig.matmul='row_invariant' the layer's output on
    data * ranks GPUs is bitwise the output of 'dense' on one GPU."""
    needs_gpus(data * ranks)
    if transport == "nvlink" and strategy == "max_counts":
        pytest.skip("max_counts pads by definition; the NVLink transport moves real rows")
    if transport == "custom_call" and strategy == "ragged":
        pytest.skip("no ragged exchange over NCCL (an error; tests/test_transport.py)")
    config = mj.MoEConfig(hidden_size=HIDDEN, ffn_size=FFN, num_experts=2 * ranks, top_k=2,
                          strategy=strategy, capacity=capacity, spill_capacity=spill,
                          transport=transport, matmul="row_invariant",
                          data_axes=("data",) if data > 1 else ())
    params = mj.init_moe_params(jax.random.key(7), config)
    x = jax.random.normal(jax.random.key(8 + ranks), (2, 24 * ranks * data, HIDDEN))
    dense = config.replace(strategy="dense", transport="lax")
    want = jax.jit(lambda p, x: mj.moe_layer(p, x, dense)[0])(params, x)
    mesh = mesh_of(ranks, "gpu", data)
    got = jax.jit(lambda p, x: mj.moe_layer(p, x, config, mesh)[0])(params, x)
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))


def _run_script(name, *args, env=None, timeout=300):
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, name), *args],
                          capture_output=True, text=True, timeout=timeout, env=full_env)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("ranks", [2, 4])
def test_cuda_graph_replays_stay_exact(ranks):
    needs_gpus(ranks)
    flags = ("--xla_gpu_graph_min_graph_size=1 "
             "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,COLLECTIVES")
    out = _run_script("graph_replay_check.py", str(ranks), env={"XLA_FLAGS": flags})
    assert "PASS" in out, out


def test_two_processes_under_jax_distributed():
    needs_gpus(2)
    out = _run_script("multiprocess_check.py", "2")
    assert out.count("PASS") == 2, out
