"""Chapters 2 and 7: the one place minifsdp measures -- the memory meter, the analytic model, timelines.

It observes the algorithms (through minifsdp/events.py and the communication layer's counter); the
algorithms never import it.
"""

from minifsdp.measure import analytic
from minifsdp.measure.meter import MemoryMeter
from minifsdp.measure.timeline import Timeline

__all__ = ["MemoryMeter", "Timeline", "analytic"]
