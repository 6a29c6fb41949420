"""Chapter 13: a collective's time, the alpha-beta way.

A collective over n ranks takes alpha per step of its algorithm plus the bytes one rank puts on the wire over the
bandwidth. The bytes are the ring-equivalent bytes minifsdp's counter reports (comm.ring_bytes: 2S(n-1)/n for an
all-reduce of S bytes, S(n-1)/n for an all-gather or a reduce-scatter), so the bandwidth is NCCL's "bus
bandwidth". A ring takes 2(n-1) steps for an all-reduce and n-1 for the others; a (pipelined) tree all-reduce
takes 2*log2(n) steps but moves 2S per rank. One kind of link here; a group laid out over the NVLink of a node and
the network between nodes is cluster.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minifsdp.distributed.comm import ring_bytes


@dataclass(frozen=True)
class Link:
    """One kind of wire, as the alpha-beta model sees it."""
    alpha: float  # seconds per step (hop) of a ring
    busbw: float  # ring-equivalent bytes one rank moves per second (NCCL's bus bandwidth)
    tree_alpha: float | None = None  # seconds per step of a tree, if not alpha

    @property
    def tree_step(self) -> float:
        return self.alpha if self.tree_alpha is None else self.tree_alpha


# --8<-- [start:alpha_beta]
# --8<-- [start:algorithm_steps]
def algorithm_steps(kind: str, n: int, algorithm: str = "ring") -> int:
    """How many steps (each paying alpha once) a collective over n ranks
    takes."""
    if n <= 1:
        return 0
    # BEGIN EXERCISE 13.1: a ring's steps (an all-reduce is two rings); a tree's
    if algorithm == "ring":
        return 2 * (n - 1) if kind == "all_reduce" else n - 1
    if algorithm == "tree":
        if kind != "all_reduce":
            raise ValueError("the tree algorithm is an all-reduce's (as in "
                             "NCCL): all-gather and reduce-scatter are rings")
        # up the tree (reduce), then down it (broadcast)
        return 2 * math.ceil(math.log2(n))
    # END EXERCISE
    raise ValueError(f"algorithm must be 'ring' or 'tree', not {algorithm!r}")
# --8<-- [end:algorithm_steps]


def wire_bytes(kind: str, nbytes: float, n: int,
               algorithm: str = "ring") -> float:
    """Bytes one rank sends: a ring's are the counter's ring_bytes; a pipelined
    tree all-reduce sends the whole buffer up and the whole result down, 2S,
    whatever n is."""
    if n <= 1:
        return 0.0
    return ring_bytes(kind, nbytes, n) if algorithm == "ring" else 2.0 * nbytes


# --8<-- [start:alpha_beta_fn]
def alpha_beta(kind: str, nbytes: float, n: int, link: Link,
               algorithm: str = "ring") -> float:
    """Seconds for a collective over `nbytes` (the full, unsharded size) on n
    ranks of one kind of link: alpha * steps + bytes on the wire / bandwidth."""
    if algorithm == "auto":
        if kind == "all_reduce":
            return min(alpha_beta(kind, nbytes, n, link, a)
                       for a in ("ring", "tree"))
        return alpha_beta(kind, nbytes, n, link, "ring")
    step = link.alpha if algorithm == "ring" else link.tree_step
    return (step * algorithm_steps(kind, n, algorithm)
            + wire_bytes(kind, nbytes, n, algorithm) / link.busbw)
# --8<-- [end:alpha_beta_fn]


def ring_tree_crossover(n: int, link: Link) -> float:
    """The all-reduce size (bytes) below which a tree beats a ring on n ranks
    of `link`, with L = log2(n):
    2(n-1)a + 2S(n-1)/(nB) = 2L t + 2S/B  gives  S = n B ((n-1)a - L t)
    (a, t: a ring's and a tree's step)."""
    L = math.ceil(math.log2(n))
    return max(0.0,
               n * link.busbw * ((n - 1) * link.alpha - L * link.tree_step))
# --8<-- [end:alpha_beta]


