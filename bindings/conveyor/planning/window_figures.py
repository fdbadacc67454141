"""A re-planning window's figures (docs/design.md, "Re-planning"): one process's, from its
live profile; every process's merged into the stages the Replanner reads; and the step terms
it prices."""
from __future__ import annotations

from .replanning_messages import FIGURES, WindowFigures


def merge_processes(reports: list) -> tuple[list, list]:
    """Every process's stage figures as one: per stage, each kind of compute and transfer as
    the process that ran it measured it (the larger figure), each replica's compute from the
    process that runs it; and a gradient sum across processes told apart into moving and
    waiting. The group tells most of the wait apart itself (waiting_s: transport's
    allreduce_timed); what it cannot (NCCL) stays in the process's across_s,
    which runs from when its own part was ready to when the sum completed. The last process
    to contribute waits for nobody, so the least across_s is the time spent moving bytes,
    and each process's beyond it, with its waiting_s, the time it waited for the slowest's
    compute. Returns the merged stages (allreduce_s: what the sums took without waiting)
    and per stage each process's wait in seconds."""
    merged = [dict(s) for s in reports[0]]
    waiting = []
    for k, stage in enumerate(merged):
        for theirs in (r[k] for r in reports[1:]):
            for key in ("forward_s", "backward_s", "backward_weight_s", "send_s"):
                stage[key] = max(stage[key], theirs[key])
            stage["replica_compute_s"] = [max(a, b) for a, b in zip(stage["replica_compute_s"],
                                                                     theirs["replica_compute_s"])]
        across = [r[k]["across_s"] for r in reports]
        measured = [a for a in across if a > 0]
        moving = min(measured) if measured else 0.0
        within = max(r[k]["allreduce_s"] - r[k]["across_s"] for r in reports)  # summed in one process: no wait
        stage["allreduce_s"], stage["across_s"] = within + moving, moving
        waiting.append([(a - moving if a > 0 else 0.0) + r[k]["waiting_s"] for a, r in zip(across, reports)])
    return merged, waiting


COMPUTE = ("forward_s", "backward_s", "backward_weight_s", "replica_compute_s")  # a window's figures of compute


def window_figures(report: dict, window: int, probe_rate: float = 0.0, compute_scale: float = 1.0,
                   wall_s: float = 0.0, optimizer_s: float = 0.0) -> WindowFigures:
    """This process's figures of a window, from its live profile's report (`probe_rate`: its
    device's probe, DeviceProbe.rate; one process: 1 at its census; 0: not probed), its
    compute times `compute_scale` times what they measured (core_sharing.py: without what the
    planner took of them), and its mean step as its caller saw it (`wall_s`) with the
    optimizer's part of it (step_clock.py)."""
    def scaled(k, x):
        if k not in COMPUTE or compute_scale == 1.0:
            return x
        return [v * compute_scale for v in x] if isinstance(x, list) else x * compute_scale
    return WindowFigures(window, [{k: scaled(k, s[k]) for k in FIGURES} for s in report["stages"]],
                         report["measured_step_s"], probe_rate, wall_s, optimizer_s)


def step_terms(figures: list, per_device: bool) -> tuple[float, list, float]:
    """Every process's figures of a window (process 0's first) as the Replanner takes them:
    the step the plans price (the pipeline's, and with `per_device` its optimizer's after it,
    on the process that ends last), per device its process's optimizer step (`per_device`:
    device d is process d; else none), and what no plan changes per step (the least over the
    processes that run a stage of their step beyond those: the caller's loop and data; where
    the optimizer is not per device, one process's updates the whole model under any plan,
    and it is counted here)."""
    running = [f for f in figures if f.step_s > 0]
    if not running:
        return max(f.step_s for f in figures), [], 0.0
    optimizer = (lambda f: f.optimizer_s) if per_device else (lambda f: 0.0)
    priced = max(f.step_s + optimizer(f) for f in running)
    beyond = [f.wall_s - f.step_s - optimizer(f) for f in running if f.wall_s > 0]
    return priced, [f.optimizer_s for f in figures] if per_device else [], max(0.0, min(beyond, default=0.0))
