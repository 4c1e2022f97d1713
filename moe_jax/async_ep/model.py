"""A tiny Mixtral-style decoder split into independently runnable layers.

Blocks: x -> h = x + Attn(RMSNorm(x)); u = RMSNorm(h); router top-k softmax;
x' = h + sum_j w_j * SwiGLU_{e_j}(u). Embedding = token + learned position
embedding (host lookups, exact). Sampler: RMSNorm, LM head, argmax.

The layer functions are pure and take one padded batch; `LayerKernels`
jits them once and runs them at bucketed batch sizes (the next power of two
up to `max_batch`), counting XLA compilations.

`TinyMoEConfig.matmul` picks the arithmetic. "xla": XLA's dots and
reductions, whose bits on GPU depend on the batch size (other tilings for
other shapes), so engines that run other batch sizes may generate other
tokens. "row_invariant": every matmul is `moe_jax.row_invariant.matmul` and
every sum (RMSNorm, softmax, attention) a pairwise sum in a fixed order over
a materialized product, so each output row is, bit for bit, a function of
its own input row on any platform and at any bucket: the asynchronous and
synchronous engines then generate the same tokens on GPUs too.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

from moe_jax import row_invariant
from moe_jax.experts import ExpertWeights, init_expert_weights, swiglu_grouped

MATMULS = ("xla", "row_invariant")


@dataclasses.dataclass(frozen=True)
class TinyMoEConfig:
    """Sizes and arithmetic of the tiny model (float32 throughout)."""

    vocab: int = 64
    hidden: int = 16
    ffn: int = 32
    heads: int = 2
    num_blocks: int = 2
    num_experts: int = 4
    top_k: int = 2
    max_len: int = 32
    # Expert load: expert e receives a share of all (token, pick) entries
    # proportional to exp(-expert_skew * e / num_experts) (0: uniform); the
    # router bias of every block is calibrated to it (`skewed_router_bias`).
    expert_skew: float = 0.0
    matmul: str = "xla"   # "xla" or "row_invariant" (see the module docstring)

    def __post_init__(self):
        for name in ("vocab", "hidden", "ffn", "heads", "num_blocks", "num_experts",
                     "top_k", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {self.matmul!r}")
        if not (np.isfinite(self.expert_skew) and self.expert_skew >= 0):
            raise ValueError(f"expert_skew must be a finite number >= 0, got {self.expert_skew}")


def target_expert_shares(num_experts: int, top_k: int, skew: float) -> np.ndarray:
    """float64 [E] share of (token, pick) entries per expert, summing to 1.

    Proportional to exp(-skew * e / E), then capped at 1 / top_k (a token
    picks distinct experts, so no expert can take more than 1 / top_k of the
    picks) with the excess spread proportionally over the uncapped experts.
    """
    share = np.exp(-skew * np.arange(num_experts) / num_experts)
    share /= share.sum()
    cap = 1.0 / top_k
    capped = np.zeros(num_experts, bool)
    while (share > cap * (1 + 1e-12)).any():
        capped |= share > cap
        free = ~capped
        share[capped] = cap
        share[free] *= (1.0 - cap * capped.sum()) / share[free].sum()
    return share


def skewed_router_bias(router: np.ndarray, top_k: int, target: np.ndarray,
                       seed: int, samples: int = 8192, iterations: int = 200) -> np.ndarray:
    """float32 [E] router bias whose top-k picks follow `target` shares.

    The expert inputs u = RMSNorm(h) are modelled as normalized Gaussian rows;
    the bias is fitted on `samples` of them by damped multiplicative updates
    (bias_e += 0.5 * log(target_e / realized_e)). On such inputs, the
    realized shares come within about 0.01 of the target.
    """
    num_experts = router.shape[1]
    if np.allclose(target, 1.0 / num_experts):
        return np.zeros((num_experts,), np.float32)
    logits = normalized_gaussian_rows(samples, router.shape[0], seed) @ router
    bias = np.log(target) * np.std(logits)
    for _ in range(iterations):
        share = realized_expert_shares(logits + bias, top_k)
        bias += 0.5 * np.log(target / np.maximum(share, 0.5 / (samples * top_k)))
    return bias.astype(np.float32)


def normalized_gaussian_rows(num: int, hidden: int, seed: int, dtype=np.float64) -> np.ndarray:
    """[num, hidden] Gaussian rows scaled to unit RMS (in `dtype`): the model
    of the expert inputs u = RMSNorm(h) that router biases are fitted on."""
    x = np.random.default_rng(seed).normal(size=(num, hidden)).astype(dtype)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)


def realized_expert_shares(logits: np.ndarray, top_k: int) -> np.ndarray:
    """float64 [E] share of the top-k picks of `logits` [N, E] per expert."""
    top = np.argpartition(-logits, top_k - 1, axis=-1)[:, :top_k]
    return np.bincount(top.ravel(), minlength=logits.shape[1]) / top.size


def init_params(key: jax.Array, config: TinyMoEConfig) -> dict[str, Any]:
    """Random weights: {'embed' [V,H], 'pos' [L,H], 'blocks': [...], 'final_norm', 'lm_head'}."""
    c = config
    keys = jax.random.split(key, 3 + c.num_blocks)
    scale = c.hidden ** -0.5
    target = target_expert_shares(c.num_experts, c.top_k, c.expert_skew)
    blocks = []
    for b in range(c.num_blocks):
        kq, kk, kv, ko, kr, ke = jax.random.split(keys[3 + b], 6)
        router = np.asarray(jax.random.normal(kr, (c.hidden, c.num_experts)))
        bias = skewed_router_bias(router, c.top_k, target, seed=b)
        blocks.append(dict(
            attn_norm=np.ones((c.hidden,), np.float32),
            wq=np.asarray(jax.random.normal(kq, (c.hidden, c.hidden))) * scale,
            wk=np.asarray(jax.random.normal(kk, (c.hidden, c.hidden))) * scale,
            wv=np.asarray(jax.random.normal(kv, (c.hidden, c.hidden))) * scale,
            wo=np.asarray(jax.random.normal(ko, (c.hidden, c.hidden))) * scale,
            moe_norm=np.ones((c.hidden,), np.float32),
            router=router,
            router_bias=bias,
            experts=ExpertWeights(*(np.asarray(w) for w in
                                    init_expert_weights(ke, c.num_experts, c.hidden, c.ffn)))))
    return dict(
        embed=np.asarray(jax.random.normal(keys[0], (c.vocab, c.hidden)), np.float32),
        pos=np.asarray(jax.random.normal(keys[1], (c.max_len, c.hidden)) * 0.1, np.float32),
        blocks=blocks,
        final_norm=np.ones((c.hidden,), np.float32),
        lm_head=np.asarray(jax.random.normal(keys[2], (c.hidden, c.vocab)) * scale, np.float32))


def embed(params, token_id: int, position: int) -> np.ndarray:
    """float32 [H] input of block 0 for one token (exact host lookup)."""
    return (params["embed"][token_id] + params["pos"][position]).astype(np.float32)


def _pairwise_sum(x):
    """Sum over the last axis, keeping it: halves added pairwise in a fixed
    order (zero-padded to a power of two), each output element from its own
    inputs only. The barrier keeps a product feeding it from being fused
    (and contracted into FMAs) differently at other shapes."""
    x = jax.lax.optimization_barrier(x)
    n = x.shape[-1]
    size = 1 << (n - 1).bit_length()
    if size != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def _sum_last(x, matmul: str):
    """Sum over the last axis, kept as size 1."""
    if matmul == "row_invariant":
        return _pairwise_sum(x)
    return jnp.sum(x, -1, keepdims=True)


def _dot(x, w, matmul: str):
    """float32 x [N, K] @ w [K, M] -> [N, M]."""
    if matmul == "row_invariant":
        return row_invariant.matmul(x, w)
    return x @ w


def _rms_norm(x, scale, matmul: str):
    x32 = x.astype(jnp.float32)
    mean_square = _sum_last(x32 * x32, matmul) / x32.shape[-1]
    return x32 * jax.lax.rsqrt(mean_square + 1e-6) * scale


def _softmax(x, matmul: str):
    unnormalized = jnp.exp(x - jnp.max(x, -1, keepdims=True))
    return unnormalized / _sum_last(unnormalized, matmul)


def _attend(q, keys, values, pos, matmul: str):
    """Causal attention of one query row per slot over its cache.

    q: [N, nh, hd] (already scaled); keys, values: [N, L, nh, hd]; pos: [N].
    Returns [N, nh, hd].
    """
    mask = jnp.arange(keys.shape[1])[None, None, :] <= pos[:, None, None]
    if matmul == "row_invariant":
        scores = _pairwise_sum(q[:, None] * keys)[..., 0].transpose(0, 2, 1)   # [N, nh, L]
        probs = _softmax(jnp.where(mask, scores, -1e30), matmul)
        values_t = values.transpose(0, 2, 3, 1)                                # [N, nh, hd, L]
        return _pairwise_sum(probs[:, :, None, :] * values_t)[..., 0]
    scores = jnp.einsum("nhd,nlhd->nhl", q, keys)
    probs = _softmax(jnp.where(mask, scores, -1e30), matmul)
    return jnp.einsum("nhl,nlhd->nhd", probs, values)


def _route(logits, top_k: int, matmul: str):
    """Mixtral routing: softmax over experts, top-k, weights renormalized.
    Returns expert ids int32 [N, k] and weights float32 [N, k]."""
    top_probs, expert_ids = jax.lax.top_k(_softmax(logits, matmul), top_k)
    return expert_ids.astype(jnp.int32), top_probs / _sum_last(top_probs, matmul)


def attention_fn(p, x, pos, slot, k_cache, v_cache, *, heads: int, top_k: int,
                 matmul: str = "xla"):
    """Attention + router of one block for a padded batch.

    Args:
      p: the block's params (attn_norm, wq, wk, wv, wo, moe_norm, router, router_bias).
      x: float32 [N, H] residual stream. pos, slot: int32 [N] position and KV
        slot of each row (padding rows use the spare last slot).
      k_cache, v_cache: float32 [S+1, L, H] this block's cache of the rank.
      matmul: "xla" or "row_invariant" (module docstring).
    Returns:
      h [N,H] residual after attention, u [N,H] expert input, expert_ids
      int32 [N,k], weights float32 [N,k], updated k_cache, v_cache.
    """
    n, hidden = x.shape
    hd = hidden // heads
    xn = _rms_norm(x, p["attn_norm"], matmul)
    q, k, v = (_dot(xn, p[w], matmul) for w in ("wq", "wk", "wv"))
    k_cache = k_cache.at[slot, pos].set(k)
    v_cache = v_cache.at[slot, pos].set(v)
    keys = k_cache[slot].reshape(n, -1, heads, hd)      # [N, L, nh, hd]
    values = v_cache[slot].reshape(n, -1, heads, hd)
    q = q.reshape(n, heads, hd) * np.float32(hd ** -0.5)
    attn = _attend(q, keys, values, pos, matmul).reshape(n, hidden)
    h = x + _dot(attn, p["wo"], matmul)
    u = _rms_norm(h, p["moe_norm"], matmul)
    expert_ids, weights = _route(_dot(u, p["router"], matmul) + p["router_bias"], top_k, matmul)
    return h, u, expert_ids, weights, k_cache, v_cache


def expert_fn(w_gate_up, w_down, u, matmul: str = "xla"):
    """SwiGLU of one expert: u float32 [N, H] -> [N, H] (float32 matmuls);
    w_gate_up [H, 2F] fused as in ExpertWeights, w_down [F, H]."""
    weights = ExpertWeights(w_gate_up[None], w_down[None])
    sizes = jnp.full((1,), u.shape[0], jnp.int32)
    return swiglu_grouped(u, sizes, weights, jnp.float32, matmul=matmul)


def sampler_fn(final_norm, lm_head, x, matmul: str = "xla"):
    """Greedy next token: x float32 [N, H] -> int32 [N]."""
    logits = _dot(_rms_norm(x, final_norm, matmul), lm_head, matmul)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """Powers of two 1, 2, 4, ... up to and including max_batch (a power of two)."""
    if max_batch < 1 or max_batch & (max_batch - 1):
        raise ValueError(f"max_batch must be a power of two >= 1, got {max_batch}")
    return tuple(1 << i for i in range(max_batch.bit_length()))


def bucket_for(n: int, max_batch: int) -> int:
    """Smallest power of two >= n (n in [1, max_batch])."""
    if not 1 <= n <= max_batch:
        raise ValueError(f"n must be in [1, {max_batch}], got {n}")
    return 1 << (n - 1).bit_length()


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compile_lock = threading.Lock()
_compile_total = [0]
_listener_installed = [False]


def _install_listener():
    with _compile_lock:
        if _listener_installed[0]:
            return

        def listener(event, duration, **kwargs):
            if event == _COMPILE_EVENT:
                _compile_total[0] += 1

        jax.monitoring.register_event_duration_secs_listener(listener)
        _listener_installed[0] = True


class LayerKernels:
    """Jitted layer functions run at bucketed batch sizes on given devices.

    Args:
      config: the model sizes.
      params: weights from `init_params`.
      max_batch: largest bucket (power of two); batches are padded to the
        next power of two.

    `compile_count` counts XLA backend compilations that happened inside
    this object's calls (one per function, bucket and device at most).
    """

    def __init__(self, config: TinyMoEConfig, params, max_batch: int = 16):
        _install_listener()
        self.config = config
        self.params = params
        self.max_batch = max_batch
        self.buckets = bucket_sizes(max_batch)
        self.compile_count = 0
        self.calls = 0
        self.last_call_s = 0.0   # wall time of the latest attention/expert/sampler call
        # The KV caches (arguments 4 and 5) are updated in place: without
        # donation every call would copy the whole cache of the block.
        self._attention = jax.jit(lambda *a: attention_fn(*a, heads=config.heads,
                                                          top_k=config.top_k,
                                                          matmul=config.matmul),
                                  donate_argnums=(4, 5))
        self._expert = jax.jit(lambda *a: expert_fn(*a, matmul=config.matmul))
        self._sampler = jax.jit(lambda *a: sampler_fn(*a, matmul=config.matmul))
        self._on_device: dict[Any, Any] = {}

    def params_on(self, device):
        """Weights committed to `device`: attention params per block, expert
        (w_gate_up, w_down) per (block, expert), final_norm, lm_head."""
        if device not in self._on_device:
            put = lambda a: jax.device_put(np.asarray(a), device)  # noqa: E731
            blocks = self.params["blocks"]
            self._on_device[device] = dict(
                attention=[{k: put(v) for k, v in p.items() if k != "experts"} for p in blocks],
                experts=[[tuple(put(w[e]) for w in p["experts"])
                          for e in range(self.config.num_experts)] for p in blocks],
                final_norm=put(self.params["final_norm"]),
                lm_head=put(self.params["lm_head"]))
        return self._on_device[device]

    def new_cache(self, device, slots: int):
        """Zero KV caches [S+1, L, H] per block (slot S is the padding slot)."""
        c = self.config
        zeros = np.zeros((slots + 1, c.max_len, c.hidden), np.float32)
        return [(jax.device_put(zeros, device), jax.device_put(zeros, device))
                for _ in range(c.num_blocks)]

    def _run(self, fn, *args):
        before = _compile_total[0]
        out = fn(*args)
        out = jax.block_until_ready(out)
        self.compile_count += _compile_total[0] - before
        self.calls += 1
        return out

    def _pad(self, rows: np.ndarray, fill=0):
        n = rows.shape[0]
        size = bucket_for(n, self.max_batch)
        if size == n:
            return rows
        pad = np.full((size - n,) + rows.shape[1:], fill, rows.dtype)
        return np.concatenate([rows, pad])

    def attention(self, device, block: int, x, pos, slot, cache, spare_slot: int):
        """Runs attention of `block` on rows x [n,H]; returns host arrays + new cache.

        The buffers of `cache` are donated: only the returned cache is valid afterwards.
        """
        t0 = time.perf_counter()
        n = x.shape[0]
        pb = self.params_on(device)["attention"][block]
        args = (self._pad(np.asarray(x, np.float32)), self._pad(np.asarray(pos, np.int32)),
                self._pad(np.asarray(slot, np.int32), spare_slot))
        args = tuple(jax.device_put(a, device) for a in args)
        h, u, ids, w, kc, vc = self._run(self._attention, pb, *args, cache[0], cache[1])
        out = (np.asarray(h)[:n], np.asarray(u)[:n], np.asarray(ids)[:n],
                np.asarray(w)[:n], (kc, vc))
        self.last_call_s = time.perf_counter() - t0
        return out

    def expert(self, device, block: int, expert: int, u):
        """SwiGLU of expert `expert` of `block` on rows u [n,H] -> [n,H]."""
        t0 = time.perf_counter()
        n = u.shape[0]
        w_gate_up, w_down = self.params_on(device)["experts"][block][expert]
        x = jax.device_put(self._pad(np.asarray(u, np.float32)), device)
        out = np.asarray(self._run(self._expert, w_gate_up, w_down, x))[:n]
        self.last_call_s = time.perf_counter() - t0
        return out

    def sampler(self, device, x):
        """Greedy token ids int32 [n] of final hidden rows x [n,H]."""
        t0 = time.perf_counter()
        n = x.shape[0]
        p = self.params_on(device)
        xs = jax.device_put(self._pad(np.asarray(x, np.float32)), device)
        out = np.asarray(self._run(self._sampler, p["final_norm"], p["lm_head"], xs))[:n]
        self.last_call_s = time.perf_counter() - t0
        return out

    def timing_step(self, kind: str, device, size: int, slots: int):
        """A zero-argument function that runs one `kind` execution ("attention",
        "expert" or "sampler") of `size` rows on `device` with inputs already on
        the device, and returns its outputs unblocked (for cost measurement).
        Attention chains its donated KV cache from call to call."""
        c = self.config
        p = self.params_on(device)
        put = lambda a: jax.device_put(a, device)  # noqa: E731
        x = put(np.random.default_rng(size).normal(size=(size, c.hidden)).astype(np.float32))
        if kind == "expert":
            weights = p["experts"][0][0]
            return lambda: self._expert(*weights, x)
        if kind == "sampler":
            return lambda: self._sampler(p["final_norm"], p["lm_head"], x)
        if kind != "attention":
            raise ValueError(f"kind must be 'attention', 'expert' or 'sampler', got {kind!r}")
        pos = put(np.full((size,), c.max_len - 1, np.int32))
        slot = put((np.arange(size) % slots).astype(np.int32))
        cache = list(self.new_cache(device, slots)[0])

        def step():
            out = self._attention(p["attention"][0], x, pos, slot, cache[0], cache[1])
            cache[0], cache[1] = out[4], out[5]
            return out
        return step

    def warm_up(self, attention_devices, expert_devices, slots: int) -> int:
        """Compiles every bucket of every function on the devices that run it;
        returns the compilations this caused."""
        before = self.compile_count
        h = self.config.hidden
        for device in attention_devices:
            cache = self.new_cache(device, slots)[0]
            for size in self.buckets:
                zeros = np.zeros((size, h), np.float32)
                idx = np.zeros((size,), np.int32)
                cache = self.attention(device, 0, zeros, idx, idx + slots, cache, slots)[4]
                self.sampler(device, zeros)
        for device in expert_devices:
            for size in self.buckets:
                self.expert(device, 0, 0, np.zeros((size, h), np.float32))
        return self.compile_count - before
