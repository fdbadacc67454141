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
same batches, or with `batches="shares"` each its own share (a DistributedSampler's).
`save_checkpoint` and `load_checkpoint` write and read each process's part.

A call under torch.no_grad() evaluates (the forwards alone, same stages and processes);
`model.eval()` has its own capture. Dropout draws from generators seeded by the pipeline's
seed, the step, stage, microbatch and replica: reproducible whatever the placement.

A model too large for one process is built on the meta device (`with torch.device("meta"):
model = GPT(config)`) and passed as usual: each process makes only the tensors its stages
read, initialized by the model's own initializers (or `init=`), or filled by
load_checkpoint / load_pretrained called before the first call.

The options are conveyor.options.OPTIONS_HELP, shown by help(conveyor.Module.__init__).
"""
from __future__ import annotations

import os

import torch

from .as_model import model_attribute, shaped_like_model, signed_forward
from .capture_set import CaptureSet
from .capture_state import CaptureState, RunHistory
from .checkpoint_io import CheckpointIO
from .clipping import GradientClipping, route_torch_clip
from .errors import ConveyorValueError
from .job import Job
from .live_profile import LiveProfile, live_profile
from .loss_wrapper import loss_wrapper
from .materialize import adopt_meta_model, check_meta_model
from .options import OPTIONS_HELP, resolve_options
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
                 max_sizes: dict | None = None, init=None, batches: str = "same",
                 verbose: bool = True, returns: str = "loss", guards: bool = True):
        super().__init__()
        check_meta_model(model, optimizer, init)
        meta_shapes = adopt_meta_model(model, optimizer)  # its tensors made after planning, each where read
        options = resolve_options(model, optimizer, stages=stages, replicas=replicas, microbatches=microbatches,
                                  schedule=schedule, devices=devices, cluster=cluster, trace=trace, loss_fn=loss_fn,
                                  timeout=timeout, plan=plan, transport=transport, replan=replan,
                                  replan_horizon=replan_horizon, recompute=recompute, max_sizes=max_sizes,
                                  init=init, meta_shapes=meta_shapes, batches=batches,
                                  verbose=verbose, returns=returns, guards=guards)
        self.module = model
        self.optimizer = optimizer
        self.job = Job(options)
        self._loss_fn = options.loss_fn
        self._returns = options.returns
        self._history = RunHistory()
        self._captures = CaptureSet(model, optimizer, options, self.job, self._history)
        self._steps = StepRunner(self._captures, self.job, optimizer, self._history, options.trace, options.batches)
        self._checkpoints = CheckpointIO(model, optimizer, self._captures, self.job, self._history)
        self._clipping = GradientClipping(model, self._captures, self.job)
        if self.job.world is not None:  # torch's clip_grad_norm_ over this model: the norm across processes
            route_torch_clip(self._clipping)
        signed = signed_forward(self, model, takes_target=options.loss_fn is not None)
        if signed is not None:  # inspect.signature(model.forward) reads the model's parameters (as_model.py)
            self.forward = signed

    __init__.__doc__ = OPTIONS_HELP  # one text of the options, kept in options.py

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
        decision's arithmetic, predicted_gain_s per step, priced_move_bytes (all processes
        together, as the decision priced them), move_s, received_bytes (the parameters,
        buffers and optimizer state this process received) and received_tensor_bytes (of
        them, parameters and buffers), step_before_s, and once the next window is measured
        measured_step_s and measured_gain_s: the step as the caller sees it, from one training call's start to the
        next (the optimizer's step and the caller's loop in it)."""
        return self._history.switches

    def _built(self, what: str = "the pipeline is built on the first call") -> CaptureState:
        if self.capture is None or self.capture.pipeline is None:
            raise ConveyorValueError(what)
        return self.capture

    # -- looking like the model (as_model.py) -------------------------------------------
    accepts_loss_kwargs = False
    """transformers' Trainer passes `num_items_in_batch` to models that accept it, to divide
    a summed loss by the tokens of all its accumulated batches; conveyor's step averages its
    microbatches' losses, so the model computes its own mean and the Trainer averages those."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            if name.startswith("__") or "module" not in self.__dict__.get("_modules", {}):
                raise
        return model_attribute(self._modules["module"], name)

    # -- the model's own state --------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: across processes the norm
        counts every parameter's gradient once (in the process that owns it) and is the same
        on every process (collective: call it on every process). Returns the total norm.
        torch.nn.utils.clip_grad_norm_(model.parameters(), ...) does the same (clipping.py)."""
        return self._clipping.clip(self.module.parameters(), max_norm, norm_type)

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
            wrapper = loss_wrapper(self.module, self._loss_fn, args, kwargs)
            return self._returned(wrapper(*args, **kwargs), wrapper.output_type())
        calls, packed = found
        self._checkpoints.run_waiting()
        output_type = self.capture.graph.output_type
        if not torch.is_grad_enabled() and not packed:
            # The forwards alone, through the same stages and processes.
            return self._returned(self._steps.evaluate(calls[0]), output_type)
        loss, pipeline = self._steps.train(calls, packed, hold_gradients=True)
        # Only the parameters held here: a released one (0 elements, another process's) in the
        # loss's graph keeps its gradient accumulator, with that empty shape, alive as long as
        # the caller's loss is, and a switch that brings the parameter here then failed its
        # next step's backward ("got [272, 192] but expected shape compatible with [0]").
        params = [p for p in self.module.parameters() if p.requires_grad and p.numel()]
        if not params:  # this process holds none: the loss still asks for a backward
            params = [torch.zeros(0, requires_grad=True)]
        # Inputs that require a gradient get the step's, through autograd (a module before
        # this one trains; x.grad fills).
        wanting = [] if packed else [(t, g) for t, g in zip(calls[0], pipeline.take_input_gradients())
                                     if g is not None]
        return self._returned(_PipelinedLoss.apply(loss, pipeline.take_held_gradients(), [g for _, g in wanting],
                                                   len(params), *params, *[t for t, _ in wanting]), output_type)

    def _returned(self, loss: torch.Tensor, output_type):
        """What a call returns: the loss, or with returns="model" the model's output type holding it."""
        return shaped_like_model(loss, output_type) if self._returns == "model" else loss

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
