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
sum_k loss(mb_k) * rows_k / sum_j rows_j. A loss averaged over counted targets (labels
with ignore_index, counted_targets.py) is the mean over every counted target of the step.
"""
from __future__ import annotations

import torch

from .errors import ConveyorValueError


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
