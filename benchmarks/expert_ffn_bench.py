"""The experts at grouped-GEMM speed: the SwiGLU expert FFN and the whole MoE
layer on one GPU, against every baseline the machine has, in one run.

    python -m benchmarks.expert_ffn_bench --out=OUT_DIR [--rows=32,512,2048,8192]
        [--layer_tokens=256,1024,4096] [--train_tokens=4096]
        [--decode_groups=1,2,4,8 --decode_rows=16,64,256]

Part 1, the expert FFN (rows sorted by expert, group sizes drawn with an
exponential skew, shares ~ exp(-skew * e / E)): moe_jax's CUTLASS grouped
GEMMs (`swiglu_grouped(..., matmul="cutlass")`: gate/up with the fused
SwiGLU epilogue, then down) against `lax.ragged_dot` (matmul="xla"), jax's
Pallas Mosaic GPU `ragged_dot_mgpu` (best of a few block configurations),
and `torch._grouped_mm` when PyTorch is installed; next to the dense bf16
matmul rate and the device-to-device copy bandwidth measured in the same
run (the FLOP and weight-streaming floors).

Part 2, the whole `moe_layer` (strategy "dense": one GPU, router, dispatch,
experts, combine) with matmul="auto" (the CUTLASS kernels) and "xla", and a
padded batched einsum at the realized largest expert load, against the bf16
FLOP floor. Part 3: one training step (forward + backward) of the layer.
Part 4, one rank's experts at decode sizes: G local experts (the experts of
one rank at EP size E / G) over a few rows split evenly, with matmul="auto"
(which runs a batched dense matmul where the grouped kernel has too few
tiles), "cutlass" and `torch._grouped_mm`, against the time to stream the G
experts' weights at the measured copy bandwidth.

Times are medians over --reps runs of --iters back-to-back calls, timed on
the host up to the end of the last call (JAX and PyTorch alike). Writes
OUT_DIR/<tag>.json and .md with the device, versions, date, command, commit
and the digests of the sources and the built extensions.
"""

from __future__ import annotations

import os

# Baselines run in child processes and PyTorch shares the GPU: no JAX
# preallocation of most of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import datetime
import functools
import json
import platform
import subprocess
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.provenance import commit, extension_digest, portable_command, source_digest
from benchmarks.timing import median_seconds_per_call
from moe_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["32", "512", "2048", "8192"], "Expert FFN row counts M.")
flags.DEFINE_list("layer_tokens", ["256", "1024", "4096"], "Whole-layer token counts.")
flags.DEFINE_integer("train_tokens", 4096, "Tokens of the training-step case (0: skip).")
flags.DEFINE_enum("train_kernel_impl", "custom_call", ["custom_call", "reference"],
                  "MoEConfig.kernel_impl of the training-step case (pack / combine).")
flags.DEFINE_integer("hidden", 4096, "Model width H.")
flags.DEFINE_integer("ffn", 14336, "Expert width F.")
flags.DEFINE_integer("experts", 8, "Experts E.")
flags.DEFINE_integer("top_k", 2, "Experts per token (layer cases).")
flags.DEFINE_float("skew", 1.0, "Exponential skew of the FFN cases' group sizes.")
flags.DEFINE_list("methods", ["cutlass", "xla", "pallas", "torch"], "FFN methods to time.")
flags.DEFINE_list("decode_groups", ["1", "2", "4", "8"],
                  "Local expert counts G of the decode cases (empty: skip them).")
flags.DEFINE_list("decode_rows", ["16", "64", "256"], "Row counts of the decode cases.")
flags.DEFINE_integer("iters", 10, "Calls per timed run.")
flags.DEFINE_integer("reps", 7, "Timed runs per case (the median is reported).")
flags.DEFINE_string("out", None, "Folder for the JSON and markdown (required).")
flags.DEFINE_string("tag", "", "File stem (default expert_ffn_<device>).")
flags.DEFINE_bool("pallas_child", False, "Internal: time the Pallas baseline and print JSON.")


def _time_jax(fn, *args) -> float:
    return median_seconds_per_call(fn, *args, reps=FLAGS.reps, iters=FLAGS.iters)


def _time_torch(fn) -> float:
    """Median seconds per call of fn, timed like _time_jax: on the host around
    `iters` back-to-back calls and a synchronize."""
    import torch
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(FLAGS.reps):
        start = time.perf_counter()
        for _ in range(FLAGS.iters):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) / FLAGS.iters)
    return statistics.median(runs)


def _floors() -> dict:
    """The dense bf16 matmul rate and the copy bandwidth of this GPU."""
    key = jax.random.key(7)
    m, k, n = 8192, FLAGS.hidden, FLAGS.ffn
    a = jax.random.normal(key, (m, k), jnp.bfloat16)
    b = jax.random.normal(key, (k, n), jnp.bfloat16)
    dense = _time_jax(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16)),
                      a, b)
    big = jax.random.normal(key, (512, 1024, 1024), jnp.bfloat16)  # 1 GiB
    copy = _time_jax(jax.jit(lambda x: x + jnp.bfloat16(1)), big)
    return dict(dense_tflops=2 * m * k * n / dense / 1e12,
                copy_gbps=2 * big.size * 2 / copy / 1e9)


def _group_sizes(rng, rows: int) -> np.ndarray:
    share = np.exp(-FLAGS.skew * np.arange(FLAGS.experts) / FLAGS.experts)
    picks = rng.choice(FLAGS.experts, size=rows, p=share / share.sum())
    return np.bincount(picks, minlength=FLAGS.experts).astype(np.int32)


PALLAS_CONFIG = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                     grid_block_n=1)


def _pallas_ragged_dot():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return functools.partial(ragged_dot_mgpu.ragged_dot, **PALLAS_CONFIG)


def _ffn_jax(method):
    """A jitted (x, group_sizes, w_gate_up, w_down) -> [M, H] expert FFN
    (the weights are arguments: closed over, they would be compiled in as
    constants)."""
    import moe_jax as mj
    from moe_jax.ops.grouped_matmul import split_gate_up

    if method in ("auto", "cutlass", "xla"):
        return jax.jit(lambda x, gs, w_gate_up, w_down: mj.swiglu_grouped(
            x, gs, mj.ExpertWeights(w_gate_up, w_down), jnp.bfloat16, matmul=method))
    dot = _pallas_ragged_dot()

    def ffn(x, gs, w_gate_up, w_down):
        gate, up = split_gate_up(dot(x, w_gate_up, group_sizes=gs))
        h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
        return dot(h, w_down, group_sizes=gs)
    return jax.jit(ffn)


def _ffn_torch(x, w_gate_up, w_down, sizes):
    """torch._grouped_mm SwiGLU on the same data (weights as [G, N, K]
    transposed views, the layout its kernels take); None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    from moe_jax.ops.grouped_matmul import split_gate_up

    to_torch = torch.from_dlpack  # zero-copy views of the JAX arrays on the GPU
    gate, up = split_gate_up(w_gate_up)
    w_gu = to_torch(jnp.concatenate([gate, up], axis=2)).transpose(1, 2).contiguous()
    w_d = to_torch(w_down).transpose(1, 2).contiguous()
    tx = to_torch(x)
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()
    ffn = w_d.shape[2]

    def run():
        h = torch._grouped_mm(tx, w_gu.transpose(1, 2), offs=offs)
        h = torch.nn.functional.silu(h[:, :ffn]) * h[:, ffn:]
        return torch._grouped_mm(h, w_d.transpose(1, 2), offs=offs)
    return run, lambda: run().float().cpu().numpy()


def _time_torch_ffn(x, weights, sizes, row: dict):
    """Times torch._grouped_mm's FFN into row["torch_us"] and returns its
    output, or records row["torch_error"] and returns None without PyTorch."""
    got = _ffn_torch(x, *weights, sizes)
    if got is None:
        row["torch_error"] = "PyTorch not installed"
        return None
    run, result = got
    row["torch_us"] = _time_torch(run) * 1e6
    return result()


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_ffn(floors: dict) -> list[dict]:
    h, f = FLAGS.hidden, FLAGS.ffn
    pallas_failed = ""
    rows_out = []
    for rows in sorted((int(r) for r in FLAGS.rows), reverse=True):
        sizes, x, weights = _ffn_inputs(rows)
        gs = jnp.asarray(sizes)
        row = dict(rows=rows, group_sizes=sizes.tolist(), flops=6 * rows * h * f,
                   weight_bytes=int((sizes > 0).sum()) * 3 * h * f * 2)
        reference = None
        for method in FLAGS.methods:
            try:
                if method == "torch":
                    out = _time_torch_ffn(x, weights, sizes, row)
                    if out is None:
                        continue
                    seconds = row.pop("torch_us") / 1e6
                elif method == "pallas":
                    if pallas_failed:
                        row["pallas_error"] = "skipped: " + pallas_failed
                        continue
                    got = _pallas_in_child(rows)
                    if "error" in got:
                        row["pallas_error"] = pallas_failed = got["error"]
                        continue
                    seconds, out = got["seconds"], None
                    row["pallas_rel_diff_to_xla"] = got["rel_diff_to_xla"]
                    row["pallas_config"] = PALLAS_CONFIG
                else:
                    fn = _ffn_jax(method)
                    seconds, out = _time_jax(fn, x, gs, *weights), fn(x, gs, *weights)
            except Exception as err:  # noqa: BLE001 (record why a baseline could not run)
                row[f"{method}_error"] = f"{type(err).__name__}: {err}"[:300]
                continue
            row[f"{method}_us"] = seconds * 1e6
            row[f"{method}_tflops"] = row["flops"] / seconds / 1e12
            if out is None:
                continue
            out = np.asarray(out, np.float32)
            if reference is None:
                reference = out
            row[f"{method}_rel_diff"] = _rel(out, reference)
        if "cutlass_us" in row:
            row["cutlass_of_dense_rate"] = row["cutlass_tflops"] / floors["dense_tflops"]
            row["cutlass_weight_gbps"] = row["weight_bytes"] / row["cutlass_us"] / 1e3
            row["cutlass_of_copy_bw"] = row["cutlass_weight_gbps"] / floors["copy_gbps"]
        rows_out.append(row)
        print("FFN", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                      if k.endswith(("_us", "_tflops", "_of_dense_rate", "_of_copy_bw",
                                     "_error"))}, flush=True)
    return sorted(rows_out, key=lambda r: r["rows"])


def bench_decode(floors: dict) -> list[dict]:
    """One rank's G experts over a few rows (Part 4)."""
    import moe_jax as mj

    h, f = FLAGS.hidden, FLAGS.ffn
    out = []
    for groups in (int(g) for g in FLAGS.decode_groups):
        weights = mj.init_expert_weights(jax.random.key(6), groups, h, f, jnp.bfloat16)
        weight_bytes = groups * 3 * h * f * 2
        for rows in (int(r) for r in FLAGS.decode_rows):
            sizes = np.full(groups, rows // groups, np.int32)
            sizes[: rows % groups] += 1
            rng = np.random.default_rng(100 * groups + rows)
            x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
            gs = jnp.asarray(sizes)
            row = dict(groups=groups, rows=rows, group_sizes=sizes.tolist(),
                       weight_bytes=weight_bytes,
                       weight_floor_us=weight_bytes / (floors["copy_gbps"] * 1e9) * 1e6)
            results = {}
            for method in ("auto", "cutlass", "torch"):
                try:
                    if method == "torch":
                        torch_out = _time_torch_ffn(x, weights, sizes, row)
                        if torch_out is not None:
                            results[method] = torch_out
                        continue
                    fn = _ffn_jax(method)
                    row[f"{method}_us"] = _time_jax(fn, x, gs, *weights) * 1e6
                    results[method] = np.asarray(fn(x, gs, *weights), np.float32)
                except Exception as err:  # noqa: BLE001 (record why a method could not run)
                    row[f"{method}_error"] = f"{type(err).__name__}: {err}"[:300]
            for method in ("auto", "torch"):
                if method in results and "cutlass" in results:
                    row[f"{method}_rel_diff_to_cutlass"] = _rel(results[method],
                                                                results["cutlass"])
            if "auto_us" in row:
                row["auto_over_floor"] = row["auto_us"] / row["weight_floor_us"]
            out.append(row)
            print("decode", {k: (round(v, 3) if isinstance(v, float) else v)
                             for k, v in row.items() if k != "group_sizes"}, flush=True)
        del weights
    return out


def _ffn_inputs(rows: int):
    """The FFN case of `rows` rows: the same draws in the parent and the child."""
    import moe_jax as mj

    rng = np.random.default_rng(rows)
    sizes = _group_sizes(rng, rows)
    x = jnp.asarray(rng.standard_normal((rows, FLAGS.hidden)), jnp.bfloat16)
    weights = mj.init_expert_weights(jax.random.key(1), FLAGS.experts, FLAGS.hidden,
                                     FLAGS.ffn, jnp.bfloat16)
    return sizes, x, weights


def _pallas_child() -> None:
    """Times the Pallas FFN at the one --rows value and prints it as JSON."""
    rows = int(FLAGS.rows[0])
    sizes, x, weights = _ffn_inputs(rows)
    gs = jnp.asarray(sizes)
    fn = _ffn_jax("pallas")
    seconds = _time_jax(fn, x, gs, *weights)
    ref = _ffn_jax("xla")(x, gs, *weights)
    print("PALLAS " + json.dumps(dict(rows=rows, seconds=seconds,
                                      rel_diff_to_xla=_rel(fn(x, gs, *weights), ref))),
          flush=True)


def _pallas_in_child(rows: int, timeout_s: float = 90) -> dict:
    """{"seconds", "rel_diff_to_xla"} or {"error"}: the Pallas baseline at
    `rows` rows in a child process, so that a crash or hang of its compiler
    (seen: aborts in the Mosaic GPU lowering) costs only this cell."""
    argv = [sys.executable, "-m", "benchmarks.expert_ffn_bench", "--pallas_child",
            f"--rows={rows}"] + [a for a in sys.argv[1:]
                                 if not a.startswith(("--out", "--rows", "--tag"))]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("PALLAS "):
            return json.loads(line[len("PALLAS "):])
    tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
    return {"error": f"child exited with {proc.returncode}: " + " | ".join(tail)[:400]}


def _padded_einsum_layer(config, capacity: int):
    """Router, top-k, tokens scattered into [E, capacity, H] buffers, one
    batched SwiGLU einsum per projection, weighted combine."""
    from moe_jax.ops.grouped_matmul import split_gate_up
    from moe_jax.routing import route, router_logits

    def layer(params, x):
        gate_w, up_w = split_gate_up(params.experts.w_gate_up)
        down_w = params.experts.w_down
        routing = route(router_logits(x, params.router, config), config, None)
        ids = routing.expert_ids.reshape(-1)
        onehot = jax.nn.one_hot(ids, config.num_experts, dtype=jnp.int32)
        pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
        tok = jnp.repeat(jnp.arange(x.shape[0]), config.top_k)
        buf = jnp.zeros((config.num_experts, capacity, x.shape[1]), x.dtype)
        buf = buf.at[ids, pos].set(x[tok], mode="drop")
        g = jnp.einsum("ech,ehf->ecf", buf, gate_w, preferred_element_type=jnp.float32)
        u = jnp.einsum("ech,ehf->ecf", buf, up_w, preferred_element_type=jnp.float32)
        hid = (jax.nn.silu(g) * u).astype(x.dtype)
        y = jnp.einsum("ecf,efh->ech", hid, down_w, preferred_element_type=jnp.float32)
        rows = y[ids, jnp.minimum(pos, capacity - 1)] * routing.weights.reshape(-1, 1)
        return jnp.sum(rows.reshape(x.shape[0], config.top_k, -1), axis=1).astype(x.dtype)
    return jax.jit(layer)


def bench_layer(floors: dict) -> list[dict]:
    import moe_jax as mj
    from moe_jax.routing import route, router_logits

    base = mj.MoEConfig(hidden_size=FLAGS.hidden, ffn_size=FLAGS.ffn, num_experts=FLAGS.experts,
                        top_k=FLAGS.top_k, strategy="dense", dtype=jnp.bfloat16,
                        param_dtype=jnp.bfloat16)
    params = mj.init_moe_params(jax.random.key(2), base)
    rng = np.random.default_rng(3)
    out = []
    for tokens in (int(t) for t in FLAGS.layer_tokens):
        x = jnp.asarray(rng.standard_normal((tokens, FLAGS.hidden)), jnp.bfloat16)
        routing = jax.jit(lambda r, x: route(router_logits(x, r, base), base, None))(
            params.router, x)
        loads = np.bincount(np.asarray(routing.expert_ids).reshape(-1),
                            minlength=FLAGS.experts)
        flops = 6 * tokens * FLAGS.top_k * FLAGS.hidden * FLAGS.ffn
        row = dict(tokens=tokens, max_expert_rows=int(loads.max()), flops=flops,
                   flop_floor_us=flops / (floors["dense_tflops"] * 1e12) * 1e6)
        results = {}
        for matmul in ("auto", "xla"):
            cfg = base.replace(matmul=matmul)
            fn = jax.jit(lambda p, x, cfg=cfg: mj.moe_layer(p, x, cfg)[0])
            row[f"layer_{matmul}_us"] = _time_jax(fn, params, x) * 1e6
            results[matmul] = np.asarray(fn(params, x), np.float32)
        padded = _padded_einsum_layer(base, int(loads.max()))
        row["padded_einsum_us"] = _time_jax(padded, params, x) * 1e6
        row["auto_vs_xla_rel_diff"] = _rel(results["auto"], results["xla"])
        row["padded_vs_xla_rel_diff"] = _rel(np.asarray(padded(params, x), np.float32),
                                             results["xla"])
        row["auto_over_floor"] = row["layer_auto_us"] / row["flop_floor_us"]
        out.append(row)
        print("layer", row, flush=True)
    return out


def bench_train(floors: dict) -> dict | None:
    import moe_jax as mj

    if FLAGS.train_tokens <= 0:
        return None
    cfg = mj.MoEConfig(hidden_size=FLAGS.hidden, ffn_size=FLAGS.ffn, num_experts=FLAGS.experts,
                       top_k=FLAGS.top_k, strategy="dense", dtype=jnp.bfloat16,
                       param_dtype=jnp.bfloat16, kernel_impl=FLAGS.train_kernel_impl)
    params = mj.init_moe_params(jax.random.key(4), cfg)
    x = jax.random.normal(jax.random.key(5), (FLAGS.train_tokens, FLAGS.hidden), jnp.bfloat16)

    def loss(p, x):
        y, aux = mj.moe_layer(p, x, cfg)
        return jnp.mean(jnp.square(y.astype(jnp.float32))) + aux.weighted_loss(cfg)

    row = dict(tokens=FLAGS.train_tokens, kernel_impl=FLAGS.train_kernel_impl)
    try:
        forward = jax.jit(loss)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        row["forward_us"] = _time_jax(forward, params, x) * 1e6
        row["forward_backward_us"] = _time_jax(step, params, x) * 1e6
    except Exception as err:  # noqa: BLE001 (recorded in the report)
        row["error"] = f"{type(err).__name__}: {err}"[:400]
        return row
    flops = 6 * FLAGS.train_tokens * FLAGS.top_k * FLAGS.hidden * FLAGS.ffn
    row["forward_backward_flop_floor_us"] = 3 * flops / (floors["dense_tflops"] * 1e12) * 1e6
    print("train", row, flush=True)
    return row


def _versions() -> dict:
    v = dict(jax=jax.__version__, jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__")
             else jax.__version__, python=platform.python_version())
    try:
        import torch
        v["torch"] = torch.__version__
    except ImportError:
        pass
    return v


def markdown(meta: dict, floors: dict, ffn: list[dict], layer: list[dict],
             train: dict | None, decode: list[dict] | None = None) -> str:
    us = lambda r, k: f"{r[k]:.0f}" if k in r else "—"  # noqa: E731
    tf = lambda r, k: f"{r[k]:.0f}" if k in r else "—"  # noqa: E731
    lines = [f"# Expert FFN and MoE layer, {meta['device']}", "",
             f"- date: {meta['date']}; commit {meta['commit']}",
             f"- command: `{portable_command(meta['command'])}`",
             f"- versions: {meta['versions']}; sources {meta['source_digest']}; "
             f"extensions {meta['extension_digest']}",
             f"- shape: hidden {meta['hidden']}, ffn {meta['ffn']}, {meta['experts']} experts, "
             f"bf16; median of {meta['reps']} runs of {meta['iters']} back-to-back calls, "
             "host-timed to the end of the last (JAX and PyTorch alike)",
             f"- measured floors: dense bf16 matmul {floors['dense_tflops']:.0f} TFLOP/s, "
             f"device copy {floors['copy_gbps']:.0f} GB/s (read + write)"]
    if ffn:
        lines += ["", "## SwiGLU expert FFN (gate/up, silu * up, down), microseconds (TFLOP/s)", "",
                  f"Group sizes skewed: shares ~ exp(-{meta['skew']} e / E).", "",
                  "| rows | group sizes | moe_jax CUTLASS | lax.ragged_dot | Pallas ragged_dot_mgpu "
                  "| torch._grouped_mm | CUTLASS / dense rate | weights streamed (GB/s, of copy bw) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in ffn:
            cell = lambda m: (f"{r[m + '_us']:.0f} ({r[m + '_tflops']:.0f})"  # noqa: E731
                              if m + "_us" in r else "—")
            stream = (f"{r['cutlass_weight_gbps']:.0f} ({r['cutlass_of_copy_bw']:.0%})"
                      if "cutlass_weight_gbps" in r else "—")
            rate = f"{r['cutlass_of_dense_rate']:.0%}" if "cutlass_of_dense_rate" in r else "—"
            lines.append(f"| {r['rows']} | {r['group_sizes']} | {cell('cutlass')} | {cell('xla')} | "
                         f"{cell('pallas')} | {cell('torch')} | {rate} | {stream} |")
    if layer:
        lines += ["", "## Whole moe_layer on one GPU (strategy dense), microseconds", "",
                  "| tokens | matmul=auto (CUTLASS) | matmul=xla | padded einsum at the largest "
                  "expert load | bf16 FLOP floor | auto / floor |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in layer:
            lines.append(f"| {r['tokens']} | {us(r, 'layer_auto_us')} | {us(r, 'layer_xla_us')} | "
                         f"{us(r, 'padded_einsum_us')} ({r['max_expert_rows']} rows) | "
                         f"{r['flop_floor_us']:.0f} | {r['auto_over_floor']:.2f}x |")
    if train:
        lines += ["", "## Training step of the layer (loss, value_and_grad), microseconds", ""]
        if "error" in train:
            lines.append(f"{train['tokens']} tokens: could not run ({train['error']})")
        else:
            lines += [f"pack / combine: kernel_impl={train['kernel_impl']!r}", "",
                      "| tokens | forward | forward + backward | 3x FLOP floor |",
                      "| --- | --- | --- | --- |",
                      f"| {train['tokens']} | {train['forward_us']:.0f} | "
                      f"{train['forward_backward_us']:.0f} | "
                      f"{train['forward_backward_flop_floor_us']:.0f} |"]
    if decode:
        lines += ["", "## One rank's experts at decode sizes, microseconds", "",
                  "G local experts (one rank's at EP size E / G), rows split evenly; "
                  "weight floor: the G experts' weights streamed at the measured copy "
                  "bandwidth (read only).", "",
                  "| G | rows | matmul=auto | matmul=cutlass | torch._grouped_mm "
                  "| weight floor | auto / floor |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in decode:
            ratio = f"{r['auto_over_floor']:.2f}x" if "auto_over_floor" in r else "—"
            lines.append(f"| {r['groups']} | {r['rows']} | {us(r, 'auto_us')} | "
                         f"{us(r, 'cutlass_us')} | {us(r, 'torch_us')} | "
                         f"{r['weight_floor_us']:.0f} | {ratio} |")
    del tf
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    if FLAGS.pallas_child:
        _pallas_child()
        return
    if not FLAGS.out:
        raise app.UsageError("--out is required: the folder for the JSON and markdown")
    device = jax.devices()[0]
    meta = dict(device=device.device_kind, platform=device.platform,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python -m benchmarks.expert_ffn_bench " + " ".join(sys.argv[1:]),
                versions=_versions(), commit=commit(), source_digest=source_digest(),
                extension_digest=extension_digest(), hidden=FLAGS.hidden, ffn=FLAGS.ffn,
                experts=FLAGS.experts, skew=FLAGS.skew, reps=FLAGS.reps, iters=FLAGS.iters)
    tag = FLAGS.tag or "expert_ffn_" + device.device_kind.replace(" ", "_")
    os.makedirs(FLAGS.out, exist_ok=True)
    results = dict(meta=meta, floors=_floors(), ffn=[], layer=[], train=None, decode=[])
    print("floors", results["floors"], flush=True)

    def write():  # after every part, so a run cut short keeps what it measured
        with open(os.path.join(FLAGS.out, tag + ".json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(FLAGS.out, tag + ".md"), "w") as f:
            f.write(markdown(**results))

    results["ffn"] = bench_ffn(results["floors"])
    write()
    results["layer"] = bench_layer(results["floors"])
    write()
    results["train"] = bench_train(results["floors"])
    write()
    results["decode"] = bench_decode(results["floors"])
    write()
    print(f"wrote {FLAGS.out}/{tag}.json and .md")


if __name__ == "__main__":
    cli.run(main)
