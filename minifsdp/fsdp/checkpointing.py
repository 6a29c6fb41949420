"""Chapter 9: activation checkpointing, and how it composes with FSDP.

checkpoint_module(m) makes m's forward keep none of its intermediate activations: backward recomputes
them from m's input, trading compute (one more forward of m) for memory (m's activations).

With FSDP, the order of the two wrappers matters:

    FSDP(checkpoint(block)):  the unit's forward is the checkpointed one. The recomputation happens inside
                              the unit's backward, while its parameters are unsharded for it anyway: no
                              extra communication. (Apply checkpoint_module to the blocks, then FSDP.)
    checkpoint(FSDP(block)):  the recomputation runs the *unit's* forward again. Non-reentrant checkpoint
                              (the default) runs it after the unit's pre-backward hook has all-gathered its
                              parameters, and FSDP keeps them (it sees its backward has started): no extra
                              communication either. Reentrant checkpoint runs the first forward under
                              no_grad, so FSDP frees the parameters and sets no backward hook; the
                              recomputation all-gathers them again, frees them, and backward all-gathers a
                              third time: one more all-gather per unit and step.
"""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


# --8<-- [start:checkpoint_module]
def checkpoint_module(module: nn.Module,
                      use_reentrant: bool = False) -> nn.Module:
    """Make `module`'s forward checkpointed, in place (no wrapper module:
    parameter names do not change)."""
    forward = module.forward
    module.forward = functools.partial(checkpoint, forward,
                                       use_reentrant=use_reentrant)
    return module
# --8<-- [end:checkpoint_module]
