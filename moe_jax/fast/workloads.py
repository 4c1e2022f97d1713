"""Synthetic all-to-all(v) traffic matrices (uniform and Zipf-skewed).

The FAST paper evaluates "random alltoallv with uniformly-distributed sizes"
and "skewed alltoallv with Zipfian-distributed sizes" (skewness 0.4-0.9 in
profiled MoE traces) without giving the exact generator; these are ours.
"""

from __future__ import annotations

import numpy as np


def uniform_matrix(rng: np.random.Generator, num_gpus: int,
                   mean: float = 1000.0) -> np.ndarray:
  """int64[G, G]: entries uniform in [0, 2 * mean], diagonal kept."""
  if num_gpus < 1:
    raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
  if mean < 0:
    raise ValueError(f"mean must be >= 0, got {mean}")
  return rng.integers(0, int(2 * mean) + 1, size=(num_gpus, num_gpus),
                      dtype=np.int64)


def zipf_matrix(rng: np.random.Generator, num_gpus: int, skew: float,
                mean: float = 1000.0, scope: str = "global") -> np.ndarray:
  """int64[G, G]: Zipf-skewed sizes.

  ``scope="global"``: the G^2 entries get sizes proportional to
  ``1 / k**skew`` for ranks ``k = 1 .. G^2`` in random positions (skew of
  senders and receivers; the largest flow grows with G).  ``scope="row"``:
  each source GPU ranks its own G destinations the same way (every sender
  sends the same total; receivers are skewed).  Scaled so the mean entry is
  ``mean`` (rounded down).  ``skew = 0`` is a constant matrix.
  """
  if num_gpus < 1:
    raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
  if skew < 0:
    raise ValueError(f"skew must be >= 0, got {skew}")
  if mean < 0:
    raise ValueError(f"mean must be >= 0, got {mean}")
  if scope not in ("global", "row"):
    raise ValueError(f"scope must be 'global' or 'row', got {scope!r}")
  size = num_gpus * num_gpus if scope == "global" else num_gpus
  k = np.arange(1, size + 1, dtype=np.float64)
  w = k ** (-float(skew))
  w = np.floor(w * (mean * w.size / w.sum())).astype(np.int64)
  if scope == "global":
    return rng.permutation(w).reshape(num_gpus, num_gpus)
  return np.stack([rng.permutation(w) for _ in range(num_gpus)])
