"""Re-planning's messages between the job's processes, point to point and never collective,
so that no step waits on another process for them (docs/design.md, "Re-planning"):

- at each window's boundary, every process other than 0 sends process 0 its figures of the
  window (`WindowFigures`): sent without waiting, read by process 0's planner thread;
- at each window's boundary, process 0 sends every other process the decision it heard
  there (or None), which each applies `DECIDED_AFTER` steps later, where process 0 applies
  it too: by then the message has long arrived, since no process finishes a step without
  process 0's part in it, and process 0 sent the decision before its part.

Messages under one (peer, tag) arrive in the order they were sent (transport/transport.h);
each carries its window's number, so one read out of turn is an error naming both.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from .. import _C
from ..errors import ExecutionError

# Tags: beside the hand-over's (runtime/model_state.cc, kHandOverTag: bits 44-46 with an entry
# number far below bit 42) and the optimizer state's (plan_switch.py: bit 43), with bit 42.
FIGURES_TAG = (7 << 44) | (1 << 42)
DECISION_TAG = FIGURES_TAG | 1

DECIDED_AFTER = 1  # steps from the boundary where process 0 sends a decision to the one where all apply it
PLANS = ("candidate", "running")  # a decision's plans (_C.Plan): on the wire, their documents


@dataclass
class WindowFigures:
    """One process's figures of one window: its live profile's per-stage figures (for the
    replicas it runs), its mean step (the pipeline's own), the matrix products per second its
    device's probe ran at the window's end (device_probe.py: the running plan's first window,
    or its device idle; 0: not probed), and its mean step as its caller saw it with the
    optimizer's part of it (step_clock.py; 0: not measured)."""
    window: int
    stages: list
    step_s: float
    probe_rate: float = 0.0
    wall_s: float = 0.0
    optimizer_s: float = 0.0


# A window's figures per stage (the live profile's report), in seconds; replica_compute_s a list.
FIGURES = ("forward_s", "backward_s", "backward_weight_s", "replica_compute_s", "send_s", "allreduce_s", "across_s",
           "waiting_s")


def _seconds(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def figures_problem(got, window: int) -> str | None:
    """What is wrong with `got` as a peer's figures of `window` (None: nothing)."""
    if not (isinstance(got, list) and len(got) == 6 and got[0] == window):
        return (f"received {str(got)[:80]!r}, not window {window}'s figures; the processes disagree on the windows "
                "they ran (restart the job)")
    _, stages, step_s, probe_rate, wall_s, optimizer_s = got

    def stage_ok(s) -> bool:
        return isinstance(s, dict) and all(
            isinstance(s.get(k), list) and all(map(_seconds, s[k])) if k == "replica_compute_s" else _seconds(s.get(k))
            for k in FIGURES)

    if not (all(map(_seconds, (step_s, probe_rate, wall_s, optimizer_s))) and isinstance(stages, list)
            and all(map(stage_ok, stages))):
        return (f"received {str(got)[:120]!r}, not a step time, per stage the figures {', '.join(FIGURES)} in "
                "seconds, a probe's rate, and the step as the caller saw it with its optimizer's part; the "
                "processes run different versions of conveyor, or a peer is not conveyor")
    return None


def _as_tensor(value) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _read(group, tag: int, what: str, peer: int):
    data = group.recv(peer, tag, what)[0]
    try:
        return json.loads(data.numpy().tobytes())
    except ValueError as e:
        raise ExecutionError(f"{what}: process {peer} sent what is not JSON ({e}); the processes run different "
                             "versions of conveyor, or a peer is not conveyor") from None


class WindowMessages:
    """This process's side of re-planning's messages (`group`: the job's ProcessGroup)."""

    def __init__(self, group):
        self.group = group
        self.sends = _C.SendsInFlight(group)
        self.read = 0  # process 0: the last window whose figures it has read

    def send_figures(self, figures: WindowFigures) -> None:
        """A process other than 0: its figures of the window at this boundary, to process 0."""
        self.sends.send(0, FIGURES_TAG, [_as_tensor([figures.window, figures.stages, figures.step_s,
                                                     figures.probe_rate, figures.wall_s, figures.optimizer_s])],
                        f"the figures of re-planning window {figures.window} to process 0")

    def unread(self, last: int) -> range:
        """Process 0: the windows up to `last` (the latest boundary's; windows count from 1)
        whose figures it has not read, marked read (the caller reads them, in order, with
        read_figures)."""
        windows = range(self.read + 1, last + 1)
        self.read = last
        return windows

    def read_figures(self, peer: int, window: int) -> WindowFigures:
        """Process 0 (any thread): `peer`'s figures of `window`, waiting for them within the
        job's timeout."""
        what = f"process {peer}'s figures of re-planning window {window}"
        got = _read(self.group, FIGURES_TAG, what, peer)
        problem = figures_problem(got, window)
        if problem is not None:
            raise ExecutionError(f"{what}: {problem}")
        return WindowFigures(*got)

    def send_decision(self, decision: dict | None, window: int, next_boundary: int) -> None:
        """Process 0: the decision heard at `window`'s boundary (None: none), and the step
        after which the next window ends, to every other process."""
        body = None if decision is None else {**decision, **{k: decision[k].to_json() for k in PLANS}}
        payload = _as_tensor([window, body, next_boundary])
        for peer in range(1, self.group.world_size):
            self.sends.send(peer, DECISION_TAG, [payload], f"re-planning window {window}'s decision to process {peer}")

    def read_decision(self, window: int, steps: int) -> tuple[dict | None, int]:
        """A process other than 0, `steps` into its pipeline: the decision process 0 sent at
        `window`'s boundary, and the step after which the next window ends (later than now)."""
        what = f"process 0's re-planning decision at window {window}"
        got = _read(self.group, DECISION_TAG, what, 0)
        if not (isinstance(got, list) and len(got) == 3 and got[0] == window and isinstance(got[2], int)
                and got[2] > steps):
            raise ExecutionError(f"{what}: received {str(got)[:80]!r}, not that window's decision; the processes "
                                 "disagree on the windows they ran (restart the job)")
        body = got[1]
        return (None if body is None else {**body, **{k: _C.read_plan(body[k]) for k in PLANS}}), got[2]
