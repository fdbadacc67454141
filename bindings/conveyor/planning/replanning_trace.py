"""Re-planning's timeline across steps, beside the step trace: process 0's training steps on
one track and the planner thread's evaluations on another, so that a window's planning is
seen running while the next steps train; each decision heard and each switch an instant
event. The step trace (`trace=`) holds one step's actions; this one spans the run.

Written as Chrome JSON trace events (ui.perfetto.dev, chrome://tracing) to
`<trace's stem>.replanning.json` on process 0, rewritten at each window's boundary and at
exit. It keeps the last `KEPT` events, so a long run's memory and file stay bounded."""
from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time
from pathlib import Path

__all__ = ["ReplanningTimeline", "timeline_path", "window_line"]

KEPT = 4000
STEPS, PLANNER = 1, 2  # the tracks (Chrome trace "threads" of process 0)
TRACK_NAMES = {STEPS: "training steps (the caller's thread)", PLANNER: "re-planning (the planner thread)"}


def timeline_path(trace: str | os.PathLike) -> Path:
    """run.pftrace -> run.replanning.json; run.json -> run.replanning.json."""
    path = Path(trace)
    return path.with_name(path.stem + ".replanning.json")


class ReplanningTimeline:
    """Spans and instants on the tracks above, in microseconds since it was made; safe to
    add to from the planner thread."""

    def __init__(self, path: str | os.PathLike, origin: float | None = None):
        self.path = Path(path)
        self._origin = time.perf_counter() if origin is None else origin
        self._events: collections.deque = collections.deque(maxlen=KEPT)
        self._lock = threading.Lock()
        atexit.register(self._write_at_exit)  # the steps after the last window's boundary too

    def _write_at_exit(self) -> None:
        try:
            self.write()
        except OSError:
            pass  # the folder went away meanwhile: what the boundaries wrote stays

    def _us(self, t: float) -> float:
        return (t - self._origin) * 1e6

    def span(self, track: int, name: str, start: float, end: float, **args) -> None:
        """A slice from `start` to `end` (time.perf_counter() seconds)."""
        event = {"ph": "X", "pid": 0, "tid": track, "name": name, "ts": self._us(start),
                 "dur": max(0.0, (end - start) * 1e6), "args": args}
        with self._lock:
            self._events.append(event)

    def instant(self, track: int, name: str, at: float, **args) -> None:
        event = {"ph": "i", "s": "t", "pid": 0, "tid": track, "name": name, "ts": self._us(at), "args": args}
        with self._lock:
            self._events.append(event)

    def write(self) -> None:
        """The events kept so far, as one JSON document (written aside, then renamed: a reader
        never sees half a file)."""
        meta = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "conveyor process 0"}}]
        meta += [{"ph": "M", "pid": 0, "tid": t, "name": "thread_name", "args": {"name": n}}
                 for t, n in TRACK_NAMES.items()]
        with self._lock:
            events = list(self._events)
        aside = self.path.with_name(self.path.name + ".partial")
        aside.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
        os.replace(aside, self.path)


def window_line(decision: dict) -> str:
    """One evaluation's decision on a line, for the `conveyor` logger at DEBUG (process 0,
    every window): its reason, the devices' speeds and ceilings, and what the planner did."""
    f = decision["factors"]
    search = ("searched the running plan's shape" if decision["shape_only"] else "searched every shape") \
        if decision["searched"] else "priced the last search's plan again" + (
            " (a search was due but spaced out)" if decision["search_deferred"] else "")
    ceilings = [c for c in decision.get("speed_ceiling", []) if c > 0]
    return (f"{decision['reason']}; speeds x[" + ", ".join(f"{x:.2f}" for x in f["speed"]) + "]"
            + (" (ceilings x[" + ", ".join(f"{x:.2f}" if x > 0 else "none" for x in decision["speed_ceiling"])
               + "])" if ceilings else "")
            + f"; {search}; gain {decision['gain_s'] * 1e3:.2f} ms of {decision['measured_step_s'] * 1e3:.2f}, asked "
            f"{decision['gain_asked'] * 100:.1f}%; confirmations {decision['confirmations']}"
            + ("; a census owed" if decision.get("census_owed") else ""))
