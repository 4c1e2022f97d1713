"""Two-tier topology for the staged all-to-all: given, or read from
``nvidia-smi topo -m``.

FAST's model: ``num_servers`` servers of ``gpus_per_server`` GPUs each, a
fast fabric inside a server and a slower one between servers.  Rank ``r``
of the all-to-all axis is local GPU ``r % M`` of server ``r // M``.

On one host the fast domains are NVLink islands: GPUs joined (directly or
through other GPUs) by NVLink (``NV#`` in ``nvidia-smi topo -m``) form one
"server"; GPUs that only reach each other over PCIe / the host (``PIX``,
``PXB``, ``PHB``, ``NODE``, ``SYS``) are in different ones.  So an
all-NVLink host (e.g. 4 or 8 x H100/H200 SXM) is one server of P GPUs
(plain direct all-to-all), a PCIe-only host is P servers of one GPU (the
Birkhoff-von Neumann stages become contention-free permutations), and
NVLink-bridged pairs on PCIe are P/2 servers of 2.  A given Topology can
also *emulate* several servers on one host (e.g. 2 x 2 on 4 GPUs), which
is how the multi-server code paths are tested on a single machine.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from typing import Callable, Sequence

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"^GPU(\d+)$")
_NVLINK = re.compile(r"^NV\d+$")
PCIE_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")


@dataclasses.dataclass(frozen=True)
class Topology:
  """``num_servers`` x ``gpus_per_server`` GPUs.

  ``source`` says where it came from: "given", "nvlink" (one NVLink
  island), "pcie" (no NVLink: one GPU per server), "nvlink_islands"
  (several equal islands) or "default" (detection failed or gave no usable
  grouping: one server); ``detail`` says why, for the default.
  """
  num_servers: int
  gpus_per_server: int
  source: str = "given"
  detail: str = ""

  def __post_init__(self):
    for name in ("num_servers", "gpus_per_server"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"Topology: {name} must be a positive int, got {v!r}")

  @property
  def num_gpus(self) -> int:
    return self.num_servers * self.gpus_per_server

  def __str__(self) -> str:
    return f"{self.num_servers}x{self.gpus_per_server}"

  @classmethod
  def parse(cls, spec: str) -> "Topology":
    """``"2x4"`` -> Topology(2, 4)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if not m:
      raise ValueError(f"topology must look like '2x4' (servers x GPUs per "
                       f"server), got {spec!r}")
    return cls(int(m.group(1)), int(m.group(2)))


def parse_topo_matrix(text: str) -> tuple[list[int], list[list[str]]]:
  """The GPU-to-GPU block of ``nvidia-smi topo -m`` output.

  Returns (GPU indices in row order, links[i][j] as printed: "X" on the
  diagonal, "NV#", "PIX", "PXB", "PHB", "NODE" or "SYS").  NIC rows and
  columns and the affinity columns are ignored.
  Raises ValueError when there is no GPU matrix in ``text``.
  """
  lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
  header = None
  rows = {}
  for ln in lines:
    toks = ln.split()
    if not toks:
      continue
    if header is None:
      # The header is indented (rows start with their label) and, with two
      # or more GPUs, lists GPU1 next.
      if _GPU.match(toks[0]) and (ln[:1].isspace() or (
          len(toks) > 1 and _GPU.match(toks[1]))):
        header = toks
      continue
    m = _GPU.match(toks[0])
    if m:
      rows[int(m.group(1))] = toks[1:]
    elif toks[0].startswith("Legend"):
      break
  if header is None:
    raise ValueError("no 'GPU0 GPU1 ...' header in nvidia-smi topo -m output")
  cols = []
  for tok in header:
    m = _GPU.match(tok)
    if not m:
      break
    cols.append(int(m.group(1)))
  if not cols or sorted(rows) != sorted(cols):
    raise ValueError(f"nvidia-smi topo -m: GPU rows {sorted(rows)} do not "
                     f"match the GPU columns {cols}")
  links = []
  for g in cols:
    vals = rows[g][:len(cols)]
    if len(vals) < len(cols):
      raise ValueError(f"nvidia-smi topo -m: row GPU{g} has {len(vals)} "
                       f"entries for {len(cols)} GPUs")
    links.append(vals)
  return cols, links


def nvlink_islands(links: Sequence[Sequence[str]]) -> list[list[int]]:
  """Connected components (positions, sorted) of the NVLink graph."""
  n = len(links)
  parent = list(range(n))

  def find(a):
    while parent[a] != a:
      parent[a] = parent[parent[a]]
      a = parent[a]
    return a

  for i in range(n):
    for j in range(n):
      if i != j and _NVLINK.match(links[i][j]):
        parent[find(i)] = find(j)
  comps: dict[int, list[int]] = {}
  for i in range(n):
    comps.setdefault(find(i), []).append(i)
  return sorted(comps.values())


def topology_from_links(links: Sequence[Sequence[str]]) -> Topology:
  """Topology of GPUs 0..P-1 (in rank order) from their link matrix."""
  p = len(links)
  if p == 0:
    raise ValueError("links: no GPUs")
  islands = nvlink_islands(links)
  if len(islands) == 1:
    return Topology(1, p, "nvlink" if p > 1 else "given")
  if all(len(c) == 1 for c in islands):
    return Topology(p, 1, "pcie")
  m = len(islands[0])
  if all(c == list(range(k * m, (k + 1) * m)) for k, c in enumerate(islands)):
    return Topology(p // m, m, "nvlink_islands")
  return Topology(1, p, "default",
                  f"NVLink islands {islands} are not equal blocks of "
                  "consecutive ranks")


def _run_nvidia_smi() -> str:
  proc = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                        text=True, timeout=30, check=True)
  return proc.stdout


def detect_topology(num_gpus: int | None = None, *,
                    gpu_indices: Sequence[int] | None = None,
                    text: str | None = None,
                    run: Callable[[], str] = _run_nvidia_smi) -> Topology:
  """Topology of the GPUs the all-to-all runs on, from ``nvidia-smi``.

  Args:
    num_gpus: ranks of the all-to-all (default: every GPU listed).
    gpu_indices: nvidia-smi index of rank 0, 1, ... (default 0..num_gpus-1;
      JAX numbers GPUs in nvidia-smi order under CUDA_DEVICE_ORDER=PCI_BUS_ID
      and CUDA_VISIBLE_DEVICES unset).
    text: ``nvidia-smi topo -m`` output to use instead of running it.
    run: returns that output (tests inject it).
  Returns:
    The topology; Topology(1, num_gpus, "default", why) when nvidia-smi is
    missing or fails, or its output cannot be used.
  """
  if num_gpus is not None and num_gpus < 1:
    raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
  if text is None:
    try:
      text = run()
    except (OSError, subprocess.SubprocessError) as err:
      if num_gpus is None:
        raise ValueError("num_gpus is needed when nvidia-smi cannot run "
                         f"({err})") from err
      return Topology(1, num_gpus, "default", f"nvidia-smi topo -m: {err}")
  try:
    cols, links = parse_topo_matrix(text)
  except ValueError as err:
    if num_gpus is None:
      raise
    return Topology(1, num_gpus, "default", str(err))
  if num_gpus is None:
    num_gpus = len(cols)
  idx = list(gpu_indices) if gpu_indices is not None else list(range(num_gpus))
  if len(idx) != num_gpus:
    raise ValueError(f"gpu_indices has {len(idx)} entries for {num_gpus} GPUs")
  missing = [i for i in idx if i not in cols]
  if missing:
    return Topology(1, num_gpus, "default",
                    f"GPUs {missing} are not in nvidia-smi topo -m ({cols})")
  pos = [cols.index(i) for i in idx]
  return topology_from_links([[links[a][b] for b in pos] for a in pos])
