"""`conveyor.Module`: one line turns a model into a pipelined one.

    model = conveyor.Module(model, optimizer)
    loss = model(x, labels=y)      # every microbatch forward and backward, in the plan's schedule
    loss.backward()                # the parameter gradients, scaled by the incoming gradient
    optimizer.step()               # updates the model's own parameters

A model whose forward returns outputs, not a loss, takes `loss_fn=`: the call's `target=`
keyword then goes to `loss_fn(output, target)`, as in `criterion(model(x), y)`:

    model = conveyor.Module(net, optimizer, loss_fn=torch.nn.CrossEntropyLoss())
    loss = model(x, target=y)

On the first call the model is captured, profiled on one microbatch and planned on the
local machine (its CPU split into `devices` virtual devices, or the machines a `cluster`
file describes), unless `stages` lists the cut. Every stage replica runs on its own
thread; the plan it runs is `model.plan`.

Under a launcher (`conveyor launch -n N -- python train.py`, or RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set by hand or by torchrun) the same script runs across the N
processes: process 0 plans for N devices (one per process), every process runs its share
of the pipeline's stage replicas and holds only the parameters its stages read (the others
have 0 elements while it trains); a stage whose replicas run in several processes is data
parallel across them (its gradients summed over them every step). The loss reaches every
process, and `state_dict()` gathers the
whole model from the processes that own each part (call it on every process: it is
collective, like `load_state_dict()` and every call). Every process must be fed the same
batches.

Evaluation is pipelined too: a call under torch.no_grad() runs the forwards alone through
the same stages, replicas and processes (nothing kept for a backward, no gradient touched,
no process holding more of the model than its stages read) and returns the batch's loss.
Each mode has its own capture, made on its first call: in eval mode (`model.eval()`)
BatchNorm uses its running statistics and leaves them alone and dropout keeps everything,
as eager PyTorch does; with gradients enabled an eval-mode call trains the eval-mode model
(BatchNorm frozen, as in fine-tuning). In train mode under no_grad BatchNorm normalizes
each microbatch by its own statistics, as a training step does. An eval-mode call that
cannot be captured, or whose model returns outputs (logits) rather than a loss, runs the
model whole, as eager, and says so once.

Dropout (any random operator) in a forward draws from a generator seeded from the
pipeline's seed, the step, the stage, the microbatch and the replica: the same masks
whatever the threads' timing and whichever process runs a replica, so a run is
reproducible and placement does not change it (the seed is drawn from torch's global
generator when the pipeline is built, so torch.manual_seed decides it; across processes
process 0's is used). The masks are not eager's: eager draws one stream in execution order.

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
                  across processes each writes <stem>.rank<R><suffix>)
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
                  is on (bindings/conveyor/plan_maker.py), else gets a warning
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Any

import torch

from . import _C, distributed
from .arguments import TWO_STAGES_PER_RANK, check_module_arguments, recomputation, seconds
from .capture import capture, modes_of
from .captures import Captures
from .loss_wrapper import loss_wrapper
from .microbatches import Microbatches, is_packed, run_packed
from .live_profile import LiveProfile, live_profile
from .memory import reset_device_peak
from .errors import ConveyorValueError, NotALossError, UnsupportedError
from .plan_maker import PlanMaker, local_cluster, model_gpu_memory, plan_for_larger_sizes
from .planning import FixedParts, Plan, read_plan
from .replanning import Replanning, switch_to
from .call_splitting import refuse_to_split, warn_of_a_loss_split_changes, why_calls_stay_whole
from .sizes import as_max_sizes, check_max_sizes, largest_sizes

__all__ = ["Module"]


def _least_share(graph) -> int:
    """The fewest samples the captured graph holds for (its batch range's min, docs/formats.md);
    1 where the model sets no bound."""
    ranges = graph.document.get("ranges", {})
    return max([1] + [ranges[s].get("min", 1) for s, role in graph.document["symbols"].items()
                      if role == "batch" and s in ranges])


def _batch_of(inputs: list) -> int | None:
    """The batch size of a call: dim 0 of its first tensor that has dimensions."""
    return next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)


class _PipelinedLoss(torch.autograd.Function):
    """The step already ran backward and held its gradients; backward() adds them to the
    parameters' .grad, scaled by the incoming gradient (so loss scaling keeps working), and
    hands the inputs that required a gradient theirs (`input_grads`, the step's, in the
    order of `tensors` after the parameters), so autograd carries them on. The parameters
    are inputs only so that the loss asks for a backward."""

    @staticmethod
    def forward(ctx, loss, held, input_grads, params: int, *tensors):
        ctx.held, ctx.input_grads, ctx.params = held, input_grads, params
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.held.apply(grad)
        to_inputs = tuple(g * grad.to(g.dtype) for g in ctx.input_grads)
        return (None, None, None, None) + (None,) * ctx.params + to_inputs


class Module(torch.nn.Module):
    """Wraps `model` so that a call trains it pipelined; see the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 stages: int | list | None = None, replicas: int | None = None, microbatches: int | None = None,
                 schedule: str = "auto", devices: int | None = None, cluster: str | None = None,
                 trace: str | os.PathLike | None = None, loss_fn=None, timeout: float | None = None,
                 plan: str | os.PathLike | None = None, transport: str | None = None, replan: str | None = None,
                 replan_horizon: int | None = None, recompute: bool | list | None = None,
                 max_sizes: dict | None = None):
        super().__init__()
        # What `conveyor launch` (or its job config) asks of every process, where not given here.
        launched = distributed.launch_settings()
        if schedule == "auto":
            schedule = launched.get("schedule", "auto")
        if plan is None:
            plan = launched.get("plan")
        if trace is None:
            trace = launched.get("trace")
        if transport is None:
            transport = launched.get("transport", "ucx")
        replan = replan or launched.get("replan", "auto")
        replan_horizon = replan_horizon if replan_horizon is not None else launched.get("replan_horizon", 100)
        check_module_arguments(model, optimizer, stages=stages, replicas=replicas, microbatches=microbatches,
                               schedule=schedule, devices=devices, cluster=cluster, trace=trace, loss_fn=loss_fn,
                               plan=plan, transport=transport, replan=replan, replan_horizon=replan_horizon,
                               recompute=recompute)
        # What stages, replicas, schedule and recompute fix of a plan (checked now, not at the
        # first call); node lists run as given instead.
        self._fixed = None if isinstance(stages, list) else FixedParts(stages, replicas, schedule, recompute)
        self.module = model
        self.optimizer = optimizer
        self._stages = stages
        self._microbatches = microbatches
        self._replicas = replicas
        self._schedule = schedule
        self._recompute = recompute
        self._max_sizes, self._planned_sizes, self._warned_sizes = as_max_sizes(max_sizes), {}, set()
        self._devices = devices or max(2, min(4, os.cpu_count() or 2))
        self._cluster = cluster
        self._loss_fn = loss_fn
        self._plan_file = plan
        self._plan_file_built = False  # whether a capture runs it (the first in train mode; others are planned)
        self._trace = trace
        self._transport = transport
        self._timeout = seconds(timeout, "timeout") if timeout is not None else distributed.default_timeout()
        self._world = distributed.world()
        self._group = None
        self._steps_run = 0
        self._trained_steps = 0  # training steps the capture in use ran (evaluations not counted)
        self._graph = None
        self._step = None
        self._small_steps: dict[int, Any] = {}  # microbatches -> pipeline for batches too small for the plan
        self._replan, self._replan_horizon = replan, replan_horizon
        self._replanning: Replanning | None = None  # with a plan conveyor made and replan="auto"
        self._plan_maker: PlanMaker | None = None  # the same: to plan again for larger sizes
        self._marker: str | None = None  # a switch of plan, marked in the next step's trace
        self._switches: list[dict] = []  # Module.replans
        self._captures = Captures()  # a model that fixes a size: one capture per size met
        self.plan = None

    # -- the model's own state --------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job (0 in a single process)."""
        return self._world[0] if self._world else 0

    @property
    def world_size(self) -> int:
        """Processes in the job (1 in a single process)."""
        return self._world[1] if self._world else 1

    def _gather(self) -> None:
        """Across processes: the whole model, every part from its owner, in every process
        (collective; the next training step frees again what this process's stages do not read)."""
        if self._group is not None and self._step is not None:
            self._step.gather_state()
            self._captures.gather_others(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: across processes the norm
        counts every parameter's gradient once (in the process that owns it) and is the same
        on every process (collective: call it on every process). Returns the total norm."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self._group is None or self._step is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        if norm_type != 2.0:
            raise ConveyorValueError("across processes clip_grad_norm_ takes norm_type=2 for now")
        owners = self._step.owners()
        mine = {t.data_ptr() for name, t in self._graph.tensors.items() if owners.get(name) == self._group.rank}
        owned = [p.grad for p in params if p.data_ptr() in mine]
        total = torch.zeros(1, dtype=torch.float64)
        for g in owned:
            total += g.detach().double().pow(2).sum().cpu()
        self._group.allreduce(total)
        norm = total.sqrt()[0]
        scale = max_norm / (norm.item() + 1e-6)
        if scale < 1:
            for p in params:
                p.grad.mul_(scale)
        return norm.to(params[0].dtype if params else torch.float32)

    def state_dict(self, *args, **kwargs):
        self._gather()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self._gather()  # across processes: every tensor whole again, so every one takes its value
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- building ---------------------------------------------------------------------
    def _build(self, args: tuple, kwargs: dict, packed: Microbatches | None = None) -> None:
        """Captures the model on this call (`packed`: a first step of packed microbatches, the
        call its first one), then plans it, or reads its plan, or takes the stages given."""
        with torch.enable_grad():  # an evaluation's first call builds as a step's would
            self._build_under_grad(args, kwargs, packed)

    def _build_under_grad(self, args: tuple, kwargs: dict, packed: Microbatches | None) -> None:
        wrapper = loss_wrapper(self.module, self._loss_fn, args, kwargs)
        graph = capture(wrapper, args, kwargs)
        graph.modes = modes_of(self.module)  # a call in another mode needs another capture
        outputs = graph.document["outputs"]
        if len(outputs) != 1 or graph.document["values"][outputs[0]].get("shape") != []:
            raise NotALossError(f"the model's forward must return one scalar loss to be trained pipelined (it returns "
                                f"{len(outputs)} value{'s' if len(outputs) != 1 else ''}: "
                                f"{', '.join(graph.document['values'][v]['name'] for v in outputs[:4])}); compute the "
                                "loss inside forward, wrap the model so that it does, or pass loss_fn= and target=")
        unseeded = graph.executor.unseeded_random_nodes()
        if unseeded:
            ops = sorted({graph.document["nodes"][n]["op"] for n in unseeded})
            warnings.warn(f"conveyor: {len(unseeded)} random operators ({', '.join(ops)}) take no generator, so they "
                          "draw from torch's global one: their draws depend on thread timing and on which process runs "
                          "them (dropout of every kind, attention dropout, rand, randn and bernoulli draw reproducibly)", stacklevel=4)
        batch = (sum(packed.rows()) if packed is not None else _batch_of(graph.flatten_inputs(args, kwargs))) or 1
        least = _least_share(graph)  # samples a replica must run at once (the model's own bound)
        whole = None if packed is not None else why_calls_stay_whole(self.module, graph, batch)
        if whole:
            refuse_to_split(whole, self._microbatches, self._replicas)
        replicas, from_file = None, False
        if self._world is not None:
            self._devices = self._world[1]
            self._group = distributed.process_group(self._job_fingerprint(graph, batch), self._timeout)
        if isinstance(self._stages, list):  # the user's own cut: run it as given
            stage_nodes = self._stages
            schedule = "1f1b" if self._schedule == "auto" else self._schedule
            chunks = 2 if schedule in TWO_STAGES_PER_RANK else 1
            if len(stage_nodes) % chunks:
                raise ConveyorValueError(f"the {schedule} schedule needs an even number of stages, not {len(stage_nodes)}")
            ranks = len(stage_nodes) // chunks
            replicas = (self._replicas if isinstance(self._replicas, list) else [self._replicas or 1] * ranks)
            if len(replicas) != ranks:
                raise ConveyorValueError(f"replicas has {len(replicas)} counts but the pipeline has {ranks} ranks")
            m = self._microbatches or (len(packed) if packed is not None else 1 if whole else
                                       max(1, min(batch // (max(replicas) * least), 2 * ranks)))
        elif self._plan_file is not None and not self._plan_file_built and self.module.training:
            # The plan file is the first train-mode capture's; another capture (eval mode, a
            # size on the other side of a branch) has other nodes and is planned.
            from_file = True
            self.plan = read_plan(self._plan_file)
            if whole:
                refuse_to_split(whole, self.plan.microbatches, max(self.plan.replicas), f"the plan {self._plan_file}")
            self._step = self._pipeline(graph, self.plan)
            stage_nodes, replicas = self.plan.stage_nodes, self.plan.replicas
            schedule, m, chunks = self.plan.schedule, self.plan.microbatches, self.plan.document["chunks"]
        else:
            fixed = self._fixed.one_replica() if whole else self._fixed
            # Every fixed stage replica gets a device of its own to plan for.
            self._devices = max(self._devices, fixed.devices())
            # A packed first step: its microbatches are the plan's, its largest sizes planned for.
            m_hint = self._microbatches or (len(packed) if packed is not None else 1 if whole else 0)
            # Microbatches keep at least two samples (BatchNorm needs them), unless fixed.
            sample = max(1, batch // m_hint) if m_hint else min(batch, max(2, least, batch // (2 * self._devices)))
            most_microbatches = 1 if whole else max(1, batch // max(2, least))
            # The profile's example: the call's rows (a packed step's microbatch with most rows).
            example = graph.flatten_inputs(*(packed.calls[packed.rows().index(max(packed.rows()))]
                                             if packed is not None else (args, kwargs)))
            first = _batch_of(example)
            example = [a[:sample] if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == first else a
                       for a in example]
            check_max_sizes(graph, self._max_sizes)  # on every process: a bad one fails them all alike
            calls = [graph.flatten_inputs(*call) for call in packed.calls] if packed is not None else []
            sizes = largest_sizes(graph, calls, self._max_sizes)
            cluster = self._cluster or local_cluster(self._devices, self._threads_per_device(),
                                                      model_gpu_memory(self.module), one_gpu=self._group is None)
            maker = PlanMaker(graph, example, batch=batch, microbatches=m_hint, most_microbatches=most_microbatches,
                              fixed=fixed, cluster=cluster, optimizer=self.optimizer, group=self._group,
                              threads=self._threads_per_device(), horizon_steps=self._replan_horizon)
            prof = maker.profile(sizes)
            self._planned_sizes = dict(maker.sizes)
            self.plan = maker.plan(prof, 0)
            try:
                self._step = self._pipeline(graph, self.plan)
            except UnsupportedError:
                # Raised alike on every process, before they talk: replica counts that differ
                # across a cut through a value with no batch dimension. Plan again with one
                # replica per stage, unless the replicas were fixed.
                if fixed.replicas:
                    raise
                self.plan = maker.plan(prof, 1)
                self._step = self._pipeline(graph, self.plan)
            stage_nodes, replicas = self.plan.stage_nodes, self.plan.replicas
            schedule, m, chunks = self.plan.schedule, self.plan.microbatches, self.plan.document["chunks"]
            if self._replan == "auto":
                self._plan_maker = maker
                self._replanning = Replanning(maker.replanner(prof, self.plan), self._group, self._switches)
        if self._step is None:
            self._step = self._make_pipeline(graph, stage_nodes, schedule, m, chunks, replicas)
        self._graph = graph
        replicas = list(replicas)[:len(stage_nodes) // chunks]  # per rank (a plan lists them per stage)
        self._layout = (len(stage_nodes), schedule, m, chunks, replicas)
        warn_of_a_loss_split_changes(self._step, m, replicas)
        self._stage_nodes = stage_nodes
        self._built_batch, self._least = batch, least
        self._plan_file_built = self._plan_file_built or from_file

    def _threads_per_device(self) -> int:
        if self._world is not None:
            return torch.get_num_threads()  # a process is a device
        return max(1, torch.get_num_threads() // self._devices)

    def _job_fingerprint(self, graph, batch: int) -> str:
        """What every process of the job must agree on: the captured model and the pipeline asked for."""
        asked = repr((self._stages, self._replicas, self._microbatches, self._schedule, self._cluster, batch))
        text = json.dumps(graph.document, sort_keys=True, default=str) + asked
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _placement(self, replicas: list, plan=None) -> dict:
        """Across processes, the process of every replica of every pipeline rank: the plan's
        device when the plan was made for this job (device d is process d); otherwise the
        replicas rank by rank, spread evenly over the processes (one each when there are as
        many processes as replicas; a rank's replicas share a process when there are fewer).
        A stage whose replicas land on several processes sums its gradients across them."""
        if self._group is None:
            return {}
        n = self._group.world_size
        stages = plan.document.get("stages", []) if plan is not None else []
        if plan is not None and len(plan.document.get("devices", [])) == n and len(stages) >= len(replicas) and all(
                0 <= stages[r].get("first_device", -1) and stages[r]["first_device"] + replicas[r] <= n
                for r in range(len(replicas))):
            where = [[stages[r]["first_device"] + i for i in range(replicas[r])] for r in range(len(replicas))]
        else:
            workers = [(r, i) for r in range(len(replicas)) for i in range(replicas[r])]
            where = [[0] * k for k in replicas]
            for w, (r, i) in enumerate(workers):
                where[r][i] = w * n // len(workers)
        return dict(processes=self._group, replica_process=where, step_timeout_s=self._timeout,
                    transport=self._transport)

    def _pipeline(self, graph, plan, holders: dict | None = None):
        """The plan's pipeline (`holders`: a re-plan's, _C.PipelineStep's)."""
        chunks = plan.document["chunks"]
        return self._make_pipeline(graph, plan.stage_nodes, plan.schedule, plan.microbatches, chunks,
                                   plan.replicas[:len(plan.stage_nodes) // chunks], plan=plan, holders=holders)

    def _make_pipeline(self, graph, stage_nodes: list, schedule: str, microbatches: int, chunks: int,
                       replicas: list, plan=None, across_processes: bool = True, holders: dict | None = None):
        """The one place a pipeline is built: `stage_nodes` under `schedule`, with `replicas`
        per rank; `plan` (when the stages come from one) is what the live profile compares
        against; across processes, every replica on the process _placement gives it."""
        placement = self._placement(replicas, plan) if across_processes else {}
        if isinstance(self._recompute, list):
            recompute = [recomputation(r) for r in self._recompute]
        elif plan is not None and self._recompute is None:  # the plan's choice, stage by stage
            recompute = [recomputation(s.get("recompute", False)) for s in plan.document["stages"]]
        else:
            recompute = [recomputation(self._recompute)] * len(stage_nodes)
        if len(recompute) != len(stage_nodes):
            raise ConveyorValueError(f"recompute has {len(recompute)} flags but the pipeline has {len(stage_nodes)} stages")
        # The plan's shares: devices of different speeds take microbatch shares to match.
        shares = [list(s.get("shares", [])) for s in plan.document["stages"][:len(replicas)]] if plan is not None else []
        return _C.PipelineStep(graph.executor, stage_nodes, schedule, microbatches, chunks, replicas,
                               plan=json.dumps(plan.document) if plan is not None else "", recompute=recompute,
                               shares=shares, holders=holders or {}, **placement)

    # -- running ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if is_packed(args, kwargs):  # one step over microbatches the caller packed
            loss, step = run_packed(self, args[0], hold_gradients=True)
            params = [p for p in self.module.parameters() if p.requires_grad]
            return _PipelinedLoss.apply(loss, step.take_held_gradients(), [], len(params), *params)
        # Each mode has its capture (model.eval(): BatchNorm's running statistics, no dropout).
        if not self._captures.take_up(self, args, kwargs):  # an eval mode that cannot be captured
            self._gather()  # across processes, every part of the model from its owner
            return loss_wrapper(self.module, self._loss_fn, args, kwargs)(*args, **kwargs)
        inputs = self._graph.flatten_inputs(args, kwargs)
        if not torch.is_grad_enabled():
            # An evaluation: the forwards alone, through the same stages and processes.
            loss, _, _ = self._step_for(inputs).evaluate(inputs)
            return loss
        self._maybe_replan()
        plan_for_larger_sizes(self, [inputs])
        step = self._step_for(inputs)
        loss = self._run(step, inputs, hold_gradients=True)
        params = [p for p in self.module.parameters() if p.requires_grad]
        # Inputs that require a gradient get the step's, through autograd (a module before
        # this one trains; x.grad fills).
        wanting = [(t, g) for t, g in zip(inputs, step.take_input_gradients()) if g is not None]
        return _PipelinedLoss.apply(loss, step.take_held_gradients(), [g for _, g in wanting], len(params),
                                    *params, *[t for t, _ in wanting])

    def _run(self, step, inputs: list, hold_gradients: bool) -> torch.Tensor:
        reset_device_peak(self._graph)
        loss, _, _ = step.run(inputs, hold_gradients=hold_gradients)
        self._steps_run += 1
        self._trained_steps += 1
        if step is self._step and self._replanning is not None:
            self._replanning.steps += 1
        if self._trace is not None and (self._steps_run <= 2 or self._marker is not None):
            # The second step (past warm-up), or the first after a switch of plan, marked.
            markers = [(0.0, self._marker)] if self._marker is not None else []
            self._marker = None
            self._step.write_trace(str(self._trace), markers)
        return loss

    # -- re-planning (bindings/conveyor/replanning.py) ------------------------------------
    @property
    def replans(self) -> list[dict]:
        """One entry per switch of plan: step, old and new (plan summaries), reason, the
        decision's arithmetic, predicted_gain_s per step, move_s and move_bytes (measured),
        step_before_s, and once the next window is measured measured_step_s and
        measured_gain_s."""
        return self._switches

    def _maybe_replan(self) -> None:
        """At a step boundary, when a window is due: the partitioner's decision, and the switch."""
        if self._replanning is None or not self._replanning.due():
            return
        decision = self._replanning.evaluate(self._step)
        if decision["switch"]:
            switch_to(self, Plan(decision["candidate"], decision["candidate_table"]), decision)

    def switch_plan(self, plan: Plan) -> None:
        """Runs `plan` (a Plan of this model, e.g. from conveyor.plan or Plan.save) from the next
        step on, over the same parameters and optimizer state; across processes every process
        calls it with the same plan (collective), and parameters, buffers and optimizer state
        move to their new owners. Re-planning (replan="auto") goes on from it."""
        if self._step is None:
            raise ConveyorValueError("the pipeline is built on the first call: switch plans after it")
        if not isinstance(plan, Plan):
            raise ConveyorValueError(f"switch_plan takes a conveyor Plan, not {type(plan).__name__}")
        switch_to(self, plan, None)

    def _step_for(self, inputs: list):
        """The pipeline that runs this batch: the plan's. On one process, a batch smaller than
        the one the pipeline was built for and too small to give every replica of every
        microbatch the samples the model runs at once (a data loader's last batch) runs on the
        same stages with one replica each and as many microbatches as it allows: the same
        gradient accumulation over the same batch. Across processes, or for the batch the
        pipeline was built for, the plan's pipeline refuses it, naming what to change."""
        _, schedule, m, chunks, replicas = self._layout
        batch, least = _batch_of(inputs), self._least
        if (batch is None or self._group is not None or batch >= self._built_batch
                or batch // m // max(replicas) >= least):
            return self._step
        ranks = len(replicas)
        fitting = [k for k in range(min(m, batch // least), 0, -1) if chunks == 1 or k % ranks == 0]
        if not fitting:
            return self._step  # nothing runs it: the plan's pipeline names the sizes
        k = fitting[0]
        if k not in self._small_steps:
            # DualPipeV needs 2 microbatches a stage; ZB-V places the stages alike and does not.
            small = "zb-v" if schedule == "dualpipev" else schedule
            self._small_steps[k] = self._make_pipeline(self._graph, self._stage_nodes, small, k, chunks, [1] * ranks,
                                                       across_processes=False)
        return self._small_steps[k]

    @property
    def microbatches(self) -> int:
        """Microbatches per step of the running plan (built on the first call)."""
        if self._step is None:
            raise ConveyorValueError("the pipeline is built on the first call")
        return self._layout[2]

    def write_trace(self, path) -> None:
        """Writes the last step's measured actions as a Perfetto trace (ui.perfetto.dev)."""
        if self._step is None:
            raise ConveyorValueError("no step has run yet: nothing to trace")
        self._step.write_trace(str(path))

    def profile_report(self) -> LiveProfile:
        """How the running pipeline compares with its plan: every step's measured actions reach
        the pipeline's partitioner actor, which reports per stage the measured forward,
        backward, weight-gradient, transfer and allreduce times against the planner's
        prediction, and the step time (the first step, warm-up, is left out once there are
        more). With stages fixed by hand there is no prediction: measured figures only.
        Evaluations are not in it; after one, until the next training step, it is the training
        capture's as it stood (bindings/conveyor/live_profile.py)."""
        if self._step is None:
            raise ConveyorValueError("no step has run yet: nothing to report")
        if not self._trained_steps and self._captures.kept_profile is not None:
            return self._captures.kept_profile  # the capture in use has only evaluated
        return live_profile(self)

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """One whole step: zero the gradients, run the pipeline, apply the optimizer."""
        if self.optimizer is None:
            raise ConveyorValueError("train_step needs the optimizer: conveyor.Module(model, optimizer)")
        if not self.training:  # before anything is zeroed or captured for eval mode
            raise ConveyorValueError("train_step trains: call model.train() first")
        self.optimizer.zero_grad(set_to_none=True)
        if is_packed(args, kwargs):
            loss, _ = run_packed(self, args[0], hold_gradients=False)
            self.optimizer.step()
            return loss.detach()
        self._captures.take_up(self, args, kwargs)  # train mode: captures or raises
        inputs = self._graph.flatten_inputs(args, kwargs)
        self._maybe_replan()
        plan_for_larger_sizes(self, [inputs])
        # The loss's gradient is 1 here: the step's gradients go straight to .grad, and on
        # through the inputs that require one (x.grad, or a module before this one).
        step = self._step_for(inputs)
        loss = self._run(step, inputs, hold_gradients=False)
        wanting = [(t, g) for t, g in zip(inputs, step.take_input_gradients()) if g is not None]
        if wanting:
            torch.autograd.backward([t for t, _ in wanting], [g for _, g in wanting])
        self.optimizer.step()
        return loss.detach()

    def extra_repr(self) -> str:
        if self._graph is None:
            return "not built yet (built on the first call)"
        stages, schedule, m, chunks, replicas = self._layout
        text = f"{stages} stages, {schedule}, {m} microbatches" + (f", {chunks} chunks" if chunks > 1 else "")
        return text + (f", replicas {replicas}" if any(r > 1 for r in replicas) else "")
