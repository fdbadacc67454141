"""conveyor.Module.profile_report(): how the running pipeline compares with its plan.

Every training step's measured actions reach the pipeline's PartitionerActor, which reports
per stage the measured forward, backward, weight-gradient, transfer and allreduce times
against the planner's prediction, and the step time; the Module adds each device's memory
and re-planning's last decision. Evaluations are not in it. After an evaluation the capture
in use is the eval mode's, which has run no training step: the report is then the one of
the capture that trained last, as it stood when the evaluation took over (CaptureSet keeps it)."""
from __future__ import annotations

import copy

from .memory import memory_rows, memory_table

__all__ = ["LiveProfile", "live_profile"]


class LiveProfile:
    """A live profile (Module.profile_report): `steps`, `measured_step_s`, `predicted_step_s`
    (0 without a plan) and `stages`, a dict per stage of measured and predicted seconds and
    its `compute_ratio` (measured over predicted F + B + W; above 1: slower than planned).
    Of a stage's gradient sums per step, `allreduce_s` is the time summing within this
    process and moving bytes across processes, `across_s` the part moving across processes,
    and `waiting_s`, not in either, the time after the stage's compute here ended that they
    still waited for the stage's last process to contribute (that process's compute);
    `memory`, a dict per device of this process with its predicted and measured peak bytes
    (bindings/conveyor/memory.py);
    `replan`: the re-planning partitioner's last decision (None before the first window, or
    without re-planning); `replan_cost`: what re-planning took of the steps, a move left out
    (Replanning.cost: the training thread's time at window boundaries, the planner thread's
    CPU, and the steps' wall time; None without re-planning). After a window the prediction
    is the running plan priced on the corrected inputs, and the steps counted are those since;
    until they outnumber the last whole window's, the report is that window's."""

    def __init__(self, report: dict):
        self.replan = report.get("replan")
        self.replan_cost = report.get("replan_cost")
        self.steps = report["steps"]
        self.measured_step_s = report["measured_step_s"]
        self.predicted_step_s = report["predicted_step_s"]
        self.stages = report["stages"]
        self.memory = report.get("memory", [])
        self._table = report["table"]

    def __str__(self) -> str:
        return self._table

    __repr__ = __str__


def live_profile(state, optimizer, switches: list) -> LiveProfile:
    """The live profile of a capture (a CaptureState, its pipeline built) trained by
    `optimizer`; `switches`: the Module's switches of plan so far."""
    report = state.pipeline.profile_report()
    # Each window's evaluation prices the running plan anew and starts the count again: a
    # report taken a step or two later is of those steps alone, and the last whole window's
    # says more (a user's BERT read "the last 1 step measured").
    whole = state.replanning.window_report if state.replanning is not None else None
    in_window = report["steps"]
    kept = whole is not None and whole["steps"] > in_window
    if kept:
        report = dict(whole)
    report["memory"] = memory_rows(state, optimizer)
    report["table"] += memory_table(report["memory"])
    if state.replanning is not None:
        first, _, rest = report["table"].partition("\n")
        since = f"; these are the last whole window's, {in_window} run since" if kept else ""
        report["table"] = (first + f"\n(re-planning starts the count again at each window's end: "
                           f"{state.trained_steps} steps trained in all{since})\n" + rest +
                           state.replanning.report(switches))
        report["replan"] = state.replanning.last
        report["replan_cost"] = state.replanning.cost()
    return LiveProfile(report)


def as_it_stood(profile: LiveProfile, steps_run: int) -> LiveProfile:
    """`profile` (a capture's that trained, kept when another capture took over) marked as
    of the Module's `steps_run`-th step."""
    kept = copy.copy(profile)
    kept._table = (f"(the training capture's, as it stood after step {steps_run}, when an evaluation took over; "
                   "the next training step runs it again)\n" + profile._table)
    return kept
