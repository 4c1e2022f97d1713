"""moe_jax.replication: placement, choice rule, EMA tracker, rebalancer, state."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_jax import checkpoint
from moe_jax.replication import (LoadTracker, Placement, choose_replica, choose_replica_np,
                                 expected_rank_loads, hash32, hash32_np, propose)
from moe_jax.traces import generate_traces


# --------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------


@pytest.mark.parametrize("slot_expert, num_experts, name", [
    ([[0.0, 1.0]], 2, "slot_expert"),             # not integers
    ([0, 1], 2, "slot_expert"),                   # 1-D
    (np.zeros((2, 0), np.int32), 1, "slot_expert"),  # no slots
    ([[0, 2]], 2, "slot_expert"),                 # id out of range
    ([[0, -1]], 2, "slot_expert"),
    ([[0, 0], [1, 1]], 3, "slot_expert"),         # expert 2 on no slot
    ([[0]], 0, "num_experts"),
    ([[0]], 1.5, "num_experts"),
])
def test_placement_validation_names_the_argument(slot_expert, num_experts, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        Placement(slot_expert, num_experts)


@pytest.mark.parametrize("args, name", [
    ((6, 4, 2), "num_experts"),      # E % P
    ((8, 4, 1), "slots_per_rank"),   # S < E / P
    ((8, 0, 2), "num_ranks"),
    ((8, 4, 0), "slots_per_rank"),
])
def test_default_validation_names_the_argument(args, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        Placement.default(*args)


def test_default_layout_has_no_replicas():
    p = Placement.default(8, 4, 3)
    np.testing.assert_array_equal(p.slot_expert, [[0, 1, 0], [2, 3, 2], [4, 5, 4], [6, 7, 6]])
    assert p.num_ranks == 4 and p.slots_per_rank == 3 and p.num_experts == 8
    np.testing.assert_array_equal(p.num_replicas(), np.ones(8))
    for e in range(8):  # the inert spare copy is not a replica: the lowest slot is
        np.testing.assert_array_equal(p.replicas(e), [(e // 2) * 3 + e % 2])
    np.testing.assert_array_equal(Placement.default(8, 8).slot_expert, np.arange(8)[:, None])


def test_replicas_and_arrays():
    # 4 experts, 3 ranks x 2 slots: expert 0 on ranks 0 and 2 (twice on 2).
    p = Placement([[0, 1], [2, 3], [0, 0]], 4)
    np.testing.assert_array_equal(p.replicas(0), [0, 4])
    np.testing.assert_array_equal(p.replica_ranks(0), [0, 2])
    np.testing.assert_array_equal(p.replicas(3), [3])
    a = p.as_arrays()
    assert all(v.dtype == np.int32 for v in a.values())
    np.testing.assert_array_equal(a["num_replicas"], [2, 1, 1, 1])
    np.testing.assert_array_equal(a["local_slot"], [[0, 1, -1, -1], [-1, -1, 2, 3],
                                                    [4, -1, -1, -1]])
    np.testing.assert_array_equal(a["replica_slots"], [[0, 4, 0], [1, 1, 1], [2, 2, 2],
                                                       [3, 3, 3]])
    with pytest.raises(ValueError, match="^expert:"):
        p.replicas(4)
    assert p == Placement(np.array([[0, 1], [2, 3], [0, 0]]), 4)
    assert p != Placement.default(4, 2, 3)


# --------------------------------------------------------------------------
# The choice rule
# --------------------------------------------------------------------------


def _random_placement(rng, num_experts, num_ranks, slots):
    flat = np.concatenate([rng.permutation(num_experts),
                           rng.integers(0, num_experts, num_ranks * slots - num_experts)])
    return Placement(rng.permutation(flat).reshape(num_ranks, slots), num_experts)


_choose_jit = jax.jit(choose_replica)


def _both(placement, t, e, r):
    a = placement.as_arrays()
    args = (a["local_slot"], a["replica_slots"], a["num_replicas"])
    got_np = choose_replica_np(t, e, r, *args)
    got_jnp = np.asarray(_choose_jit(jnp.asarray(t, jnp.int32), jnp.asarray(e),
                                     jnp.asarray(r), *map(jnp.asarray, args)))
    return got_np, got_jnp


def test_hash_numpy_and_jnp_agree():
    t = np.array([0, 1, 2, 12345, 2**31 - 1, 2**20 + 7], np.int64)
    np.testing.assert_array_equal(hash32_np(t), np.asarray(hash32(jnp.asarray(t, jnp.int32))))
    assert hash32_np(0) == 0 and hash32_np(1) != 1


def test_choice_rule_numpy_jnp_agree_local_and_deterministic():
    rng = np.random.default_rng(0)
    p = _random_placement(rng, 8, 4, 4)
    t = np.arange(4000)
    e = rng.integers(0, 8, t.size)
    r = rng.integers(0, 4, t.size)
    got_np, got_jnp = _both(p, t, e, r)
    np.testing.assert_array_equal(got_np, got_jnp)
    np.testing.assert_array_equal(got_np, _both(p, t, e, r)[0])  # deterministic
    assert (p.slot_expert.reshape(-1)[got_np] == e).all()          # right expert
    a = p.as_arrays()
    local = a["local_slot"][r, e]
    held = local >= 0
    np.testing.assert_array_equal(got_np[held], local[held])       # local stays local
    assert (got_np[held] // 4 == r[held]).all()
    for slot, expert in zip(got_np[~held], e[~held]):               # a real replica
        assert slot in p.replicas(int(expert))


def test_choice_rule_balances_remote_picks():
    # Expert 0 on ranks 1, 2, 3 of 4; picks from rank 0 spread evenly.
    p = Placement([[1], [0], [0], [0]], 2)
    n = 30000
    got, _ = _both(p, np.arange(n), np.zeros(n, np.int64), np.zeros(n, np.int64))
    share = np.bincount(got, minlength=4)[1:] / n
    np.testing.assert_allclose(share, 1 / 3, atol=0.02)


def test_expected_load_model_matches_simulation():
    rng = np.random.default_rng(1)
    P, S, E = 4, 3, 8
    loads = np.array([40, 5, 10, 3, 8, 2, 20, 12], float)
    p = propose(loads, P, S, num_replicated=3)
    assert p.num_replicas().max() > 1
    n_tok = 200000
    e = rng.choice(E, n_tok, p=loads / loads.sum())
    r = rng.integers(0, P, n_tok)                # sources uniform over ranks
    got, _ = _both(p, np.arange(n_tok), e, r)
    received = np.bincount(got // S, minlength=P) / n_tok
    np.testing.assert_allclose(received, expected_rank_loads(p, loads) / loads.sum(),
                               atol=0.01)


# --------------------------------------------------------------------------
# The rebalancer
# --------------------------------------------------------------------------


def _brute_force(loads, P, S, num_replicated):
    """Lowest busiest-rank expected load over every way of filling the spare
    slots with replicas of the num_replicated hottest experts."""
    E = loads.size
    per, spare = E // P, S - E // P
    home = np.arange(E) // per
    cands = [int(e) for e in np.argsort(-loads, kind="stable")[:num_replicated]]
    options = [[c for k in range(P) for c in itertools.combinations(
        [q for q in range(P) if q != home[e]], k)] for e in cands]
    best = np.inf
    for combo in itertools.product(*options):
        used = np.bincount([q for c in combo for q in c], minlength=P)
        if (used > spare).any():
            continue
        slot_expert = np.array(Placement.default(E, P, S).slot_expert)
        fill = np.full(P, per)
        for e, c in zip(cands, combo):
            for q in c:
                slot_expert[q, fill[q]] = e
                fill[q] += 1
        best = min(best, expected_rank_loads(Placement(slot_expert, E), loads).max())
    return best


def _check_proposal(p, loads, P, S, num_replicated):
    E = loads.size
    base = Placement.default(E, P, S)
    assert p.num_ranks == P and p.slots_per_rank == S and p.num_experts == E
    per = E // P
    np.testing.assert_array_equal(p.slot_expert[:, :per], base.slot_expert[:, :per])
    replicated = np.nonzero(p.num_replicas() > 1)[0]
    assert replicated.size <= num_replicated
    hottest = set(np.argsort(-loads, kind="stable")[:num_replicated].tolist())
    assert set(replicated.tolist()) <= hottest
    got = expected_rank_loads(p, loads).max()
    assert got <= expected_rank_loads(base, loads).max() + 1e-9
    return got


@pytest.mark.parametrize("seed", range(6))
def test_propose_close_to_brute_force(seed):
    rng = np.random.default_rng(seed)
    P = int(rng.integers(2, 5))
    per = int(rng.integers(1, 3))
    S = per + int(rng.integers(1, 3))
    nrep = int(rng.integers(1, 4))
    loads = rng.exponential(size=P * per) ** 2
    got = _check_proposal(propose(loads, P, S, nrep), loads, P, S, nrep)
    best = _brute_force(loads, P, S, nrep)
    assert best - 1e-9 <= got <= 1.05 * best


def test_propose_exact_on_one_hot_expert():
    # One hot expert on 4 ranks with one spare slot each: it goes on all four.
    loads = np.array([100.0, 1, 1, 1])
    p = propose(loads, 4, 2, num_replicated=1)
    np.testing.assert_array_equal(p.replica_ranks(0), [0, 1, 2, 3])
    np.testing.assert_allclose(expected_rank_loads(p, loads), [25, 26, 26, 26])
    assert expected_rank_loads(p, loads).max() == _brute_force(loads, 4, 2, 1)
    # The case a busiest-rank-only greedy misses (needs the count search).
    loads = np.array([0.735, 2.532, 10.669])
    got = expected_rank_loads(propose(loads, 3, 2, 3), loads).max()
    assert got == pytest.approx(_brute_force(loads, 3, 2, 3))


def test_propose_without_budget_is_default():
    loads = np.arange(8.0)
    assert propose(loads, 4, 2) == Placement.default(8, 4, 2)
    assert propose(loads, 4, 3, num_replicated=0) == Placement.default(8, 4, 3)
    assert propose(np.ones(8), 8, 2) == Placement.default(8, 8, 2)  # balanced already
    with pytest.raises(ValueError, match="^num_replicated:"):
        propose(loads, 4, 3, num_replicated=-1)
    with pytest.raises(ValueError, match="^tracker_or_loads:"):
        propose([[1.0]], 1, 1)
    with pytest.raises(ValueError, match="^slots_per_rank:"):
        propose(loads, 4, 1)


@given(st.data())
def test_propose_properties(data):
    P = data.draw(st.sampled_from([1, 2, 4, 8]), "P")
    per = data.draw(st.integers(1, 3), "E/P")
    S = per + data.draw(st.integers(0, 3), "spare")
    nrep = data.draw(st.integers(0, 4), "num_replicated")
    loads = np.array(data.draw(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=P * per,
                                        max_size=P * per), "loads"))
    p = propose(loads, P, S, nrep)
    _check_proposal(p, loads, P, S, nrep)


@given(st.data())
def test_choice_rule_properties(data):
    E = data.draw(st.integers(1, 6), "E")
    P = data.draw(st.integers(1, 4), "P")
    S = data.draw(st.integers(max(1, -(-E // P)), 3 + -(-E // P)), "S")
    seed = data.draw(st.integers(0, 2**31 - 1), "seed")
    rng = np.random.default_rng(seed)
    p = _random_placement(rng, E, P, S)
    t = rng.integers(0, 2**31 - 1, 64)
    e = rng.integers(0, E, 64)
    r = rng.integers(0, P, 64)
    got_np, got_jnp = _both(p, t, e, r)
    np.testing.assert_array_equal(got_np, got_jnp)
    assert (p.slot_expert.reshape(-1)[got_np] == e).all()
    held = p.as_arrays()["local_slot"][r, e] >= 0
    assert (got_np[held] // S == r[held]).all()


# --------------------------------------------------------------------------
# EMA tracker
# --------------------------------------------------------------------------


def test_ema_arithmetic():
    tr = LoadTracker(3)
    assert tr.alpha == 0.99 and tr.num_updates == 0
    tr.update([10, 0, 2])
    np.testing.assert_array_equal(tr.loads, [10, 0, 2])     # first update: the counts
    tr.update([0, 100, 2])
    np.testing.assert_allclose(tr.loads, [9.9, 1.0, 2.0])
    tr = LoadTracker(4, alpha=0.5).update_from_experts([[0, 1], [0, 3], [7, -1]])
    np.testing.assert_array_equal(tr.loads, [2, 1, 0, 1])  # out-of-range ids ignored
    tr.update_from_experts(np.array([[2, 2]]))
    np.testing.assert_array_equal(tr.loads, [1, 0.5, 1, 0.5])
    trace = generate_traces(num_experts=4, num_ranks=2, num_layers=1, num_steps=1)[0]
    ref = np.bincount(trace.experts.reshape(-1), minlength=4)
    np.testing.assert_array_equal(LoadTracker(4).update_from_trace(trace).loads, ref)
    with pytest.raises(ValueError, match="^alpha:"):
        LoadTracker(3, alpha=1.0)
    with pytest.raises(ValueError, match="^counts:"):
        LoadTracker(3).update([1, 2])
    with pytest.raises(ValueError, match="^counts:"):
        LoadTracker(3).update([1, -2, 0])
    with pytest.raises(ValueError, match="^trace:"):
        LoadTracker(8).update_from_trace(trace)


def test_ema_converges_and_feeds_propose():
    tr = LoadTracker(8, alpha=0.9)
    for _ in range(200):
        tr.update([80, 10, 10, 10, 10, 10, 10, 10])
    np.testing.assert_allclose(tr.loads[0], 80)
    p = propose(tr, 8, 2)
    assert p.num_replicas()[0] == 8  # the hot expert takes every spare slot
    assert expected_rank_loads(p, tr).max() == pytest.approx(20.0)


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------


def test_state_round_trip_in_memory():
    p = Placement([[0, 1], [2, 3], [0, 0]], 4)
    assert Placement.from_state(p.to_state()) == p
    tr = LoadTracker(4, alpha=0.9).update([1, 2, 3, 4]).update([4, 3, 2, 1])
    back = LoadTracker.from_state(tr.to_state())
    np.testing.assert_allclose(back.loads, tr.loads, rtol=1e-6)
    assert back.alpha == pytest.approx(0.9) and back.num_updates == 2
    with pytest.raises(ValueError, match="^state:"):
        Placement.from_state({"slot_expert": p.slot_expert})


def test_state_round_trip_through_orbax(tmp_path):
    loads = np.array([50.0, 3, 8, 1, 2, 20, 4, 9])
    tr = LoadTracker(8).update(loads)
    p = propose(tr, 4, 3)
    state = {"placement": p.to_state(), "tracker": tr.to_state()}
    checkpoint.save_state(tmp_path / "ckpt", state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    restored = checkpoint.restore_state(tmp_path / "ckpt", abstract)
    assert Placement.from_state(restored["placement"]) == p
    back = LoadTracker.from_state(restored["tracker"])
    np.testing.assert_array_equal(back.loads, tr.loads)
    assert back.num_updates == 1 and back.alpha == pytest.approx(0.99)
