"""`conveyor.Module`: one line turns a model into a pipelined one.

    model = conveyor.Module(model, optimizer)
    loss = model(x, labels=y)      # every microbatch forward and backward, in the plan's schedule
    loss.backward()                # the parameter gradients, scaled by the incoming gradient
    optimizer.step()               # updates the model's own parameters

On the first call the model is captured, profiled on one microbatch and planned on the
local machine (its CPU split into virtual devices), unless `stages` fixes the cut. Today
the runtime runs every stage in this process with one replica each (replicas, devices and
multi-process come with the actor runtime); the plan it runs is `model.plan`.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from . import _C
from .capture import capture
from .errors import ConveyorValueError, UnsupportedError
from .planning import plan as make_plan, profile

__all__ = ["Module"]


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConveyorValueError(
        f"the model's forward returned {type(output).__name__}, not a loss; return a scalar loss from forward "
        "(or an object with .loss), or pass loss_fn=")


def _loss_wrapper(model: torch.nn.Module, loss_fn, args: tuple, kwargs: dict) -> torch.nn.Module:
    """The model with its scalar loss as the only output and the same argument names (the
    capture needs a plain signature)."""
    pos = [f"arg{i}" for i in range(len(args))]
    call = ", ".join(pos + [f"{k}={k}" for k in kwargs])
    namespace: dict = {}
    exec(f"def forward(self, {', '.join(pos + list(kwargs))}):\n"
         f"    return self._loss(self.model({call}))", namespace)
    cls = type(f"{type(model).__name__}Loss", (torch.nn.Module,), {"forward": namespace["forward"]})
    wrapper = cls()
    wrapper.model = model
    wrapper._loss = loss_fn or _loss_of
    return wrapper


class _PipelinedLoss(torch.autograd.Function):
    """The step already ran backward; backward() hands the stashed gradients to the
    parameters, scaled by the incoming gradient (so loss scaling keeps working)."""

    @staticmethod
    def forward(ctx, loss, stash, *params):
        ctx.stash = stash
        ctx.params = params
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        for p, g in zip(ctx.params, ctx.stash):
            if g is None:
                continue
            g = g * grad.to(g.dtype)
            p.grad = g if p.grad is None else p.grad + g
        return (None, None) + (None,) * len(ctx.params)


def _local_cluster(devices: int) -> str:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8 << 30
    return (f'name = "local"\n[[node]]\ndevices = {devices}\nmemory = {memory // devices}\nspeed = 1.0\n'
            f'[link.intra_node]\nbandwidth = "10 GB/s"\nlatency = "5 us"\n')


class Module(torch.nn.Module):
    """Wraps `model` so that a call trains it pipelined; see the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 stages: int | list | None = None, replicas: int | None = None, microbatches: int | None = None,
                 schedule: str = "auto", devices: int | None = None, cluster: str | None = None,
                 trace: str | os.PathLike | None = None, loss_fn=None, seed: int = 0):
        super().__init__()
        if replicas not in (None, 1):
            raise UnsupportedError("replicas per stage need the actor runtime (not yet available); use replicas=1")
        if schedule not in ("auto", "gpipe", "1f1b", "interleaved"):
            raise ConveyorValueError(f"schedule {schedule!r} is not available in this runtime "
                                     "(expected auto, gpipe, 1f1b or interleaved)")
        self.module = model
        self.optimizer = optimizer
        self._stages = stages
        self._microbatches = microbatches
        self._schedule = schedule
        self._devices = devices or max(2, min(4, os.cpu_count() or 2))
        self._cluster = cluster
        self._loss_fn = loss_fn
        self._seed = seed
        self._trace = trace
        self._steps_run = 0
        self._graph = None
        self._step = None
        self.plan = None

    # -- the model's own state --------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- building ---------------------------------------------------------------------
    def _build(self, args: tuple, kwargs: dict) -> None:
        wrapper = _loss_wrapper(self.module, self._loss_fn, args, kwargs)
        graph = capture(wrapper, args, kwargs)
        inputs = graph.flatten_inputs(args, kwargs)
        batch = next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), 1)
        if isinstance(self._stages, list):
            stage_nodes, schedule, m, chunks = self._stages, self._schedule, self._microbatches or 1, 1
            if schedule == "auto":
                schedule = "1f1b"
        elif isinstance(self._stages, int):
            stage_nodes = graph.random_partition(self._stages, seed=self._seed, keep_node_order=True)
            schedule = "1f1b" if self._schedule == "auto" else self._schedule
            m, chunks = self._microbatches or min(batch, 2 * self._stages), 1
        else:
            m_hint = self._microbatches or 0
            # Microbatches keep at least two samples (BatchNorm needs them), unless fixed.
            sample = max(1, batch // m_hint) if m_hint else min(batch, max(2, batch // (2 * self._devices)))
            small = [a[:sample] if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == batch else a
                     for a in args]
            small_kw = {k: (v[:sample] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v)
                        for k, v in kwargs.items()}
            grads = {p: p.grad for p in self.module.parameters()}
            prof = profile(graph, tuple(small), small_kw)
            for p, g in grads.items():
                p.grad = g
            schedules = ["gpipe", "1f1b", "interleaved"] if self._schedule == "auto" else [self._schedule]
            self.plan = make_plan(graph, prof, self._cluster or _local_cluster(self._devices), batch=batch,
                                  microbatches=m_hint, schedules=schedules, max_replicas=1,
                                  max_microbatches=max(1, batch // 2))
            stage_nodes = self.plan.stage_nodes
            schedule, m, chunks = self.plan.schedule, self.plan.microbatches, self.plan.document["chunks"]
        self._graph = graph
        self._step = _C.PipelineStep(graph.executor, stage_nodes, schedule, m, chunks)
        self._layout = (len(stage_nodes), schedule, m, chunks)

    # -- running ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._graph is None:
            self._build(args, kwargs)
        inputs = self._graph.flatten_inputs(args, kwargs)
        if not (torch.is_grad_enabled() and self.training):
            with torch.no_grad():
                return self._graph(*args, **kwargs)
        params = [p for p in self.module.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss, _, _ = self._step.run(inputs)
            stash = [p.grad for p in params]
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        self._steps_run += 1
        if self._trace is not None and self._steps_run <= 2:  # the second step: past warm-up
            self._step.write_trace(str(self._trace))
        return _PipelinedLoss.apply(loss, stash, *params)

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

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """One whole step: zero the gradients, run the pipeline, apply the optimizer."""
        if self.optimizer is None:
            raise ConveyorValueError("train_step needs the optimizer: conveyor.Module(model, optimizer)")
        self.optimizer.zero_grad(set_to_none=True)
        loss = self(*args, **kwargs)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def extra_repr(self) -> str:
        if self._graph is None:
            return "not built yet (built on the first call)"
        stages, schedule, m, chunks = self._layout
        return f"{stages} stages, {schedule}, {m} microbatches" + (f", {chunks} chunks" if chunks > 1 else "")
