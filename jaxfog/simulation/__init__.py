"""One program, any scale: the same per-agent code for n agents in one process.

:func:`simulate`, :class:`Delays`, :class:`Agents` and :func:`reset_clocks` live
in :mod:`jaxfog.simulation.agents` (the front end), loaded on first use: the
ops' rules on simulated agents import this package's lower modules
(``_mixing``, ``_clock``, ``_windows``), below the front end. The backend the
ops run on while a simulation traces is :mod:`jaxfog.simulation._backend`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_NAMES = ("AGENT_AXIS", "INNER_AXIS", "Agents", "Delays", "reset_clocks", "simulate")

if TYPE_CHECKING:  # the names as type checkers see them (at run time: __getattr__)
    from jaxfog.simulation.agents import (AGENT_AXIS, INNER_AXIS, Agents, Delays, reset_clocks,
                                          simulate)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.agents"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))


__all__ = list(_NAMES)
