"""The dispatch plan against a direct numpy construction."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

from moe_jax.plan import make_plan, worst_case_rows_per_peer
from moe_testing import ROUTINGS, make_routing


@given(st.integers(1, 20), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 3]),
       st.integers(1, 3), st.sampled_from(ROUTINGS), st.integers(0, 2**31 - 1))
def test_plan_matches_numpy(tokens, ranks, experts_per_rank, top_k, kind, seed):
    num_experts = ranks * experts_per_rank
    top_k = min(top_k, num_experts)
    ids = make_routing(np.random.default_rng(seed), tokens, num_experts, top_k, kind,
                       experts_per_rank)
    plan = make_plan(jnp.asarray(ids), ranks, experts_per_rank)
    flat = ids.reshape(-1)
    order = sorted(range(flat.size), key=lambda n: (flat[n], n))
    np.testing.assert_array_equal(np.asarray(plan.sorted_slots), order)
    dest = flat // experts_per_rank
    counts = np.bincount(dest, minlength=ranks)
    np.testing.assert_array_equal(np.asarray(plan.send_counts), counts)
    np.testing.assert_array_equal(np.asarray(plan.send_offsets),
                                  np.concatenate([[0], np.cumsum(counts)[:-1]]))
    pos = np.asarray(plan.pos)
    for p in range(ranks):
        stream = [n for n in order if dest[n] == p]
        np.testing.assert_array_equal(pos[stream], np.arange(len(stream)))
    np.testing.assert_array_equal(np.asarray(plan.send_expert_counts).reshape(-1),
                                  np.bincount(flat, minlength=num_experts))
    assert counts.max(initial=0) <= worst_case_rows_per_peer(tokens, top_k, experts_per_rank)
