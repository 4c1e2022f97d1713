"""moe_jax_grouped_matmul (CUTLASS SM90 grouped GEMM) on one Hopper GPU:
results against lax.ragged_dot on float32 copies of the inputs, rows
bitwise the same for any number of rows, gradients against XLA's, CUDA-graph
replays with changing group sizes, and the MoE layer on top of it.

Run as a script (python tests/test_gpu_grouped_matmul.py OUT.npz), it saves
the results of replays of one compiled call; the graph test runs it with and
without command buffers and compares the bits.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import moe_jax as mj
from moe_jax.ops import grouped_matmul as gmm
from graph_testing import assert_replays_match_without_graphs
from moe_testing import bits
from row_invariant_testing import group_rows

pytestmark = pytest.mark.gpu

DTYPES = [jnp.bfloat16, jnp.float16]


@pytest.fixture(autouse=True)
def _hopper():
    if not gmm.cutlass_applies(jnp.bfloat16, 8, 8, "gpu"):
        pytest.skip("needs a Hopper GPU and the CUDA handlers")


def _case(rng, sizes, rows, k, n, dtype, groups=None):
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((groups or len(sizes), k, n)) * k ** -0.5, dtype)
    return jax.device_put((x, w, jnp.asarray(sizes, jnp.int32)), jax.devices("gpu")[0])


def _reference(x, w, sizes):
    """float32 ragged_dot of the (exact) float32 values, on the CPU."""
    cpu = jax.devices("cpu")[0]
    x, w, sizes = jax.device_put((x.astype(jnp.float32), w.astype(jnp.float32), sizes), cpu)
    return np.asarray(jax.jit(gmm._ragged_dot)(x, w, sizes))


def _assert_close(got, want, x, w, out_dtype):
    """Within the output rounding plus float32 sums of K products."""
    eps = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11,
           jnp.dtype(jnp.float32): 0.0}[jnp.dtype(out_dtype)]
    mag = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).max(0)
    tol = eps * np.abs(want) + (x.shape[1] + 16) * 2.0**-22 * mag + 1e-30
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= tol), f"max excess {np.max(err - tol)}"


# (sizes, extra rows, K, N): one group of every row, empty groups, partial
# tiles, padding rows, sizes past M, negative sizes, M = 0.
SHAPES = [
    ([64], 0, 64, 64),
    ([0, 130, 0, 0], 5, 128, 96),
    ([5, 0, 129, 1, 255, 17], 11, 200, 136),
    ([-4, 40, 0, 300], -100, 64, 512),
    ([0, 0, 0], 0, 64, 64),
    ([333, 0, 90, 600], 7, 1024, 512),
]


@pytest.mark.parametrize("out_f32", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes, extra, k, n", SHAPES)
def test_matches_ragged_dot_and_zeroes_the_tail(sizes, extra, k, n, dtype, out_f32):
    rng = np.random.default_rng(k + n + len(sizes))
    rows = max(0, sum(max(s, 0) for s in sizes) + extra)
    x, w, gs = _case(rng, sizes, rows, k, n, dtype)
    out_dtype = jnp.float32 if out_f32 else dtype
    got = np.asarray(jax.jit(lambda x, w, s: gmm.grouped_matmul(
        x, w, s, out_dtype=out_dtype, impl="cutlass"))(x, w, gs))
    assert got.shape == (rows, n) and got.dtype == jnp.dtype(out_dtype)
    _, covered = group_rows(sizes, rows)
    assert not bits(got[covered:]).any(), "rows past sum(group_sizes) must be +0.0"
    _assert_close(got, _reference(x, w, gs), x, w, out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes, extra, k, n", SHAPES)
def test_fused_swiglu_matches_the_unfused_expert(sizes, extra, k, n, dtype):
    rng = np.random.default_rng(3 * k + n)
    rows = max(0, sum(max(s, 0) for s in sizes) + extra)
    x, w, gs = _case(rng, sizes, rows, k, 2 * n, dtype)
    got = np.asarray(jax.jit(lambda x, w, s: gmm.swiglu(x, w, s, impl="cutlass"))(x, w, gs),
                     np.float64)
    h = _reference(x, w, gs)
    gate, up = gmm.split_gate_up(h)
    want = np.asarray(jax.nn.silu(gate) * up, np.float64)
    g_mag, u_mag = (np.abs(np.asarray(a, np.float64)) for a in gmm.split_gate_up(
        np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).max(0)))
    eps = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-11
    sum_eps = (k + 16) * 2.0**-22
    tol = eps * np.abs(want) + sum_eps * (1.2 * g_mag * np.abs(up) + np.abs(gate) * u_mag) + 1e-30
    assert np.all(np.abs(got - want) <= tol)


@settings(max_examples=20)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=8), st.integers(0, 40),
       st.sampled_from([64, 256, 1024]), st.sampled_from([64, 200, 512]),
       st.sampled_from(["forward", "forward_f32", "swiglu", "transposed"]),
       st.integers(0, 2**31 - 1))
def test_rows_do_not_depend_on_the_other_rows(sizes, extra, k, n, op, seed):
    """A call on a random subset of each group's rows (plus padding) gives
    bitwise the full call's rows: the kernel is row-invariant."""
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    if op == "transposed":  # dy [M, n] against w [G, k, n]
        x, _, gs = _case(rng, sizes, total + extra, n, n, jnp.bfloat16)
        w = jax.device_put(jnp.asarray(rng.standard_normal((len(sizes), k, n)) * n ** -0.5,
                                       jnp.bfloat16), jax.devices("gpu")[0])
    else:
        x, w, gs = _case(rng, sizes, total + extra, k, 2 * n if op == "swiglu" else n,
                         jnp.bfloat16)
    fn = {"forward": lambda x, w, s: gmm.grouped_matmul(x, w, s, impl="cutlass"),
          "forward_f32": lambda x, w, s: gmm.grouped_matmul(x, w, s, out_dtype=jnp.float32,
                                                            impl="cutlass"),
          "swiglu": lambda x, w, s: gmm.swiglu(x, w, s, impl="cutlass"),
          "transposed": lambda x, w, s: gmm._input_grad(x, w, s)}[op]
    fn = jax.jit(fn)
    full = np.asarray(fn(x, w, gs))
    keep = rng.random(total) < 0.5
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    sub_sizes = jnp.asarray(np.bincount(group_of[keep], minlength=len(sizes)), jnp.int32)
    sub_x = jnp.concatenate([x[:total][np.flatnonzero(keep)], x[total:total + 3]])
    sub = np.asarray(fn(sub_x, w, sub_sizes))
    np.testing.assert_array_equal(bits(sub[:int(keep.sum())]), bits(full[:total][keep]))


@pytest.mark.parametrize("batch", [1, 3, 16, 65, 500])
def test_decode_batches_match_the_prefill_call(batch):
    """A full call on 1824 rows vs calls on consecutive batches of one
    group's rows (a decode step's tokens): the same bits."""
    rng = np.random.default_rng(batch)
    sizes = [400, 0, 624, 800]
    x, w, gs = _case(rng, sizes, sum(sizes), 512, 768, jnp.bfloat16)
    fn = jax.jit(lambda x, w, s: gmm.swiglu(x, w, s, impl="cutlass"))
    full = np.asarray(fn(x, w, gs))
    for start in list(range(400, 1024 - batch + 1, batch))[:4]:
        part = np.asarray(fn(x[start:start + batch], w, jnp.asarray([0, 0, batch, 0], jnp.int32)))
        np.testing.assert_array_equal(bits(part), bits(full[start:start + batch]))


@pytest.mark.parametrize("fused", [False, True])
def test_gradients_match_xla(fused):
    rng = np.random.default_rng(11 + fused)
    sizes = [70, 0, 130, 33]
    x, w, gs = _case(rng, sizes, 240, 256, 384, jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((240, 192 if fused else 384)), jnp.float32)

    def loss(impl):
        if fused:
            f = lambda x, w: gmm.swiglu(x, w, gs, impl=impl)  # noqa: E731
        else:
            f = lambda x, w: gmm.grouped_matmul(x, w, gs, impl=impl)  # noqa: E731
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * cot),
                                argnums=(0, 1)))

    got = loss("cutlass")(x, w)
    want = loss("xla")(x, w)
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r)
    # Rows past the groups get no gradient; the empty group's weights none.
    assert not np.asarray(got[0], np.float32)[233:].any()
    assert not np.asarray(got[1], np.float32)[1].any()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rows, sizes", [
    (1, [1]), (96, [60]), (512, [512]), (300, [-3]), (513, [400]),
    (64, [20, 0, 30]), (256, [100, 156]), (257, [100, 100]), (128, [0, 9, 50, 3, 0, 0, 7, 1])])
def test_auto_runs_few_tiles_as_a_dense_matmul(rows, sizes, fused):
    """impl="auto" where the grouped kernel would have fewer tiles than SMs
    and the rows are few (gmm.dense_instead): one batched cuBLAS matmul, not
    the grouped kernel; the same values (to rounding), a zero tail, and the
    gradients of XLA's path. Past the bounds the grouped kernel runs."""
    rng = np.random.default_rng(rows + 7 * fused + len(sizes))
    k, n = 256, 384
    x, w, gs = _case(rng, sizes, rows, k, n, jnp.bfloat16)
    op = gmm.swiglu if fused else gmm.grouped_matmul
    fn = jax.jit(lambda x, w, s: op(x, w, s, impl="auto"))
    hlo = fn.lower(x, w, gs).as_text()
    dense = gmm.dense_instead(len(sizes), rows, n)
    assert dense == (rows <= (512 if len(sizes) == 1 else 256) and len(sizes) * rows <= 1024)
    assert (gmm.GROUPED_MATMUL in hlo) == (not dense)
    got = np.asarray(fn(x, w, gs), np.float64)
    covered = min(sum(max(s, 0) for s in sizes), rows)
    assert not bits(np.asarray(fn(x, w, gs))[covered:]).any()
    h = _reference(x, w, gs)
    if fused:
        gate, up = gmm.split_gate_up(h)
        want = np.asarray(jax.nn.silu(gate) * up, np.float64)
    else:
        want = np.asarray(h, np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want) + 1e-30
    cot = jnp.asarray(rng.standard_normal(got.shape), jnp.float32)

    def grads(impl):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(
            op(x, w, gs, impl=impl).astype(jnp.float32) * cot), argnums=(0, 1)))(x, w)

    for g, r in zip(grads("auto"), grads("xla")):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r) + 1e-30


def test_moe_layer_strategies_are_bitwise_equal_on_one_gpu():
    """matmul="row_invariant" runs the CUTLASS kernels; every strategy (P = 1)
    gives dense's bits, and the output is close to the float32 reference."""
    config = mj.MoEConfig(hidden_size=256, ffn_size=512, num_experts=8, top_k=2,
                          strategy="dense", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                          matmul="row_invariant")
    params = mj.init_moe_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (96, 256), jnp.bfloat16)
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices("gpu")[:1])
    outs = {}
    for strategy in ("dense", "max_counts", "cap_and_spill", "ragged"):
        cfg = config.replace(strategy=strategy, capacity=8, spill_capacity=4)
        outs[strategy] = np.asarray(jax.jit(
            lambda p, x, cfg=cfg: mj.moe_layer(p, x, cfg, mesh)[0])(params, x))
    for strategy, out in outs.items():
        np.testing.assert_array_equal(bits(out), bits(outs["dense"]), err_msg=strategy)
    ref_cfg = config.replace(dtype=jnp.float32, param_dtype=jnp.float32, matmul="xla")
    ref_params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    ref = np.asarray(jax.jit(lambda p, x: mj.moe_layer(p, x, ref_cfg)[0])(
        ref_params, x.astype(jnp.float32)))
    rel = np.linalg.norm(outs["dense"].astype(np.float64) - ref) / np.linalg.norm(ref)
    assert rel < 1e-2


def test_cuda_graph_replays_with_changing_group_sizes(tmp_path):
    """One compiled call replayed with other inputs and group sizes: the same
    bits with command buffers on as with them off."""
    assert_replays_match_without_graphs(__file__, tmp_path)


def _replay_and_save(out_path: str) -> None:
    rng = np.random.default_rng(21)
    results = {}
    fn = jax.jit(lambda x, w, s: 2.0 * gmm.swiglu(x, w, s, impl="cutlass").astype(jnp.float32))
    for replay in range(4):
        sizes = [0, 316, 0, 0] if replay == 2 else list(rng.integers(0, 80, size=4))
        x, w, gs = _case(rng, sizes, 320, 96, 272, jnp.bfloat16)
        results[f"swiglu_{replay}"] = np.asarray(fn(x, w, gs))
    np.savez(out_path, **results)
    print("PASS")


if __name__ == "__main__":
    _replay_and_save(sys.argv[1])
