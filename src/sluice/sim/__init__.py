"""Simulation as a product feature: a scaled-clock ``SimEngine`` (and a virtual event-loop clock)
that benchmarks and the planner use to drive the real rollout, LLMProxy and controller code.

Not here: small deterministic fakes for unit tests (``tests/fakes.py``).
"""

from sluice.sim.clock import VirtualClockLoop, run_virtual
from sluice.sim.engine import LengthModel, SimEngine, SimEngineConfig

__all__ = ["LengthModel", "SimEngine", "SimEngineConfig", "VirtualClockLoop", "run_virtual"]
