"""Helpers of the async EP tests shared by the CPU and GPU files."""

import jax
import numpy as np

from moe_jax.async_ep.baseline import SyncEngine
from moe_jax.async_ep.executor import AsyncEngine
from moe_jax.async_ep.requests import Request
from moe_jax.async_ep.schedulers import make_scheduler


def random_requests(num, vocab, seed, max_prompt=4, max_new=5, arrivals=None):
    """Requests with random prompts, lengths and arrival ticks in [0, 6)
    (or the given `arrivals`)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        length = int(rng.integers(1, max_prompt + 1))
        prompt = [int(t) for t in rng.integers(0, vocab, size=length)]
        arrival = int(rng.integers(0, 6)) if arrivals is None else arrivals[i]
        out.append(Request(i, prompt, int(rng.integers(1, max_new + 1)), arrival=arrival))
    return out


def kernel_rows_by_count(kernels, device, counts, seed=0):
    """Runs attention, expert and sampler of `kernels` on the first n of the
    same random rows for every n in `counts`; returns {n: [arrays]} of the
    n returned rows of every output (attention on a random, freshly built
    KV cache whose slot i serves row i)."""
    c = kernels.config
    rng = np.random.default_rng(seed)
    rows = max(counts)
    x = rng.normal(size=(rows, c.hidden)).astype(np.float32)
    pos = rng.integers(0, c.max_len, rows).astype(np.int32)
    slot = np.arange(rows, dtype=np.int32)
    cache_kv = rng.normal(size=(2, rows + 1, c.max_len, c.hidden)).astype(np.float32)
    out = {}
    for n in counts:
        cache = (jax.device_put(cache_kv[0], device), jax.device_put(cache_kv[1], device))
        h, u, ids, w, _ = kernels.attention(device, 0, x[:n], pos[:n], slot[:n], cache, rows)
        out[n] = [h, u, ids, w, kernels.expert(device, 0, 0, x[:n]),
                  kernels.sampler(device, x[:n])]
    return out


def assert_rows_independent_of_count(by_count):
    """Every row of every output is bitwise the same whatever the row count."""
    largest = by_count[max(by_count)]
    for n, outs in by_count.items():
        for i, (got, ref) in enumerate(zip(outs, largest)):
            np.testing.assert_array_equal(
                np.asarray(got).view(np.uint8), np.asarray(ref)[:n].view(np.uint8),
                err_msg=f"output {i} of {n} rows differs from the same rows among "
                        f"{max(by_count)}")


def async_and_sync_outputs(kernels, requests, num_devices, num_ranks, slots, platform,
                           schedulers=("defrag", "mtfs", "flfs")):
    """{engine name: {request id: generated tokens}} of the synchronous
    baseline and the asynchronous engine with each scheduler."""
    common = dict(num_devices=num_devices, num_ranks=num_ranks, slots_per_rank=slots,
                  platform=platform)
    sync = SyncEngine(kernels, **common).run(requests)
    assert sync.finished
    out = {"sync": sync.outputs}
    for name in schedulers:
        result = AsyncEngine(kernels, make_scheduler(name), **common).run(requests)
        assert result.finished
        out[name] = result.outputs
    return out
