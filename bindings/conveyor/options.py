"""What a conveyor.Module was asked for, checked once in its constructor and passed, never
changed, to whatever builds or runs its pipelines; OPTIONS_HELP describes each."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from . import distributed
from .as_model import RETURNS
from .arguments import check_cluster, check_module_arguments, seconds, warn_of_another_machine
from .batch_feed import BATCH_MODES
from .errors import ConveyorValueError
from .planning import FixedParts
from .sizes import as_max_sizes

__all__ = ["Options", "resolve_options", "OPTIONS_HELP"]

OPTIONS_HELP = """conveyor.Module(model, optimizer=None, **options): the options, each optional.

    stages        None: planned; an int: that many stages, cut where the profile balances
                  them best (the rest still planned); a list: node lists (a partition of
                  the captured graph), run as given
    replicas      None: planned (node lists: 1); an int: every stage that many; a list: one
                  count per pipeline rank (with stages)
    microbatches  None: planned; an int: fixed
    schedule      "auto" (planned), "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v" or
                  "dualpipev"; with an int `stages`, "auto" plans among gpipe, 1f1b and
                  zb-h1 (interleaved, zb-v and dualpipev put 2 stages on each device group)
    devices       virtual devices of the local machine to plan for (default: 2-4 by cores)
    cluster       a cluster TOML file (or text) to plan for instead of the local machine
    trace         a path: the second step's measured actions are written there (Perfetto;
                  across processes each writes its own to <stem>.rank<R><suffix>, and process
                  0 the job's, every process's tracks and the flows between them, to the path)
    plan          a plan document (`conveyor plan --out`, Plan.save) to run instead of planning
                  (the first train-mode capture's: eval mode's, another size's are planned)
    timeout       seconds any wait between processes may take (rendezvous, a step); default
                  CONVEYOR_TIMEOUT or 300
    transport     across processes: "ucx" (host memory; the default, or CONVEYOR_TRANSPORT)
                  or "nccl" (GPU to GPU, one GPU per process)
    replan        "auto" (the default, or the job config's): every few steps the measured stage
                  times correct the plan's inputs and, when another plan saves more than moving
                  to it costs within `replan_horizon` steps, the job switches to it at a step
                  boundary (`model.replans` lists the switches); "off": the first plan stays.
                  Only plans conveyor made re-plan (not node lists or a plan file), and
                  a re-plan keeps what `stages`, `replicas` and `microbatches` fixed.
    replan_horizon  steps within which a switch must pay for moving (default 100)
    recompute     None (default): a stage recomputes its activations where the plan needs it
                  to fit: "selective" (its cheap operators, elementwise, softmax, dropout and
                  attention, keep nothing and run again just before the backward) where that
                  is enough, else "full" (it keeps only its inputs and runs its whole forward
                  again), with the same dropout masks: less memory for more time; True or
                  "full", "selective": every stage; False or "none": none; a list: one per stage
    max_sizes     the largest symbolic sizes batches will have, by name ({"input_ids dim 1":
                  512}): the plan's memory is made for them (bindings/conveyor/sizes.py);
                  undeclared, a larger size plans again before its step where re-planning
                  is on (bindings/conveyor/planning/plan_maker.py), else gets a warning
    init          a model built on the meta device: init(name, meta_tensor) -> its first
                  values, instead of the model's own initializers (bindings/conveyor/materialize.py)
    batches       across processes: "same" (the default): every process is fed the same whole
                  batch (checked on the first calls, then sampled); "shares": each process
                  its own share, as a DistributedSampler loads it, the step's batch being the
                  shares concatenated in process order (bindings/conveyor/batch_feed.py)
    returns       "loss" (default): a call returns the loss tensor; "model": what the model's
                  forward returns, of the same type where that is a ModelOutput or dict, holding
                  the pipelined loss as `loss` and nothing else (bindings/conveyor/as_model.py),
                  as transformers' Trainer and Lightning read it
    guards        True (default): a check of a tensor's values (`if not torch.isfinite(h).all()`,
                  `torch._assert`) is captured as the example takes it, under a guard that stops
                  a step whose batch would take the other way, naming its line
                  (bindings/conveyor/guards.py); False: such a check is refused, as any branch on
                  a tensor's value is
    verbose       True (default): a line per phase of the first call (captured, profiled,
                  planned, built) on process 0, through the "conveyor" logger; False: none
"""


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
    verbose: bool = True      # a line per phase of a capture and plan, on process 0 (progress.py)
    batches: str = "same"     # across processes: every process fed the same batch, or its share (batch_feed.py)
    meta_shapes: dict = None  # a model built on the meta device: its tensors' shapes by id (materialize.py)
    init: Any = None          # with it: init(name, meta_tensor) -> the tensor's first values
    seed: int = 0             # what its tensors' first values derive from, with their names
    guards: bool = True       # checks of tensor values captured under guards (guards.py)
    returns: str = "loss"     # a call returns the loss, or the model's own output type holding it (as_model.py)

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
                    meta_shapes=None, batches="same", verbose=True, returns="loss", guards=True) -> Options:
    """The Module's arguments, checked (every misuse a ConveyorValueError naming it), with
    what `conveyor launch` (or its job config) asks of every process where not given."""
    launched = distributed.launch_settings()
    if schedule == "auto":
        schedule = launched.get("schedule", "auto")
    plan = plan if plan is not None else launched.get("plan")
    trace = trace if trace is not None else launched.get("trace")
    transport = transport if transport is not None else launched.get("transport", "ucx")
    replan = replan if replan is not None else launched.get("replan", "auto")  # replan=False is refused, not "auto"
    replan_horizon = replan_horizon if replan_horizon is not None else launched.get("replan_horizon", 100)
    check_module_arguments(model, optimizer, stages=stages, replicas=replicas, microbatches=microbatches,
                           schedule=schedule, devices=devices, cluster=cluster, trace=trace, loss_fn=loss_fn,
                           plan=plan, transport=transport, replan=replan, replan_horizon=replan_horizon,
                           recompute=recompute)
    if batches not in BATCH_MODES:
        raise ConveyorValueError(f"batches={batches!r}: expected 'same' (every process is fed the whole batch) or "
                                 "'shares' (each process its own share, as a DistributedSampler loads it)")
    if returns not in RETURNS:
        raise ConveyorValueError(f"returns={returns!r}: expected 'loss' (a call returns the loss tensor) or 'model' "
                                 "(the model's own output type, a ModelOutput or dict, holding the loss)")
    devices = devices or max(2, min(4, os.cpu_count() or 2))
    world = distributed.world()
    warn_of_another_machine(cluster, check_cluster(cluster), world[1] if world else devices, world is not None)
    # Checked now, not at the first call; node lists run as given instead.
    fixed = None if isinstance(stages, list) else FixedParts(stages, replicas, schedule, recompute)
    return Options(stages=stages, replicas=replicas, microbatches=microbatches, schedule=schedule,
                   devices=devices, cluster=cluster, trace=trace,
                   loss_fn=loss_fn, plan_file=plan, transport=transport,
                   timeout_s=seconds(timeout, "timeout") if timeout is not None else distributed.default_timeout(),
                   replan=replan, replan_horizon=replan_horizon, recompute=recompute,
                   max_sizes=as_max_sizes(max_sizes), fixed=fixed, meta_shapes=meta_shapes or {}, init=init,
                   seed=torch.initial_seed(), batches=batches,
                   verbose=bool(verbose), returns=returns, guards=bool(guards))
