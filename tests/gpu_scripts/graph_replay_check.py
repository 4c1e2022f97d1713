"""Checks that dispatch runs inside CUDA graphs and stays exact across replays.

    XLA_FLAGS="--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer=..." \
        python tests/gpu_scripts/graph_replay_check.py RANKS

Compiles cap_and_spill once per transport (with the flags above XLA captures
every command sequence, the moe_jax custom calls included, into CUDA graphs),
then replays it on fresh routings (including ones that need the fallback)
and compares the delivered rows with `dense`, bit for bit. Prints PASS or
exits non-zero.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moe_jax as mj  # noqa: E402
import moe_testing as mt  # noqa: E402


def main(ranks: int) -> None:
    num_experts, hidden = 2 * ranks, 256
    experts = mj.init_expert_weights(jax.random.key(0), num_experts, hidden, 128)
    for transport in ("custom_call", "lax", "nvlink"):
        for replay, kind in enumerate(["random", "zipf", "one_expert", "random", "empty_rank"]):
            x, ids, w = mt.random_case(replay, ranks, 16, num_experts, 2, hidden, kind,
                                       jnp.bfloat16)
            # The same compiled program every replay (run_strategy caches it).
            out, rows, valid, stats = mt.run_strategy(
                "cap_and_spill", x, ids, w, experts, ranks, capacity=2, spill=1,
                transport=transport, backend="gpu")
            ref_out, ref_rows, ref_sizes = mt.run_dense(x, ids, w, experts)
            for rank, expected in enumerate(mt.expected_rank_rows(ref_rows, ref_sizes, ranks)):
                n = expected.shape[0]
                if not (valid[rank, :n].all() and not valid[rank, n:].any()) or not \
                        np.array_equal(mt.bits(rows[rank, :n]), mt.bits(expected)):
                    sys.exit(f"FAIL {transport} replay {replay} ({kind}): rank {rank} rows")
            err = mt.rel_error(np.asarray(out), ref_out)
            if err > 1e-2:
                sys.exit(f"FAIL {transport} replay {replay}: output error {err}")
            print(f"{transport} replay {replay} ({kind}): exact rows, output error {err:.1e}, "
                  f"fallback {int(stats.fallback_steps)}")
    print("PASS")


if __name__ == "__main__":
    main(int(sys.argv[1]))
