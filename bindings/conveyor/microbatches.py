"""Packed microbatches: one training step over microbatches the caller made, each of its own
size (docs/design.md, "Packed microbatches").

A data loader that buckets sequences by length, or packs them into rows of a token budget,
yields microbatches that differ in rows and in sequence length. Concatenating them into one
batch would pad every row to the longest; `conveyor.Microbatches` runs them as they are:

    step = conveyor.Microbatches([dict(input_ids=a, labels=a), dict(input_ids=b, labels=b)])
    loss = model.train_step(step)          # or model(step).backward(); optimizer.step()

Each microbatch is one microbatch of the pipeline's schedule (its replicas split its rows),
checked against the capture (its symbolic sizes within their ranges) before anything runs.
The step's loss is every microbatch's loss weighted by its rows over the step's, so its
gradients are those of eager training on the same microbatches with the same weights:
sum_k loss(mb_k) * rows_k / sum_j rows_j.
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import ConveyorValueError
from .memory import reset_device_peak
from .plan_maker import plan_for_larger_sizes


class Microbatches:
    """The microbatches of one step, each a dict (keyword arguments), a tuple (positional
    arguments) or a pair (args tuple, kwargs dict) of the model's call."""

    def __init__(self, items):
        self.calls: list[tuple[tuple, dict]] = []
        for k, item in enumerate(list(items)):
            if isinstance(item, dict):
                self.calls.append(((), dict(item)))
            elif (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple)
                  and isinstance(item[1], dict)):
                self.calls.append((item[0], dict(item[1])))
            elif isinstance(item, tuple):
                self.calls.append((item, {}))
            else:
                raise ConveyorValueError(f"microbatch {k} is a {type(item).__name__}: give a dict of keyword "
                                         "arguments, a tuple of positional ones, or (args, kwargs)")
        if not self.calls:
            raise ConveyorValueError("Microbatches needs at least one microbatch")

    def __len__(self) -> int:
        return len(self.calls)

    def rows(self) -> list[int]:
        """Each microbatch's samples: dim 0 of its first tensor with dimensions."""
        out = []
        for args, kwargs in self.calls:
            first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() > 0), None)
            out.append(int(first.shape[0]) if first is not None else 1)
        return out


def is_packed(args: tuple, kwargs: dict) -> bool:
    """Whether a Module call is one step over packed microbatches."""
    return len(args) == 1 and not kwargs and isinstance(args[0], Microbatches)


def run_packed(module, packed: Microbatches, hold_gradients: bool) -> tuple[torch.Tensor, Any]:
    """Runs one step of `module` (a conveyor.Module) over `packed`; returns the loss and the
    pipeline that ran it. A Module not built yet is built for this step: captured on its first
    microbatch, planned for its microbatches, rows and largest sizes.
    The plan's pipeline runs it when its microbatch count matches; on one process, else one
    over the same stages and replicas with as many microbatches as were packed."""
    if not (torch.is_grad_enabled() and module.training):
        raise ConveyorValueError("Microbatches are one training step; to evaluate, call the model on each batch")
    first_args, first_kwargs = packed.calls[0]
    module._captures.select(module, first_args, first_kwargs)
    if module._graph is None:
        module._build(first_args, first_kwargs, packed)
    graph = module._graph
    flat = [graph.flatten_inputs(args, kwargs) for args, kwargs in packed.calls]
    if any(isinstance(t, torch.Tensor) and t.requires_grad for inputs in flat for t in inputs):
        raise ConveyorValueError("an input of the packed microbatches requires a gradient, which a packed step does "
                                 "not compute; pass inputs that need gradients as one batch (model(x) or "
                                 "train_step(x))")
    module._maybe_replan()
    plan_for_larger_sizes(module, flat)
    stages, schedule, m, chunks, replicas = module._layout
    k = len(packed)
    step = module._step
    if k != m:
        if module._group is not None:
            raise ConveyorValueError(f"packed {k} microbatches but the plan runs {m} a step across processes; pack "
                                     f"{m} (model.microbatches), or fix microbatches={k} when making the Module")
        ranks = len(replicas)
        if chunks > 1 and k % ranks:
            raise ConveyorValueError(f"the {schedule} schedule runs a multiple of {ranks} microbatches; packed {k}")
        if ("packed", k) not in module._small_steps:
            module._small_steps[("packed", k)] = module._make_pipeline(graph, module._stage_nodes, schedule, k, chunks,
                                                                       replicas, across_processes=False)
        step = module._small_steps[("packed", k)]
    reset_device_peak(graph)
    loss, _, _ = step.run_packed(flat, hold_gradients=hold_gradients)
    module._steps_run += 1
    module._trained_steps += 1
    if step is module._step and module._replanning is not None:
        module._replanning.steps += 1
    return loss, step
