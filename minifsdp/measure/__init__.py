"""Chapters 2, 7, 12 and 13: the one place minifsdp measures -- the memory meter, the analytic model, timelines,
the simulator (simulate.py: the wrappers as rank 0 of N, on meta tensors under a fake process group; device_lag.py)
and the step-time model (step_time/).

It observes the algorithms (through minifsdp/events.py and the communication layer's counter); the
algorithms never import it.
"""

from minifsdp.measure import analytic
from minifsdp.measure.meter import MemoryMeter
from minifsdp.measure.timeline import Timeline

__all__ = ["MemoryMeter", "Timeline", "analytic"]
