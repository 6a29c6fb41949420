"""Chapter 6: the FSDP runtime -- what a unit is doing, as the hooks around its compute see it."""

from __future__ import annotations

import enum


# --8<-- [start:training_state]
class TrainingState(enum.Enum):
    """Where a unit is in the step. Both runtimes (chapter 6's units and
    chapter 11's fully_shard modules) move through the same four states."""
    IDLE = "idle"                    # between steps, or not yet reached
    FORWARD = "forward"              # inside its forward
    PRE_BACKWARD = "pre-backward"    # backward has reached it: unsharded again
    POST_BACKWARD = "post-backward"  # its gradient is complete and on its way
# --8<-- [end:training_state]
