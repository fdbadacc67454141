"""`conveyor.Module`: one line turns a model into a pipelined one.

    model = conveyor.Module(model, optimizer)
    loss = model(x, labels=y)      # every microbatch forward and backward, in the plan's schedule
    loss.backward()                # the parameter gradients, scaled by the incoming gradient
    optimizer.step()               # updates the model's own parameters

A model whose forward returns outputs, not a loss, takes `loss_fn=`, and a call's `target=`
goes to `loss_fn(output, target)`: `conveyor.Module(net, opt, loss_fn=nn.CrossEntropyLoss())`,
then `loss = model(x, target=y)`. The first call captures the model, profiles it on one
microbatch and plans it for this machine (its CPU as `devices` virtual devices) or a
`cluster` file's, unless `stages` lists the cut; `model.plan` is the plan it runs.

Under a launcher (`conveyor launch -n N -- python train.py`, or torchrun's RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT) the same script runs across the N processes, one
device each: every process runs its share of the stage replicas and holds only the
parameters its stages read; every call is collective and every process must be fed the
same batches. `save_checkpoint` and `load_checkpoint` write and read each process's part.

A call under torch.no_grad() evaluates (the forwards alone, same stages and processes);
`model.eval()` has its own capture. Dropout draws from generators seeded by the pipeline's
seed, the step, stage, microbatch and replica: reproducible whatever the placement.

A model too large for one process is built on the meta device (`with torch.device("meta"):
model = GPT(config)`) and passed as usual: each process makes only the tensors its stages
read, initialized by the model's own initializers (or `init=`), or filled by
load_checkpoint / load_pretrained called before the first call.

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
                  is on (bindings/conveyor/planning/plan_maker.py), else gets a warning
    init          a model built on the meta device: init(name, meta_tensor) -> its first
                  values, instead of the model's own initializers (bindings/conveyor/materialize.py)
"""
from __future__ import annotations

import os

import torch

from .capture_set import CaptureSet
from .capture_state import CaptureState, RunHistory
from .checkpoint_io import CheckpointIO
from .errors import ConveyorValueError
from .job import Job
from .live_profile import LiveProfile, live_profile
from .loss_wrapper import loss_wrapper
from .materialize import adopt_meta_model, check_meta_model
from .options import resolve_options
from .planning import Plan
from .step_runner import StepRunner

__all__ = ["Module"]


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
                 max_sizes: dict | None = None, init=None):
        super().__init__()
        check_meta_model(model, optimizer, init)
        meta_shapes = adopt_meta_model(model, optimizer)  # its tensors made after planning, each where read
        options = resolve_options(model, optimizer, stages=stages, replicas=replicas, microbatches=microbatches,
                                  schedule=schedule, devices=devices, cluster=cluster, trace=trace, loss_fn=loss_fn,
                                  timeout=timeout, plan=plan, transport=transport, replan=replan,
                                  replan_horizon=replan_horizon, recompute=recompute, max_sizes=max_sizes,
                                  init=init, meta_shapes=meta_shapes)
        self.module = model
        self.optimizer = optimizer
        self.job = Job(options)
        self._loss_fn = options.loss_fn
        self._history = RunHistory()
        self._captures = CaptureSet(model, optimizer, options, self.job, self._history)
        self._steps = StepRunner(self._captures, self.job, optimizer, self._history, options.trace)
        self._checkpoints = CheckpointIO(model, optimizer, self._captures, self.job, self._history)

    # -- what runs --------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job (0 in a single process)."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """Processes in the job (1 in a single process)."""
        return self.job.world_size

    @property
    def capture(self) -> CaptureState | None:
        """The capture in use (its graph, plan, pipeline, layout, stage_nodes and
        planned_sizes); None before the first call."""
        return self._captures.current

    @property
    def capture_count(self) -> int:
        """How many captures of the model exist (one per mode, and per fixed size met)."""
        return len(self._captures)

    @property
    def plan(self) -> Plan | None:
        """The plan the capture in use runs (None before the first call, or for node lists)."""
        return self.capture.plan if self.capture is not None else None

    @property
    def microbatches(self) -> int:
        """Microbatches per step of the running plan (built on the first call)."""
        return self._built().layout.microbatches

    @property
    def replans(self) -> list[dict]:
        """One entry per switch of plan: step, old and new (plan summaries), reason, the
        decision's arithmetic, predicted_gain_s per step, move_s and move_bytes (measured),
        step_before_s, and once the next window is measured measured_step_s and
        measured_gain_s."""
        return self._history.switches

    def _built(self, what: str = "the pipeline is built on the first call") -> CaptureState:
        if self.capture is None or self.capture.pipeline is None:
            raise ConveyorValueError(what)
        return self.capture

    # -- the model's own state --------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: across processes the norm
        counts every parameter's gradient once (in the process that owns it) and is the same
        on every process (collective: call it on every process). Returns the total norm."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        group = self.job.group
        if group is None or self.capture is None or self.capture.pipeline is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        if norm_type != 2.0:
            raise ConveyorValueError("across processes clip_grad_norm_ takes norm_type=2 for now")
        owners = self.capture.pipeline.owners()
        mine = {t.data_ptr() for name, t in self.capture.graph.tensors.items() if owners.get(name) == group.rank}
        total = torch.zeros(1, dtype=torch.float64)
        for p in params:
            if p.data_ptr() in mine:
                total += p.grad.detach().double().pow(2).sum().cpu()
        group.allreduce(total)
        norm = total.sqrt()[0]
        scale = max_norm / (norm.item() + 1e-6)
        if scale < 1:
            for p in params:
                p.grad.mul_(scale)
        return norm.to(params[0].dtype if params else torch.float32)

    def state_dict(self, *args, **kwargs):
        """The model's state dict; across processes every part gathered from its owner into
        every process (collective), so the whole model must fit each process: for a job's
        checkpoints use save_checkpoint, which writes each part from its owner alone."""
        self._captures.gather_whole_model()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As torch's; across processes every tensor is made whole first (collective). For a
        job's checkpoints use load_checkpoint, which reads each process's part alone."""
        self._captures.gather_whole_model()  # across processes: every tensor whole, so every one takes its value
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- checkpoints and pretrained weights (checkpoint.py, pretrained.py) ---------------
    def save_checkpoint(self, path, *, extra: dict | None = None, background: bool = False):
        """Writes the folder `path` in PyTorch's distributed checkpoint format: each process
        the parameters, buffers and optimizer state it owns, each once; beside them the step
        count, the plan, the optimizer's param groups, torch's random state and `extra` (a
        data loader's position, an LR scheduler's state_dict). Complete only once every
        process has written its part (collective: call it on every process). background=True
        copies this process's part and returns while a thread writes it (the cost: one more
        copy of the part in memory): the returned save's `.wait()` waits for it, as the next
        save or load does, and raises what failed."""
        return self._checkpoints.save(path, extra, background)

    def load_checkpoint(self, path) -> dict:
        """Reads a save_checkpoint folder, written on any plan and process count, into this
        model and its optimizer: each process only the tensors its stages read. Before the
        first call it is checked now and read once the plan exists. Returns its `extra`."""
        return self._checkpoints.load(path)

    def load_pretrained(self, folder) -> None:
        """Reads a transformers save_pretrained folder (safetensors) into this model as
        load_checkpoint reads a checkpoint: checked now, each process reading its tensors alone."""
        self._checkpoints.load_pretrained(folder)

    def save_pretrained(self, folder) -> None:
        """Writes `folder` as transformers' save_pretrained does, from_pretrained's to read: each
        process a shard of what it owns (collective: call it on every process)."""
        self._checkpoints.save_pretrained(folder)

    # -- running ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        found = self._steps.calls_of(args, kwargs)
        if found is None:  # an eval mode that cannot be captured: the model whole, as eager
            self._captures.gather_whole_model()
            return loss_wrapper(self.module, self._loss_fn, args, kwargs)(*args, **kwargs)
        calls, packed = found
        self._checkpoints.run_waiting()
        if not torch.is_grad_enabled() and not packed:
            return self._steps.evaluate(calls[0])  # the forwards alone, through the same stages and processes
        loss, pipeline = self._steps.train(calls, packed, hold_gradients=True)
        params = [p for p in self.module.parameters() if p.requires_grad]
        # Inputs that require a gradient get the step's, through autograd (a module before
        # this one trains; x.grad fills).
        wanting = [] if packed else [(t, g) for t, g in zip(calls[0], pipeline.take_input_gradients())
                                     if g is not None]
        return _PipelinedLoss.apply(loss, pipeline.take_held_gradients(), [g for _, g in wanting], len(params),
                                    *params, *[t for t, _ in wanting])

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """One whole step: zero the gradients, run the pipeline, apply the optimizer."""
        if self.optimizer is None:
            raise ConveyorValueError("train_step needs the optimizer: conveyor.Module(model, optimizer)")
        if not self.training:  # before anything is zeroed or captured for eval mode
            raise ConveyorValueError("train_step trains: call model.train() first")
        self.optimizer.zero_grad(set_to_none=True)
        calls, packed = self._steps.calls_of(args, kwargs)  # train mode: captures or raises
        self._checkpoints.run_waiting()
        # The loss's gradient is 1 here: the step's gradients go straight to .grad, and on
        # through the inputs that require one (x.grad, or a module before this one).
        loss, pipeline = self._steps.train(calls, packed, hold_gradients=False)
        wanting = [] if packed else [(t, g) for t, g in zip(calls[0], pipeline.take_input_gradients())
                                     if g is not None]
        if wanting:
            torch.autograd.backward([t for t, _ in wanting], [g for _, g in wanting])
        self.optimizer.step()
        return loss.detach()

    def switch_plan(self, plan: Plan) -> None:
        """Runs `plan` (a Plan of this model, e.g. from conveyor.plan or Plan.save) from the next
        step on, over the same parameters and optimizer state; across processes every process
        calls it with the same plan (collective), and parameters, buffers and optimizer state
        move to their new owners. Re-planning (replan="auto") goes on from it."""
        self._built("the pipeline is built on the first call: switch plans after it")
        if not isinstance(plan, Plan):
            raise ConveyorValueError(f"switch_plan takes a conveyor Plan, not {type(plan).__name__}")
        self._steps.switch_plan(plan)

    # -- what it measured -------------------------------------------------------------
    def write_trace(self, path) -> None:
        """Writes the last step's measured actions as a Perfetto trace (ui.perfetto.dev)."""
        self._built("no step has run yet: nothing to trace").pipeline.write_trace(str(path))

    def profile_report(self) -> LiveProfile:
        """How the running pipeline compares with its plan: every step's measured actions reach
        the pipeline's partitioner actor, which reports per stage the measured forward,
        backward, weight-gradient, transfer and allreduce times against the planner's
        prediction, and the step time (the first step, warm-up, is left out once there are
        more). With stages fixed by hand there is no prediction: measured figures only.
        Evaluations are not in it; after one, until the next training step, it is the training
        capture's as it stood (bindings/conveyor/live_profile.py)."""
        state = self._built("no step has run yet: nothing to report")
        if not state.trained_steps and self._captures.kept_profile is not None:
            return self._captures.kept_profile  # the capture in use has only evaluated
        return live_profile(state, self.optimizer, self._history.switches)

    def extra_repr(self) -> str:
        if self.capture is None:
            return "not built yet (built on the first call)"
        stages, schedule, m, chunks, replicas = self.capture.layout
        text = f"{stages} stages, {schedule}, {m} microbatches" + (f", {chunks} chunks" if chunks > 1 else "")
        return text + (f", replicas {replicas}" if any(r > 1 for r in replicas) else "")
