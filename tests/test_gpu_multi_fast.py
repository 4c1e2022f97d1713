"""The staged (FAST) all-to-all on 2 and 4 GPUs: the CUDA custom call (NCCL
send/recv on XLA's communicator) and the pure_callback path deliver exactly
the rows of a direct ragged all-to-all, bit for bit, on one real server and
on 2 / 4 emulated servers; stale buffers never leak; XLA keeps the custom
call out of CUDA graphs and it stays exact with command buffers on.

Also runnable as a script (used by the command-buffer test):
    python tests/test_gpu_multi_fast.py RANKS
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax.fast import plan as pl
from moe_jax.fast import staged, staged_ffi, topology as tp, workloads
from fast_testing import counts_matrix, expected_out, mesh_of, run_and_check
from moe_testing import needs_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
TOPOLOGIES = {2: ["1x2", "2x1"], 4: ["1x4", "2x2", "4x1"]}
CASES = [(r, t) for r in (2, 4) for t in TOPOLOGIES[r]]
KINDS = ("zipf", "uniform", "one_hot", "overflow")
HIDDEN = 256


def _needs_custom_call():
  if not staged_ffi.available():
    pytest.skip("moe_jax_fast_staged_all_to_all not built (needs NCCL headers)")


@pytest.mark.parametrize("ranks, topology", CASES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", ["custom_call", "callback"])
def test_bit_exact_on_gpus(ranks, topology, kind, impl):
  needs_gpus(ranks)
  if impl == "custom_call":
    _needs_custom_call()
  rows, out_rows = 96, 112
  rng = np.random.default_rng(1000 * ranks + 10 * KINDS.index(kind) + len(topology))
  counts = counts_matrix(rng, kind, ranks, rows, out_rows)
  t = run_and_check(ranks, topology, counts, rows=rows, out_rows=out_rows,
                    tail=(HIDDEN,), dtype=jnp.bfloat16, impl=impl,
                    transport="lax", backend="gpu", seed=ranks)
  assert t.sum() > 0


@pytest.mark.parametrize("ranks, topology", [(2, "2x1"), (4, "2x2"), (4, "4x1")])
@pytest.mark.parametrize("dtype, tail", [(jnp.float32, (3, 5)), (jnp.int8, (7,)),
                                         (jnp.bfloat16, (4096,))])
def test_dtypes_and_production_rows(ranks, topology, dtype, tail):
  needs_gpus(ranks)
  _needs_custom_call()
  rows = 2048 if tail == (4096,) else 64
  rng = np.random.default_rng(ranks + len(tail))
  counts = workloads.zipf_matrix(rng, ranks, 0.9, mean=0.8 * rows / ranks)
  run_and_check(ranks, topology, counts, rows=rows, out_rows=rows * 2, tail=tail,
                dtype=dtype, impl="custom_call", transport="lax", backend="gpu")


@pytest.mark.parametrize("ranks, topology", [(2, "2x1"), (4, "2x2")])
def test_fresh_counts_every_call_no_stale_rows(ranks, topology):
  """One compiled program, many calls with new counts: out rows past the
  received total are zero every time (buffers XLA reuses are not trusted),
  and the workspace of one call never leaks into the next."""
  needs_gpus(ranks)
  _needs_custom_call()
  rng = np.random.default_rng(7)
  for step, kind in enumerate(["uniform", "one_hot", "zipf", "overflow", "zipf",
                               "one_hot"]):
    counts = counts_matrix(rng, kind, ranks, 48, 48)
    run_and_check(ranks, topology, counts, rows=48, out_rows=48, tail=(HIDDEN,),
                  dtype=jnp.bfloat16, impl="custom_call", transport="lax",
                  backend="gpu", seed=step)


def test_round_trip_in_a_loop_on_four_gpus():
  """A jitted fori_loop sends rows out and back 5 times on 2 emulated
  servers: they return exactly (each iteration re-plans on the host)."""
  needs_gpus(4)
  _needs_custom_call()
  ranks, rows = 4, 64
  mesh = mesh_of(ranks, "gpu")

  def body(x, counts):
    def step(_, y):
      out, got = staged.staged_all_to_all(y, counts[0], axis_name="ep",
                                          topology="2x2", out_rows=rows,
                                          impl="custom_call")
      back, _ = staged.staged_all_to_all(out, got, axis_name="ep",
                                         topology="2x2", out_rows=rows,
                                         impl="custom_call")
      return back
    return jax.lax.fori_loop(0, 5, step, x)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                             out_specs=P("ep")))
  rng = np.random.default_rng(5)
  counts = pl.effective_traffic(workloads.zipf_matrix(rng, ranks, 0.9, mean=12),
                                rows, rows)
  x = rng.standard_normal((ranks * rows, HIDDEN)).astype(np.float32)
  shard = NamedSharding(mesh, P("ep"))
  back = np.asarray(fn(jax.device_put(jnp.asarray(x, jnp.bfloat16), shard),
                       jax.device_put(jnp.asarray(counts, jnp.int32), shard)))
  xb = np.asarray(jnp.asarray(x, jnp.bfloat16))
  for r in range(ranks):
    n = int(counts[r].sum())
    np.testing.assert_array_equal(back[r * rows:r * rows + n].view(np.uint16),
                                  xb[r * rows:r * rows + n].view(np.uint16))
    assert not back[r * rows + n:(r + 1) * rows].view(np.uint16).any()


def test_too_small_workspace_fails_on_every_rank():
  """A workspace smaller than the plan needs is an error on all four ranks
  (decided on the whole plan), not a hang; the exact size works."""
  needs_gpus(4)
  _needs_custom_call()
  rng = np.random.default_rng(9)
  counts = pl.effective_traffic(workloads.zipf_matrix(rng, 4, 0.9, mean=5), 24, 24)
  need = int(pl.execution_plan(counts, 2, 2).workspace_used.max())
  with pytest.raises(Exception, match="workspace rows"):
    _run_with_workspace(counts, need - 1)
  # Afterwards (the failed run's effect tokens are replaced) the exact size
  # works.
  out, x = _run_with_workspace(counts, need)
  want = expected_out(counts, x.reshape(4, 24, 2), 24)
  np.testing.assert_array_equal(out.reshape(want.shape), want)


def _run_with_workspace(counts, ws_rows, rows=24):
  mesh = mesh_of(4, "gpu")

  def body(x, c):
    return staged.staged_all_to_all(x, c[0], axis_name="ep", topology="2x2",
                                    out_rows=rows, workspace_rows=ws_rows,
                                    impl="custom_call")[0]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                             out_specs=P("ep")))
  x = np.arange(4 * rows * 2, dtype=np.float32).reshape(4 * rows, 2)
  return np.asarray(fn(jnp.asarray(x), jnp.asarray(counts, jnp.int32))), x


@pytest.mark.parametrize("ranks", [2, 4])
def test_detected_topology(ranks):
  """topology=None reads nvidia-smi topo -m; the result is exact whatever
  it finds."""
  needs_gpus(ranks)
  _needs_custom_call()
  topo = tp.detect_topology(ranks)
  assert topo.num_gpus == ranks
  rng = np.random.default_rng(ranks)
  counts = counts_matrix(rng, "zipf", ranks, 64, 64)
  run_and_check(ranks, None, counts, rows=64, out_rows=64, tail=(HIDDEN,),
                dtype=jnp.bfloat16, impl="custom_call", transport="lax",
                backend="gpu")


@pytest.mark.parametrize("ranks", [2, 4])
def test_exact_with_command_buffers_on(ranks):
  """With XLA's command buffers on for custom calls and collectives, the
  non-capturable custom call stays outside the graphs and exact."""
  needs_gpus(ranks)
  _needs_custom_call()
  env = dict(os.environ, XLA_FLAGS=(
      "--xla_gpu_graph_min_graph_size=1 "
      "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,COLLECTIVES"))
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(ranks)],
                        capture_output=True, text=True, timeout=300, env=env,
                        cwd=os.path.dirname(os.path.abspath(__file__)))
  assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
  assert "PASS" in proc.stdout, proc.stdout


def _script(ranks: int) -> None:
  """Several calls of one compiled program, 2 emulated servers when 4 GPUs."""
  topology = "2x2" if ranks == 4 else "2x1"
  rng = np.random.default_rng(11)
  for step in range(4):
    counts = counts_matrix(rng, "zipf" if step % 2 else "overflow", ranks, 64, 64)
    for impl in ("custom_call", "callback"):
      run_and_check(ranks, topology, counts, rows=64, out_rows=64, tail=(HIDDEN,),
                    dtype=jnp.bfloat16, impl=impl, transport="lax", backend="gpu",
                    seed=step)
  print("PASS", ranks, topology, os.environ.get("XLA_FLAGS", ""))


if __name__ == "__main__":
  _script(int(sys.argv[1]))
