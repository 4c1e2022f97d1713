"""One rank's view of an execution plan, as one ragged all-to-all per phase.

The pure_callback path (``moe_jax.fast.staged``) executes a plan with
collectives that exist on every backend: in each phase every rank gathers
the rows it sends into a send buffer grouped by destination rank, one
ragged all-to-all moves them (self included), and the rows that arrive are
scattered to their ``out`` or workspace rows.  This module computes the
index arrays of that program for one rank, padded to static shapes.

Row spaces: a rank reads rows of ``concat(x, ws)`` (``x`` rows first) and
writes rows of ``concat(out, ws)`` (``out`` rows first).  Within one
(sender, receiver) chunk rows keep the plan's op order on both sides.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_jax.fast import plan as pl


@dataclasses.dataclass
class PhaseArrays:
  """Index arrays of one rank (PH phases, P ranks), all int32.

  Attributes:
    num_phases: [] phases that carry ops (the same on every rank).
    send_rows: [PH, NS] rows of concat(x, ws) to send, grouped by
      destination rank; entries past the phase's total are 0.
    send_sizes, send_offsets: [PH, P] rows for each destination and where
      they start in the send buffer.
    out_offsets: [PH, P] where this rank's rows start in each receiver's
      receive buffer (``lax.ragged_all_to_all``'s output_offsets).
    recv_sizes, recv_offsets: [PH, P] rows from each source and where they
      start in this rank's receive buffer (grouped by source rank).
    recv_rows: [PH, NR] row of concat(out, ws) for each receive-buffer row;
      ``rows_out + ws_rows`` (out of range: dropped) past the total.
  """
  num_phases: np.ndarray
  send_rows: np.ndarray
  send_sizes: np.ndarray
  send_offsets: np.ndarray
  out_offsets: np.ndarray
  recv_sizes: np.ndarray
  recv_offsets: np.ndarray
  recv_rows: np.ndarray

  def as_tuple(self):
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
  """Concatenation of arange(s, s + c) for each (s, c)."""
  counts = np.asarray(counts, np.int64)
  total = int(counts.sum())
  if total == 0:
    return np.zeros((0,), np.int64)
  first = np.repeat(np.asarray(starts, np.int64) - (np.cumsum(counts) - counts),
                    counts)
  return first + np.arange(total)


def _rows_of(ph, rank, side, peer, row, buf, ws_base):
  """Rows (workspace rows offset by ws_base) of the ops of one phase whose
  `side` column is `rank`, in peer order, each op's rows in order."""
  mine = ph[ph[:, side] == rank]
  mine = mine[np.argsort(mine[:, peer], kind="stable")]
  starts = mine[:, row] + np.where(mine[:, buf] == pl.WS, ws_base, 0)
  return _ranges(starts, mine[:, pl.ROWS])


def shapes(num_ranks: int, phases: int, send_cap: int, recv_cap: int) -> dict:
  """Shapes of the PhaseArrays fields (for jax.pure_callback)."""
  return dict(num_phases=(), send_rows=(phases, send_cap),
              send_sizes=(phases, num_ranks), send_offsets=(phases, num_ranks),
              out_offsets=(phases, num_ranks), recv_sizes=(phases, num_ranks),
              recv_offsets=(phases, num_ranks), recv_rows=(phases, recv_cap))


def phase_arrays(plan: pl.ExecutionPlan, rank: int, rows_in: int,
                 rows_out: int, ws_rows: int, phases: int, send_cap: int,
                 recv_cap: int) -> PhaseArrays:
  """Rank ``rank``'s arrays for ``plan`` (see PhaseArrays).

  Raises ValueError when the plan needs more phases, send or receive rows
  than the static shapes hold.
  """
  ops = plan.ops
  g = plan.num_servers * plan.gpus_per_server
  if plan.num_phases > phases:
    raise ValueError(f"plan has {plan.num_phases} phases, room for {phases}")
  out = PhaseArrays(
      np.asarray(plan.num_phases, np.int32),
      np.zeros((phases, send_cap), np.int32),
      *(np.zeros((phases, g), np.int32) for _ in range(5)),
      np.full((phases, recv_cap), rows_out + ws_rows, np.int32))
  for p in range(plan.num_phases):
    ph = ops[ops[:, pl.PHASE] == p]
    sizes = np.zeros((g, g), np.int64)  # [src, dst] rows in this phase
    np.add.at(sizes, (ph[:, pl.SRC], ph[:, pl.DST]), ph[:, pl.ROWS])
    recv_off = np.cumsum(sizes, axis=0) - sizes  # at each receiver, by src

    rows = _rows_of(ph, rank, pl.SRC, pl.DST, pl.SRC_ROW, pl.SRC_BUF, rows_in)
    if rows.size > send_cap:
      raise ValueError(f"rank {rank} sends {rows.size} rows in phase {p}, "
                       f"room for {send_cap}")
    out.send_rows[p, :rows.size] = rows
    out.send_sizes[p] = sizes[rank]
    out.send_offsets[p] = np.cumsum(sizes[rank]) - sizes[rank]
    out.out_offsets[p] = recv_off[rank]

    rows = _rows_of(ph, rank, pl.DST, pl.SRC, pl.DST_ROW, pl.DST_BUF, rows_out)
    if rows.size > recv_cap:
      raise ValueError(f"rank {rank} receives {rows.size} rows in phase {p}, "
                       f"room for {recv_cap}")
    out.recv_rows[p, :rows.size] = rows
    out.recv_sizes[p] = sizes[:, rank]
    out.recv_offsets[p] = recv_off[:, rank]
  return out
