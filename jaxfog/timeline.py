"""Joining the ranks' op timelines (``JAXFOG_TIMELINE``) into one trace.

Each rank writes its own Chrome trace / Perfetto JSON file, with timestamps
in microseconds since that rank started recording and, in ``otherData``, the
system clock at that instant (``origin_unix_ns``). :func:`merge` shifts every
rank onto the earliest rank's origin, so that spans of different ranks line
up as far as the ranks' system clocks agree (exactly on one machine; to NTP's
precision across machines). ``jaxfog timeline merge OUT IN...`` runs it.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from jaxfog.errors import TimelineError


def _paths(what: str, name: str, values: Any) -> list[str]:
    """A list of paths (str or os.PathLike); a lone path is a TypeError, not
    a sequence of one-letter names."""
    if isinstance(values, (str, bytes, os.PathLike)) or not hasattr(values, "__iter__"):
        raise TypeError(f"jaxfog.timeline.{what}: {name} must be a list of paths, got "
                        f"{type(values).__name__} {values!r}")
    values = list(values)
    for value in values:
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"jaxfog.timeline.{what}: {name} must be a list of paths, got "
                            f"an entry of type {type(value).__name__}: {value!r}")
    return [os.fspath(value) for value in values]


def expand(patterns: Iterable[str]) -> list[str]:
    """Input paths: each pattern as given, or its glob matches (sorted)."""
    patterns = _paths("expand", "patterns", patterns)
    paths: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern) and not os.path.exists(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise TimelineError(f"no file matches {pattern!r}")
            paths += matches
        else:
            paths.append(pattern)
    return paths


def _load(path: str) -> dict[str, Any]:
    try:
        trace = json.loads(Path(path).read_text())
    except OSError as err:
        raise TimelineError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise TimelineError(f"{path} is not JSON: {err}") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TimelineError(f"{path} is not a trace (no traceEvents list)")
    return trace


def _rank(trace: dict[str, Any], index: int) -> int:
    other = trace.get("otherData") or {}
    if isinstance(other.get("rank"), int):
        return other["rank"]
    for event in trace["traceEvents"]:  # not written by jaxfog: trust its pids
        if isinstance(event.get("pid"), int):
            return event["pid"]
    return index


def merge(paths: Sequence[str]) -> dict[str, Any]:
    """One trace of the timelines in ``paths``: one process per rank ("rank r")."""
    paths = _paths("merge", "paths", paths)
    if not paths:
        raise TimelineError("no input files")
    traces = [_load(path) for path in paths]
    ranks = [_rank(trace, i) for i, trace in enumerate(traces)]
    seen: dict[int, str] = {}
    for rank, path in zip(ranks, paths):
        if rank in seen:
            raise TimelineError(f"{seen[rank]} and {path} are both rank {rank}")
        seen[rank] = path
    origins = [(trace.get("otherData") or {}).get("origin_unix_ns") for trace in traces]
    known = [o for o in origins if isinstance(o, int)]
    base = min(known) if known else 0
    events: list[dict[str, Any]] = []
    for rank, trace, origin in sorted(zip(ranks, traces, origins), key=lambda t: t[0]):
        shift_us = (origin - base) / 1000 if isinstance(origin, int) else 0.0
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for event in trace["traceEvents"]:
            if event.get("ph") == "M" and event.get("name") in ("process_name",
                                                                 "process_sort_index"):
                continue  # replaced above
            event = {**event, "pid": rank}
            if isinstance(event.get("ts"), (int, float)):
                event["ts"] = round(event["ts"] + shift_us, 3)
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"jaxfog_timeline": 1, "ranks": sorted(ranks),
                          "origin_unix_ns": base, "merged_from": list(paths)}}


def merge_files(out: str, patterns: Sequence[str]) -> dict[str, Any]:
    """Merges the files ``patterns`` name (globs allowed) into ``out``."""
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError("jaxfog.timeline.merge_files: out must be a path (a str or "
                        f"os.PathLike), got {type(out).__name__} {out!r}")
    trace = merge(expand(patterns))
    try:
        Path(out).write_text(json.dumps(trace))
    except OSError as err:
        raise TimelineError(f"cannot write {out}: {err.strerror or err}") from None
    return trace


__all__ = ["expand", "merge", "merge_files"]
