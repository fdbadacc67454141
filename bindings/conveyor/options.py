"""What a conveyor.Module was asked for, checked once in its constructor and passed, never
changed, to whatever builds or runs its pipelines (module.py's docstring describes each)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from . import distributed
from .arguments import check_module_arguments, seconds
from .distributed.processes import this_process_file
from .planning import FixedParts
from .sizes import as_max_sizes

__all__ = ["Options", "resolve_options"]


@dataclass(frozen=True)
class Options:
    """A Module's arguments after the launcher's job settings filled what the call left out.
    `fixed` is what stages, replicas, schedule and recompute fix of a plan (None when the
    stages are node lists, run as given); `devices` the virtual devices of this machine to
    plan for in one process."""
    stages: Any
    replicas: Any
    microbatches: int | None
    schedule: str
    devices: int
    cluster: Any
    trace: Any
    loss_fn: Any
    plan_file: Any
    transport: str
    timeout_s: float
    replan: str
    replan_horizon: int
    recompute: Any
    max_sizes: dict
    fixed: FixedParts | None
    meta_shapes: dict = None  # a model built on the meta device: its tensors' shapes by id (materialize.py)
    init: Any = None          # with it: init(name, meta_tensor) -> the tensor's first values
    seed: int = 0             # what its tensors' first values derive from, with their names

    @property
    def meta_built(self) -> bool:
        """Whether the model was built on the meta device."""
        return bool(self.meta_shapes)

    @property
    def stages_given(self) -> bool:
        """Whether the stages are the user's node lists (one capture's nodes)."""
        return isinstance(self.stages, list)


def resolve_options(model, optimizer, *, stages, replicas, microbatches, schedule, devices, cluster, trace, loss_fn,
                    timeout, plan, transport, replan, replan_horizon, recompute, max_sizes, init=None,
                    meta_shapes=None) -> Options:
    """The Module's arguments, checked (every misuse a ConveyorValueError naming it), with
    what `conveyor launch` (or its job config) asks of every process where not given."""
    launched = distributed.launch_settings()
    if schedule == "auto":
        schedule = launched.get("schedule", "auto")
    plan = plan if plan is not None else launched.get("plan")
    trace = this_process_file(trace) if trace is not None else launched.get("trace")
    transport = transport if transport is not None else launched.get("transport", "ucx")
    replan = replan or launched.get("replan", "auto")
    replan_horizon = replan_horizon if replan_horizon is not None else launched.get("replan_horizon", 100)
    check_module_arguments(model, optimizer, stages=stages, replicas=replicas, microbatches=microbatches,
                           schedule=schedule, devices=devices, cluster=cluster, trace=trace, loss_fn=loss_fn,
                           plan=plan, transport=transport, replan=replan, replan_horizon=replan_horizon,
                           recompute=recompute)
    # Checked now, not at the first call; node lists run as given instead.
    fixed = None if isinstance(stages, list) else FixedParts(stages, replicas, schedule, recompute)
    return Options(stages=stages, replicas=replicas, microbatches=microbatches, schedule=schedule,
                   devices=devices or max(2, min(4, os.cpu_count() or 2)), cluster=cluster, trace=trace,
                   loss_fn=loss_fn, plan_file=plan, transport=transport,
                   timeout_s=seconds(timeout, "timeout") if timeout is not None else distributed.default_timeout(),
                   replan=replan, replan_horizon=replan_horizon, recompute=recompute,
                   max_sizes=as_max_sizes(max_sizes), fixed=fixed, meta_shapes=meta_shapes or {}, init=init,
                   seed=torch.initial_seed())
