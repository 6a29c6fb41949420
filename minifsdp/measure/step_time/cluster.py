"""Chapter 13: the hardware -- GPUs, NVLink within a node, one NIC per GPU between nodes -- and a collective on a
process group laid out over them.

Where a group spans nodes, each step that crosses a node boundary costs the network's alpha, the others NVLink's,
and the bandwidth is what the node's NICs give the group's ranks (`Cluster.busbw`). The numbers of the hardware,
and where each comes from, are next to each constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minifsdp.measure.step_time.alpha_beta import Link, algorithm_steps, wire_bytes


# and 9.6 us over the network; a tree's, 28 and 50 us ("the latency [of] a 256kB chunk").
NCCL_ALPHA_NVLINK, NCCL_TREE_ALPHA_NVLINK = 3.4e-6, 28e-6
NCCL_ALPHA_NET, NCCL_TREE_ALPHA_NET = 9.6e-6, 50e-6


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (the vendor's datasheet)
    hbm_bw: float      # bytes/s of device memory (the optimizer step reads and writes it)
    nvlink: Link       # within a node
    efficiency: float  # the fraction of peak a transformer's compute reaches: calibrated, see PUBLISHED
    note: str = ""


# A100 SXM: 312 TFLOP/s bf16 dense, 2.04 TB/s HBM2e (80 GB), NVLink 3 at 300 GB/s per direction. NCCL's tuning
# model caps an A100's bus bandwidth at 235 GB/s ("if (compCap80) busBw = std::min(busBw, 235.0f)", the
# file above): the bus bandwidth used here.
# H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction. No H100 cap in that
# file; we take the same fraction of the link NCCL reaches on an A100 (235/300, about 0.78): 0.78 x 450 = 351 GB/s. (Published
# all-reduce figures of 460-480 GB/s on 8 H100s exceed the 450 GB/s link, so they come from reductions in the
# NVSwitch, NVLS, which rings of all-gathers and reduce-scatters do not get.)
# `efficiency` is fitted to one published run per GPU (the rows marked "calibration" in PUBLISHED) and then
# held fixed for every other prediction; `calibrate_efficiency` recomputes it.
A100 = GPU("A100", 312e12, 2.04e12, Link(NCCL_ALPHA_NVLINK, 235e9, NCCL_TREE_ALPHA_NVLINK), efficiency=0.6564,
           note="A100 SXM 80 GB")
H100 = GPU("H100", 989e12, 3.35e12, Link(NCCL_ALPHA_NVLINK, 0.78 * 450e9, NCCL_TREE_ALPHA_NVLINK),
           efficiency=0.4833,
           note="H100 SXM 80 GB")
GPUS = {"h100": H100, "a100": A100}


def nic(gbit_per_s: float, efficiency: float = 0.9) -> Link:
    """One network port per GPU at `gbit_per_s` line rate, of which `efficiency` is reached (an assumption:
    RDMA reaches ~90% of the line rate for large messages)."""
    return Link(NCCL_ALPHA_NET, efficiency * gbit_per_s * 1e9 / 8, NCCL_TREE_ALPHA_NET)


IB_400G = nic(400)  # H100 clusters: one 400 Gb/s port (NDR InfiniBand or RoCE) per GPU
IB_200G = nic(200)  # A100 clusters: one 200 Gb/s port (HDR) per GPU, 1,600 Gb/s per node


@dataclass(frozen=True)
class Group:
    """A process group laid out on the cluster: `size` ranks, `per_node` of them on each node it spans."""
    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.size / self.per_node))


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    nodes: int = 1
    gpus_per_node: int = 8
    nic: Link = IB_400G  # per GPU
    nics_per_node: int = 8
    spread_rings: bool = True  # False: a ring across nodes gets one NIC's bandwidth (the pessimistic model)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    # --8<-- [start:hierarchy]
    def busbw(self, group: Group) -> float:
        """The bus bandwidth a group's ranks get. Within a node: NVLink's. Across
        nodes, a ring enters and leaves each node once per channel, and NCCL runs
        one channel per NIC: with p of the group's ranks on a node, each owning a
        NIC, the node's p NICs carry the group's traffic side by side, so a rank
        moves min(NVLink, p * NIC). One rank per node (HSDP's replicas): one NIC's
        bandwidth. With spread_rings=False, every group that spans nodes gets one
        NIC's bandwidth: as if each rank sent all its bytes through its own NIC."""
        if group.nodes == 1:
            return self.gpu.nvlink.busbw
        rails = min(group.per_node, self.nics_per_node) if self.spread_rings else 1
        return min(self.gpu.nvlink.busbw, rails * self.nic.busbw)

    def collective(self, kind: str, nbytes: float, group: Group,
                   algorithm: str = "auto") -> float:
        """alpha-beta on this cluster: the steps that cross nodes pay the network's
        alpha, the others NVLink's (NCCL's tuning model does the same); the bytes go
        at `busbw(group)`."""
        n = group.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        if algorithm == "auto":
            algos = ("ring", "tree") if kind == "all_reduce" else ("ring",)
            return min(self.collective(kind, nbytes, group, a) for a in algos)
        a_in, a_net, k = self.gpu.nvlink.alpha, self.nic.alpha, group.nodes
        if algorithm == "ring":
            steps = algorithm_steps(kind, n, "ring")
            inter = (2 * (k - 1) if kind == "all_reduce" else k - 1)
            latency = (steps - inter) * a_in + inter * a_net
        else:  # a tree within each node and one across the nodes, up and down
            algorithm_steps(kind, n, "tree")  # (checks the kind)
            depth_in_node = math.ceil(math.log2(max(1, min(n, group.per_node))))
            latency = 2 * (depth_in_node * self.gpu.nvlink.tree_step
                           + math.ceil(math.log2(k)) * self.nic.tree_step)
        return latency + wire_bytes(kind, nbytes, n, algorithm) / self.busbw(group)
    # --8<-- [end:hierarchy]
