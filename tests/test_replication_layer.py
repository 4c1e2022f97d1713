"""Hot-expert replication in the layer: every strategy and transport gives
dense's bits with a placement, copies stay identical through training, the
rebalancer moves weights and optimizer state, and its state checkpoints."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_jax as mj
from moe_jax import checkpoint
from moe_jax.dispatch import DispatchContext, dispatch_combine
from moe_jax.layer import MoEParams, init_moe_params, moe_layer
from moe_jax.plan import kept_picks
from moe_jax.rebalance import Rebalancer, move_slots
from moe_jax.replicated import (balanced_sizes, balanced_slot_ids, logical_weights, slot_ids,
                                slot_weights)
from moe_jax.replication import (Placement, balanced_split_np, choose_balanced_np,
                                 choose_replica_np, propose)
from moe_testing import ROUTINGS, bits, expert_fn, make_routing, mesh_of, run_dense

E, H, F, K = 8, 32, 48, 2
CONFIG = mj.MoEConfig(hidden_size=H, ffn_size=F, num_experts=E, top_k=K,
                      strategy="cap_and_spill", capacity=2, spill_capacity=1,
                      matmul="row_invariant", dtype=jnp.float32)
STRATEGIES = ("max_counts", "cap_and_spill", "ragged")
TRANSPORTS = ("lax", "custom_call")


def random_placement(rng: np.random.Generator, ranks: int, slots: int) -> Placement:
    """Every expert on a random slot, the other slots random experts: replicas
    on any rank, several copies of one expert on one rank (inert ones)."""
    cells = rng.permutation(ranks * slots)
    slot_expert = rng.integers(0, E, ranks * slots)
    slot_expert[cells[:E]] = np.arange(E)
    return Placement(slot_expert.reshape(ranks, slots), E)


def skewed_case(seed: int, tokens: int, hot=(0, 1), strength=4.0):
    """Params and tokens whose router sends most picks to the `hot` experts
    (experts 0 and 1 share rank 0 at EP 4 and 2)."""
    params = init_moe_params(jax.random.key(seed), CONFIG)
    u = jax.random.normal(jax.random.key(seed + 1), (H,))
    u = u / jnp.linalg.norm(u)
    router = params.router
    for e in hot:
        router = router.at[:, e].add(strength * u)
    x = jax.random.normal(jax.random.key(seed + 2), (tokens, H)) + 1.5 * u
    return params._replace(router=router), x


def placements(ranks: int, loads: np.ndarray, seed: int):
    """The placements the layer tests run, all at S = E/P + 1: no replication
    (inert spares), the rebalancer's for `loads`, and an adversarial random
    one."""
    slots = E // ranks + 1
    return {"default": Placement.default(E, ranks, slots),
            "proposed": propose(loads, ranks, slots, 3),
            "random": random_placement(np.random.default_rng(seed), ranks, slots)}


@functools.lru_cache(maxsize=None)
def _layer(strategy, transport, ranks, data=1):
    config = CONFIG.replace(strategy=strategy, transport=transport,
                            data_axes=("data",) if data > 1 else ())
    mesh = mesh_of(ranks, data=data)
    return jax.jit(lambda p, x, a: moe_layer(p, x, config, mesh, placement=a,
                                             return_delivered=True))


@functools.lru_cache(maxsize=None)
def _dense():
    return jax.jit(lambda p, x: moe_layer(p, x, CONFIG.replace(strategy="dense")))


def _rank_rows(aux, ranks, data=1):
    """Rows each rank's slots received (per data group, summed over groups)."""
    sizes = np.asarray(aux.delivered.group_sizes).reshape(data, ranks, -1)
    return sizes.sum(axis=(0, 2))


@pytest.mark.parametrize("ranks", [4, 8])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_layer_with_placement_gives_dense_bits(strategy, transport, ranks):
    """Skewed routing, three placements (one compile: the placement is an
    input), bitwise against dense over the logical weights."""
    params, x = skewed_case(ranks, 32 * ranks)
    want, want_aux = _dense()(params, x)
    loads = np.asarray(want_aux.expert_rows, np.float64)
    assert loads[:2].sum() > 0.4 * loads.sum()          # the routing is skewed
    run = _layer(strategy, transport, ranks)
    for name, pl in placements(ranks, loads, ranks).items():
        slot_params = params._replace(experts=slot_weights(params.experts, pl))
        got, aux = run(slot_params, x, pl.device_arrays())
        np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)), err_msg=name)
        np.testing.assert_array_equal(aux.expert_rows, want_aux.expert_rows)
        assert int(aux.stats.rows) == x.shape[0] * K and int(aux.stats.dropped_rows) == 0
        # Each slot receives exactly the picks the numpy rule sends it.
        ids = np.asarray(jax.lax.top_k(jax.nn.softmax(
            np.asarray(x) @ np.asarray(params.router)), K)[1])
        tokens = np.arange(x.shape[0])
        src = tokens // (x.shape[0] // ranks)
        a = pl.as_arrays()
        slots = choose_replica_np(tokens[:, None], ids, src[:, None], a["local_slot"],
                                  a["replica_slots"], a["num_replicas"])
        np.testing.assert_array_equal(np.asarray(aux.delivered.group_sizes),
                                      np.bincount(slots.ravel(), minlength=pl.slot_expert.size))
    assert run._cache_size() == 1


@functools.lru_cache(maxsize=None)
def _balanced_layer(strategy, transport, ranks):
    config = CONFIG.replace(strategy=strategy, transport=transport)
    return jax.jit(lambda p, x, a: moe_layer(p, x, config, mesh_of(ranks), placement=a,
                                             replica_choice="balanced",
                                             return_delivered=True))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_balanced_rule_gives_dense_bits_and_levels_the_ranks(strategy, transport):
    """replica_choice="balanced" at EP 8: dense's bits on the spread, a
    proposed and a random placement; each slot gets the rows the NumPy rule
    gives it; on the spread placement its busiest rank gets fewer rows than
    under the local-then-hash rule."""
    ranks = 8
    params, x = skewed_case(71, 32 * ranks)
    want, want_aux = _dense()(params, x)
    loads = np.asarray(want_aux.expert_rows, np.float64)
    ids = np.asarray(jax.lax.top_k(jax.nn.softmax(
        np.asarray(x) @ np.asarray(params.router)), K)[1]).reshape(ranks, -1)
    run = _balanced_layer(strategy, transport, ranks)
    for name, pl in [("spread", Placement.spread(E, ranks, 3)),
                     ("proposed", propose(loads, ranks, 3, 3)),
                     ("random", random_placement(np.random.default_rng(3), ranks, 3))]:
        got, aux = run(params._replace(experts=slot_weights(params.experts, pl)), x,
                       pl.device_arrays())
        np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)), err_msg=name)
        a = pl.as_arrays()
        rule = choose_balanced_np(ids, None, None, a["replica_slots"], a["num_replicas"],
                                  pl.slots_per_rank)
        sizes = np.asarray(aux.delivered.group_sizes)
        np.testing.assert_array_equal(sizes, np.bincount(rule.ravel(),
                                                         minlength=pl.slot_expert.size))
        if name == "spread":     # levels better than the local-then-hash rule
            rows = sizes.reshape(ranks, -1).sum(axis=1)
            t = np.arange(ids.size // K).reshape(ranks, -1, 1)
            local = choose_replica_np(t, ids.reshape(ranks, -1, K), t // t.shape[1],
                                      a["local_slot"], a["replica_slots"], a["num_replicas"])
            local_rows = np.bincount(local.ravel() // pl.slots_per_rank, minlength=ranks)
            assert rows.max() < local_rows.max(), (rows, local_rows)
    assert run._cache_size() == 1


@given(data=st.data())
def test_balanced_sizes_numpy_and_jnp_agree(data):
    ranks = data.draw(st.sampled_from([2, 4, 8]), "ranks")
    slots = E // ranks + data.draw(st.integers(0, 3), "spare")
    seed = data.draw(st.integers(0, 2 ** 16), "seed")
    rng = np.random.default_rng(seed)
    pl = random_placement(rng, ranks, slots) if data.draw(st.booleans(), "random") \
        else Placement.spread(E, ranks, slots)
    counts = rng.integers(0, data.draw(st.sampled_from([1, 5, 40]), "scale"), (ranks, E))
    if data.draw(st.booleans(), "one_hot"):           # one expert takes everything
        counts[:] = 0
        counts[:, rng.integers(E)] = rng.integers(1, 30, ranks)
    a = pl.as_arrays()
    want = balanced_split_np(counts, a["replica_slots"], a["num_replicas"], slots)
    got = jax.jit(balanced_sizes)(jnp.asarray(counts, jnp.int32), pl.device_arrays())
    np.testing.assert_array_equal(np.asarray(got), want)
    # An independent reference: single-rank experts first, then each
    # replicated expert (most rows first) row by row to its least-loaded
    # holder (lowest replica first on ties).
    total = counts.sum(axis=0)
    n = a["num_replicas"]
    holder = a["replica_slots"] // slots
    load = np.zeros(ranks, np.int64)
    ref = np.zeros((E, ranks), np.int64)
    for e in range(E):
        if n[e] == 1:
            load[holder[e, 0]] += total[e]
            ref[e, 0] = total[e]
    for e in sorted(range(E), key=lambda e: (-total[e], e)):
        if n[e] > 1:
            for _ in range(total[e]):
                j = min(range(n[e]), key=lambda j: (load[holder[e, j]], j))
                ref[e, j] += 1
                load[holder[e, j]] += 1
    np.testing.assert_array_equal(want, ref)


def test_proposed_placement_lowers_the_busiest_rank():
    ranks = 4
    params, x = skewed_case(3, 64 * ranks)
    _, want_aux = _dense()(params, x)
    loads = np.asarray(want_aux.expert_rows, np.float64)
    run = _layer("ragged", "lax", ranks)
    rows = {}
    for name, pl in placements(ranks, loads, 0).items():
        _, aux = run(params._replace(experts=slot_weights(params.experts, pl)), x,
                     pl.device_arrays())
        rows[name] = _rank_rows(aux, ranks)
    assert rows["proposed"].max() < 0.8 * rows["default"].max()
    assert rows["proposed"].sum() == rows["default"].sum() == x.shape[0] * K


def test_data_parallel_layer_with_placement_gives_dense_bits():
    ranks, data = 4, 2
    params, x = skewed_case(11, 16 * ranks * data)
    want, want_aux = _dense()(params, x)
    run = _layer("cap_and_spill", "custom_call", ranks, data)
    for name, pl in placements(ranks, np.asarray(want_aux.expert_rows, float), 5).items():
        got, aux = run(params._replace(experts=slot_weights(params.experts, pl)), x,
                       pl.device_arrays())
        np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)), err_msg=name)
        np.testing.assert_array_equal(aux.expert_rows, want_aux.expert_rows)


def test_dense_with_placement_gives_dense_bits():
    params, x = skewed_case(7, 64)
    want, _ = _dense()(params, x)
    pl = random_placement(np.random.default_rng(2), 4, 3)
    got, _ = jax.jit(lambda p, x, a: moe_layer(p, x, CONFIG.replace(strategy="dense"),
                                               placement=a))(
        params._replace(experts=slot_weights(params.experts, pl)), x, pl.device_arrays())
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))


# --------------------------------------------------------------------------
# Adversarial routings at the dispatch level
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _slot_runner(strategy, transport, ranks, slots, balanced):
    mesh = mesh_of(ranks)
    ctx = DispatchContext("ep", ranks, transport, "custom_call", "cpu", tuple(mesh.devices.flat))
    capacity = 2 if strategy == "cap_and_spill" else None
    spill = 1 if strategy == "cap_and_spill" else None

    def body(x, ids, w, w_gate_up, w_down, placement):
        rank = ctx.rank()
        if balanced:
            slot = balanced_slot_ids(ids, placement, rank, ctx.all_gather)
        else:
            slot = slot_ids(ids, placement, rank, rank * x.shape[0])
        fn = expert_fn(mj.ExpertWeights(w_gate_up, w_down), jnp.float32, "row_invariant")
        res = dispatch_combine(x, slot, w, fn, strategy=strategy, ctx=ctx,
                               experts_per_rank=slots, capacity=capacity,
                               spill_capacity=spill)
        return res.out, slot, res.stats.dropped_rows

    spec = P("ep")
    fn = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * 5 + (mj.PlacementArrays(P(), P(), P(), P()),),
        out_specs=(spec, spec, P())))
    return mesh, fn


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@given(data=st.data())
def test_adversarial_routings_give_dense_bits(strategy, transport, data):
    """Any routing kind (dropped picks too) under a random or proposed
    placement, with either rule: dense's bits, and each pick on the slot the
    numpy rule names."""
    ranks = data.draw(st.sampled_from([4, 8]), "ranks")
    balanced = data.draw(st.booleans(), "balanced")
    kind = data.draw(st.sampled_from(ROUTINGS), "kind")
    seed = data.draw(st.integers(0, 2 ** 16), "seed")
    slots = E // ranks + data.draw(st.integers(1, 2), "spare")
    rng = np.random.default_rng(seed)
    tokens = 16 * ranks
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    ids = make_routing(rng, tokens, E, K, kind, E // ranks)
    if data.draw(st.booleans(), "drop"):       # out of range, negative, repeated
        ids[rng.integers(0, tokens, 3), 0] = [E, -1, 3 * E]
        ids[rng.integers(0, tokens, 2), 1] = ids[rng.integers(0, tokens, 2), 0]
    w = rng.random((tokens, K)).astype(np.float32) + 0.05
    logical = mj.init_expert_weights(jax.random.key(seed), E, H, F)
    if data.draw(st.booleans(), "proposed"):
        loads = np.bincount(ids[(ids >= 0) & (ids < E)], minlength=E).astype(float)
        pl = propose(loads, ranks, slots, data.draw(st.integers(1, 4), "replicated"))
    else:
        pl = random_placement(rng, ranks, slots)
    want, _, _ = run_dense(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), logical,
                           impl="custom_call", matmul="row_invariant")
    mesh, fn = _slot_runner(strategy, transport, ranks, slots, balanced)
    split = NamedSharding(mesh, P("ep"))
    args = [jax.device_put(jnp.asarray(a), split)
            for a in (x, ids, w, *slot_weights(logical, pl))]
    got, slot, dropped = fn(*args, pl.device_arrays())
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(want))
    a = pl.as_arrays()
    kept = np.asarray(kept_picks(jnp.asarray(ids), E))
    t = np.arange(tokens)[:, None]
    if balanced:
        rule = choose_balanced_np(np.where(kept, ids, -1).reshape(ranks, -1), None, None,
                                  a["replica_slots"], a["num_replicas"], slots).reshape(ids.shape)
    else:
        rule = choose_replica_np(t, np.where(kept, ids, 0), t // (tokens // ranks),
                                 a["local_slot"], a["replica_slots"], a["num_replicas"])
    np.testing.assert_array_equal(np.asarray(slot), np.where(kept, rule, -1))
    assert int(dropped) == int((~kept).sum())


# --------------------------------------------------------------------------
# Training: copies stay identical; rebalancing moves weights and moments
# --------------------------------------------------------------------------


def _copies_identical(tree, pl: Placement):
    se = pl.slot_expert.reshape(-1)
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        for e in range(E):
            copies = leaf[se == e]
            for c in copies[1:]:
                np.testing.assert_array_equal(bits(c), bits(copies[0]))


@functools.lru_cache(maxsize=None)
def _train_step(strategy, transport, ranks, data):
    config = CONFIG.replace(strategy=strategy, transport=transport,
                            data_axes=("data",) if data > 1 else ())
    mesh = None if strategy == "dense" else mesh_of(ranks, data=data)
    opt = optax.adam(1e-2)

    def loss(params, x, placement):
        y, aux = moe_layer(params, x, config, mesh, placement=placement)
        return jnp.mean((y - jnp.tanh(x)) ** 2) + 0.01 * aux.load_balance_loss, aux

    @jax.jit
    def step(params, opt_state, x, placement):
        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params, x, placement)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, aux, grads

    return opt, step


@pytest.mark.parametrize("strategy, transport, ranks, data", [
    ("ragged", "custom_call", 8, 1), ("cap_and_spill", "lax", 4, 2),
    ("max_counts", "custom_call", 4, 1)])
def test_training_keeps_copies_identical_and_tracks_dense(strategy, transport, ranks, data):
    """Adam on slot weights: every copy of an expert gets the same gradient
    (the sum over its copies) and stays bitwise equal to the others; the
    logical weights follow dense training on [E] weights."""
    params, x = skewed_case(21, 16 * ranks * data)
    pl = propose(np.array([40.0, 30, 10, 5, 5, 4, 3, 3]), ranks, E // ranks + 1, 3)
    assert (pl.num_replicas() > 1).any()
    opt, step = _train_step(strategy, transport, ranks, data)
    _, dense_step = _train_step("dense", "lax", 1, 1)
    slot_params = params._replace(experts=slot_weights(params.experts, pl))
    state, ref_state = opt.init(slot_params), opt.init(params)
    ref = params
    placement = pl.device_arrays()
    for i in range(3):
        xi = x * (1.0 + 0.1 * i)
        slot_params, state, value, _, grads = step(slot_params, state, xi, placement)
        ref, ref_state, ref_value, _, ref_grads = dense_step(ref, ref_state, xi, None)
        _copies_identical(grads.experts, pl)
        _copies_identical((slot_params.experts, state[0].mu.experts, state[0].nu.experts), pl)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        for g, r in zip(logical_weights(grads.experts, pl), ref_grads.experts):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
    for got, want in zip(logical_weights(slot_params.experts, pl), ref.experts):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_rebalance_moves_weights_and_moments_between_steps():
    ranks = 4
    params, x = skewed_case(31, 32 * ranks)
    opt, step = _train_step("ragged", "lax", ranks, 1)
    reb = Rebalancer(E, ranks, E // ranks + 1, alpha=0.5, num_replicated=3)
    slot_params = params._replace(experts=slot_weights(params.experts, reb.placement))
    state = opt.init(slot_params)
    slot_params, state, _, aux, _ = step(slot_params, state, x, reb.placement.device_arrays())
    reb.observe(aux.expert_rows)
    np.testing.assert_allclose(reb.tracker.loads, np.asarray(aux.expert_rows, float))
    old = reb.placement
    logical = logical_weights(slot_params.experts, old)
    mu, nu = logical_weights(state[0].mu.experts, old), logical_weights(state[0].nu.experts, old)
    mesh = mesh_of(ranks)
    (experts, m, v), changed = reb.rebalance(
        (slot_params.experts, state[0].mu.experts, state[0].nu.experts), mesh)
    assert changed and reb.placement != old
    assert set(np.flatnonzero(reb.placement.num_replicas() > 1)) <= {0, 1, 2, 3, 4, 5, 6, 7}
    assert (reb.placement.num_replicas()[:2] > 1).any()      # a hot expert got a copy
    for got, want in zip((experts, m, v), (logical, mu, nu)):
        for g, w in zip(got, slot_weights(want, reb.placement)):
            np.testing.assert_array_equal(bits(np.asarray(g)), bits(np.asarray(w)))
        assert got[0].sharding.spec == P("ep")
    slot_params = slot_params._replace(experts=experts)
    state = (state[0]._replace(mu=state[0].mu._replace(experts=m),
                               nu=state[0].nu._replace(experts=v)),) + tuple(state[1:])
    # After the move: dense's bits, and training goes on with identical copies.
    want, _ = _dense()(slot_params._replace(experts=logical_weights(experts, reb.placement)), x)
    got, _ = _layer("ragged", "lax", ranks)(slot_params, x, reb.placement.device_arrays())
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))
    slot_params, state, _, _, _ = step(slot_params, state, x, reb.placement.device_arrays())
    _copies_identical((slot_params.experts, state[0].mu.experts), reb.placement)
    # No change proposed: nothing moves.
    same, changed = reb.rebalance(experts, mesh, placement=reb.placement)
    assert not changed and same is experts


def test_move_slots_rejects_other_layouts():
    with pytest.raises(ValueError, match="^tree:"):
        move_slots(jnp.zeros((5, 2)), np.arange(6))


def test_rebalancer_state_through_orbax(tmp_path):
    ranks = 4
    reb = Rebalancer(E, ranks, 3, num_replicated=2)
    reb.observe(np.array([50, 3, 8, 1, 2, 20, 4, 9]))
    logical = mj.init_expert_weights(jax.random.key(0), E, H, F)
    experts, _ = reb.rebalance(slot_weights(logical, reb.placement))
    state = {"experts": {"w_gate_up": experts.w_gate_up, "w_down": experts.w_down},
             "replication": reb.to_state()}
    mesh = mesh_of(ranks)
    checkpoint.save_state(tmp_path / "ckpt", state, mesh=mesh)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    restored = checkpoint.restore_state(tmp_path / "ckpt", abstract, mesh=mesh)
    back = Rebalancer.from_state(restored["replication"])
    assert back.placement == reb.placement and back.num_replicated == 2
    np.testing.assert_allclose(back.tracker.loads, reb.tracker.loads, rtol=1e-6)
    assert back.tracker.alpha == pytest.approx(0.99)
    np.testing.assert_array_equal(restored["experts"]["w_down"], experts.w_down)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def test_placement_argument_errors_name_it():
    params, x = skewed_case(0, 32)
    pl = Placement.default(E, 4, 3)
    mesh = mesh_of(4)
    config = CONFIG.replace(strategy="ragged")
    slot_params = params._replace(experts=slot_weights(params.experts, pl))
    with pytest.raises(ValueError, match="placement"):     # the mesh has 8 ranks
        moe_layer(slot_params, x, config, mesh_of(8), placement=pl.device_arrays())
    with pytest.raises(ValueError, match="params.experts"):   # logical weights
        moe_layer(params, x, config, mesh, placement=pl.device_arrays())
    with pytest.raises(ValueError, match="params.experts"):   # slots, no placement
        moe_layer(slot_params, x, config, mesh)
    with pytest.raises(ValueError, match="placement"):
        moe_layer(slot_params, x, config, mesh, placement=pl.as_arrays())
    bad = pl.device_arrays()._replace(num_replicas=jnp.zeros((E + 1,), jnp.int32))
    with pytest.raises(ValueError, match="placement.num_replicas"):
        moe_layer(slot_params, x, config, mesh, placement=bad)


# --------------------------------------------------------------------------
# Flax modules
# --------------------------------------------------------------------------


def test_linen_module_with_placement_gives_dense_bits():
    from moe_jax.nn import linen as moe_linen
    ranks = 4
    params, x = skewed_case(41, 16 * ranks)
    pl = propose(np.array([40.0, 30, 10, 5, 5, 4, 3, 3]), ranks, 3, 3)
    config = CONFIG.replace(strategy="ragged", transport="custom_call")
    layer = moe_linen.MoE(config, mesh_of(ranks))
    variables = jax.jit(layer.init)(jax.random.key(0), x, pl.device_arrays())
    p = variables["params"]
    assert p["w_gate_up"].value.shape == (ranks * 3, H, 2 * F)
    _copies_identical({k: p[k].value for k in ("w_gate_up", "w_down")}, pl)
    y, state = jax.jit(lambda v, x, a: layer.apply(v, x, a, mutable=["moe_load"]))(
        variables, x, pl.device_arrays())
    dense = moe_linen.MoE(CONFIG.replace(strategy="dense"))
    logical = logical_weights(mj.ExpertWeights(p["w_gate_up"].value, p["w_down"].value), pl)
    want = dense.apply({"params": {"router": p["router"], "w_gate_up": logical.w_gate_up,
                                   "w_down": logical.w_down}}, x)
    np.testing.assert_array_equal(bits(np.asarray(y)), bits(np.asarray(want)))
    assert int(state["moe_load"]["expert_rows"].sum()) == x.shape[0] * K


def test_nnx_module_with_placement_follows_a_rebalance():
    from flax import nnx
    from moe_jax.nn import nnx as moe_nnx
    ranks = 4
    params, x = skewed_case(43, 16 * ranks)
    mesh = mesh_of(ranks)
    config = CONFIG.replace(strategy="cap_and_spill", transport="lax")
    layer = moe_nnx.MoE(config, mesh=mesh, rngs=nnx.Rngs(0),
                        placement=Placement.default(E, ranks, 3), replica_choice="balanced")
    layer.router[...] = params.router
    reb = Rebalancer(E, ranks, 3, placement=Placement.default(E, ranks, 3))
    dense = moe_nnx.MoE(CONFIG.replace(strategy="dense"), rngs=nnx.Rngs(1))
    dense.router[...] = params.router

    @nnx.jit
    def call(module, x):
        return module(x)

    changes = []
    for _ in range(2):
        y = call(layer, x)
        logical = logical_weights(mj.ExpertWeights(layer.w_gate_up[...], layer.w_down[...]),
                                  reb.placement)
        dense.w_gate_up[...], dense.w_down[...] = logical.w_gate_up, logical.w_down
        np.testing.assert_array_equal(bits(np.asarray(y)), bits(np.asarray(dense(x))))
        reb.observe(layer.expert_rows[...])
        moved, changed = reb.rebalance((layer.w_gate_up[...], layer.w_down[...]), mesh)
        layer.w_gate_up[...], layer.w_down[...] = moved
        layer.set_placement(reb.placement)
        changes.append(changed)
    assert changes[0] and (reb.placement.num_replicas() > 1).any()


# --------------------------------------------------------------------------
# GPUs (any count >= 2: the largest of 8, 4, 2 that fits)
# --------------------------------------------------------------------------

GPU_CASES = [("max_counts", "lax"), ("cap_and_spill", "lax"), ("cap_and_spill", "custom_call"),
             ("cap_and_spill", "nvlink"), ("ragged", "lax"), ("ragged", "nvlink")]


def _gpu_ranks() -> int:
    try:
        found = len(jax.devices("gpu"))
    except RuntimeError:
        found = 0
    ranks = max([r for r in (8, 4, 2) if r <= found], default=0)
    if not ranks:
        pytest.skip(f"needs >= 2 GPUs, found {found}")
    return ranks


def _gpu_case(ranks: int, seed: int):
    config = CONFIG.replace(hidden_size=256, ffn_size=128)
    params = init_moe_params(jax.random.key(seed), config)
    u = jax.random.normal(jax.random.key(seed + 1), (256,))
    u = u / jnp.linalg.norm(u)
    params = params._replace(router=params.router.at[:, 0].add(4.0 * u))   # expert 0 hot
    x = jax.random.normal(jax.random.key(seed + 2), (32 * ranks, 256)) + 1.5 * u
    return config, params, x


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("replica_choice", ["local", "balanced"])
@pytest.mark.parametrize("strategy, transport", GPU_CASES)
def test_gpu_layer_with_placement_gives_dense_bits(strategy, transport, replica_choice):
    ranks = _gpu_ranks()
    config, params, x = _gpu_case(ranks, 50)
    mesh = mesh_of(ranks, "gpu")
    want, want_aux = jax.jit(lambda p, x: moe_layer(p, x, config.replace(strategy="dense")))(
        params, x)
    loads = np.asarray(want_aux.expert_rows, np.float64)
    run = jax.jit(lambda p, x, a: moe_layer(
        p, x, config.replace(strategy=strategy, transport=transport), mesh, placement=a,
        replica_choice=replica_choice))
    slots = E // ranks + 1
    for pl in (propose(loads, ranks, slots, 3), random_placement(np.random.default_rng(1),
                                                                ranks, slots)):
        got, aux = run(params._replace(experts=slot_weights(params.experts, pl)), x,
                       pl.device_arrays())
        np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))
        np.testing.assert_array_equal(aux.expert_rows, want_aux.expert_rows)


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["lax", "nvlink"])
def test_gpu_training_keeps_copies_identical(transport):
    ranks = _gpu_ranks()
    config, params, x = _gpu_case(ranks, 60)
    config = config.replace(strategy="cap_and_spill", transport=transport)
    mesh = mesh_of(ranks, "gpu")
    pl = propose(np.array([40.0, 30, 10, 5, 5, 4, 3, 3]), ranks, E // ranks + 1, 3)
    opt = optax.adam(1e-2)

    @jax.jit
    def step(p, state, x, placement):
        grads = jax.grad(lambda p: jnp.mean(
            (moe_layer(p, x, config, mesh, placement=placement)[0] - jnp.tanh(x)) ** 2))(p)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    p = params._replace(experts=slot_weights(params.experts, pl))
    state = opt.init(p)
    for i in range(3):
        p, state = step(p, state, x * (1.0 + 0.1 * i), pl.device_arrays())
        _copies_identical((p.experts, state[0].mu.experts), pl)
