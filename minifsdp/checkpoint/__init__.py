"""Chapter 10: checkpoints for every strategy, through PyTorch's distributed checkpoint (DCP).

    flat_chunks.py  the idea: a flat shard saved as pieces (boxes) of the original parameters, no gather
    state.py        what each strategy holds on this rank, under the unwrapped model's names
    disk.py         save() / load(): atomic, checked before anything is written, any world size to any other
"""

from minifsdp.checkpoint.disk import load, resolve, save
from minifsdp.checkpoint.state import model_state, optimizer_state, param_groups, strategy_of

__all__ = ["load", "model_state", "optimizer_state", "param_groups", "resolve", "save", "strategy_of"]
