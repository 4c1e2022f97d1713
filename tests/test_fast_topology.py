"""Topology: given, or parsed from `nvidia-smi topo -m` (samples below)."""

import subprocess

import pytest

from moe_jax.fast import topology as tp

# 8 x H100 SXM (DGX H100), as nvidia-smi prints it to a terminal (colour
# codes around the header).
NVLINK_8 = """\
\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPXB\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tPXB\t56-111,168-223\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\t56-111,168-223\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\t56-111,168-223\t1\t\tN/A
NIC0\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tSYS
NIC1\tSYS\tSYS\tSYS\tSYS\tPXB\tSYS\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""

PCIE_4 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tPIX\tPHB\tSYS\t0-15\t0\t\tN/A
GPU1\tPIX\t X \tPHB\tSYS\t0-15\t0\t\tN/A
GPU2\tPHB\tPHB\t X \tSYS\t0-15\t0\t\tN/A
GPU3\tSYS\tSYS\tSYS\t X \t16-31\t1\t\tN/A

Legend:

  X    = Self
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# A100 PCIe cards with NVLink bridges on pairs (0-1, 2-3).
BRIDGED_PAIRS = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tSYS\tSYS\t0-31\t0
GPU1\tNV12\t X \tSYS\tSYS\t0-31\t0
GPU2\tSYS\tSYS\t X \tNV12\t32-63\t1
GPU3\tSYS\tSYS\tNV12\t X \t32-63\t1
"""

# Bridged 0-2 and 1-3: islands are not blocks of consecutive ranks.
CROSSED_PAIRS = BRIDGED_PAIRS.replace("NV12", "@").replace(
    "GPU0\t X \t@\tSYS", "GPU0\t X \tSYS\tNV4").replace(
    "GPU1\t@\t X \tSYS\tSYS", "GPU1\tSYS\t X \tSYS\tNV4").replace(
    "GPU2\tSYS\tSYS\t X \t@", "GPU2\tNV4\tSYS\t X \tSYS").replace(
    "GPU3\tSYS\tSYS\t@\t X ", "GPU3\tSYS\tNV4\tSYS\t X ")

ONE_GPU = """\
\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \t0-7\t0\t\tN/A
"""


def test_parse_nvlink_matrix():
  cols, links = tp.parse_topo_matrix(NVLINK_8)
  assert cols == list(range(8))
  assert links[0][0] == "X" and links[0][1] == "NV18" and links[7][6] == "NV18"
  assert all(len(r) == 8 for r in links)  # NIC and affinity columns dropped


def test_parse_pcie_matrix():
  cols, links = tp.parse_topo_matrix(PCIE_4)
  assert cols == [0, 1, 2, 3]
  assert links[0] == ["X", "PIX", "PHB", "SYS"]
  assert links[3][2] == "SYS"
  assert set(v for r in links for v in r) <= {"X", *tp.PCIE_LINKS}


def test_detect_nvlink_host_is_one_server():
  topo = tp.detect_topology(text=NVLINK_8)
  assert (topo.num_servers, topo.gpus_per_server, topo.source) == (1, 8, "nvlink")
  topo = tp.detect_topology(4, text=NVLINK_8)
  assert (topo.num_servers, topo.gpus_per_server) == (1, 4)


def test_detect_pcie_host_is_one_gpu_per_server():
  topo = tp.detect_topology(text=PCIE_4)
  assert (topo.num_servers, topo.gpus_per_server, topo.source) == (4, 1, "pcie")


def test_detect_nvlink_islands():
  topo = tp.detect_topology(text=BRIDGED_PAIRS)
  assert (topo.num_servers, topo.gpus_per_server, topo.source) == (
      2, 2, "nvlink_islands")
  # Ranks 0, 1 on GPUs 0 and 2 (one per island): no NVLink between them.
  topo = tp.detect_topology(2, gpu_indices=[0, 2], text=BRIDGED_PAIRS)
  assert (topo.num_servers, topo.gpus_per_server) == (2, 1)
  topo = tp.detect_topology(2, gpu_indices=[2, 3], text=BRIDGED_PAIRS)
  assert (topo.num_servers, topo.gpus_per_server) == (1, 2)


def test_islands_that_are_not_rank_blocks_fall_back():
  _, links = tp.parse_topo_matrix(CROSSED_PAIRS)
  assert tp.nvlink_islands(links) == [[0, 2], [1, 3]]
  topo = tp.detect_topology(text=CROSSED_PAIRS)
  assert (topo.num_servers, topo.gpus_per_server, topo.source) == (1, 4, "default")
  assert "not equal blocks" in topo.detail
  # Reordering the ranks makes the islands blocks.
  topo = tp.detect_topology(4, gpu_indices=[0, 2, 1, 3], text=CROSSED_PAIRS)
  assert (topo.num_servers, topo.gpus_per_server) == (2, 2)


def test_one_gpu():
  topo = tp.detect_topology(text=ONE_GPU)
  assert (topo.num_servers, topo.gpus_per_server) == (1, 1)


def test_missing_nvidia_smi_falls_back():
  def absent():
    raise FileNotFoundError("nvidia-smi")

  def failing():
    raise subprocess.CalledProcessError(9, ["nvidia-smi"])

  for run in (absent, failing):
    topo = tp.detect_topology(4, run=run)
    assert (topo.num_servers, topo.gpus_per_server, topo.source) == (1, 4, "default")
    assert "nvidia-smi" in topo.detail
  with pytest.raises(ValueError, match="num_gpus is needed"):
    tp.detect_topology(run=absent)
  topo = tp.detect_topology(4, text="No devices were found")
  assert topo.source == "default" and "header" in topo.detail
  topo = tp.detect_topology(4, gpu_indices=[0, 1, 2, 9], text=PCIE_4)
  assert topo.source == "default" and "[9]" in topo.detail


def test_topology_values():
  assert tp.Topology.parse("2x4") == tp.Topology(2, 4)
  assert str(tp.Topology(2, 4)) == "2x4" and tp.Topology(2, 4).num_gpus == 8
  with pytest.raises(ValueError, match="look like"):
    tp.Topology.parse("2-4")
  with pytest.raises(ValueError, match="num_servers"):
    tp.Topology(0, 4)
  with pytest.raises(ValueError, match="gpus_per_server"):
    tp.Topology(2, 1.5)
  with pytest.raises(ValueError, match="do not match"):
    tp.parse_topo_matrix(PCIE_4.replace("GPU3\tSYS", "GPU7\tSYS"))
