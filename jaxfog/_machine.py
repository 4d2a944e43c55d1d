"""What machine a run was on, for the result tables of the benchmarks and
examples (``from jaxfog import _machine``)."""

from __future__ import annotations

import os
import platform


def cpu() -> str:
    """The CPU model, core count and OS, e.g. 'AMD EPYC ..., 2 cores, Linux 6.1'."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"
