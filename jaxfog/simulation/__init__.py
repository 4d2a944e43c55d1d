"""One program, any scale: the same per-agent code for n agents in one process.

:func:`simulate`, :class:`Delays`, :class:`Agents` and :func:`reset_clocks` live
in :mod:`jaxfog.simulation.agents` (the front end); the backend the ops run on
while a simulation traces is :mod:`jaxfog.simulation._backend`, with its windows
and simulated clocks beside it.
"""

from jaxfog.simulation.agents import (AGENT_AXIS, INNER_AXIS, Agents, Delays, reset_clocks,
                                      simulate)

__all__ = ["AGENT_AXIS", "INNER_AXIS", "Agents", "Delays", "reset_clocks", "simulate"]
