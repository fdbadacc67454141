"""Modules placed on processes, run in order, what one returns crossing to the processes of
those that read it: conveyor.distributed's ready-made model parallelism, ChainerMN's
MultiNodeChainList (whose links take `rank_in` and `rank_out` lists; here every process
builds the whole list the same way and names what each module reads).
"""
from __future__ import annotations

import torch

from ..errors import ConveyorValueError
from .arguments import process_number
from .communication import rank, recv, send, world_size

__all__ = ["Sequential"]


class Sequential(torch.nn.Module):
    """`Sequential([(encoder, 0), (decoder, 1)])`: each module on its process, in order; what
    one returns (a tensor or a tuple of tensors) goes to the next. A module may read others
    than the one before it: `(module, rank, inputs)`, `inputs` a list of earlier modules'
    indices, or None for the Sequential's input, each one positional argument in that order
    (default: the module before; the first module reads the input). So a model may branch
    and join across processes:

        Sequential([(stem, 0), (left, 1, [0]), (right, 2, [0]), (join, 0, [1, 2])])

    An output crosses once to each other process that reads it (to the reader's process, in
    the order the modules run, so no process waits for one that waits for it). Only this
    process's modules are registered, so `parameters()` are its own to optimize.
    `forward(x)`: `x` is the input, given on the processes of the modules that read it;
    returns the last module's output on its process, None elsewhere. Train with
    `conveyor.distributed.backward(loss)` on the last module's process and `backward()` on
    the others."""

    def __init__(self, layers):
        super().__init__()
        n = world_size()
        self.layers = []
        for i, layer in enumerate(layers):
            if not isinstance(layer, (tuple, list)) or len(layer) not in (2, 3):
                raise ConveyorValueError(f"Sequential: item {i} must be (module, rank) or (module, rank, inputs)")
            module, place = layer[0], layer[1]
            inputs = list(layer[2]) if len(layer) == 3 else [i - 1 if i > 0 else None]
            if not isinstance(module, torch.nn.Module):
                raise ConveyorValueError(f"Sequential: item {i} holds a {type(module).__name__}, not an nn.Module")
            place = process_number(place)
            if place is None or not 0 <= place < n:
                raise ConveyorValueError(f"Sequential: item {i}'s rank {layer[1]!r} is not a process of this job of {n}")
            for j in inputs:
                if j is not None and (isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < i):
                    raise ConveyorValueError(f"Sequential: item {i} reads {j!r}: expected an earlier item's index "
                                             f"(0 to {i - 1}) or None for the input")
            self.layers.append((module, place, inputs))
        # readers[j]: the other processes that read item j's output, in ascending order
        self.readers = [sorted({self.layers[i][1] for i in range(len(self.layers)) if j in self.layers[i][2]}
                               - {self.layers[j][1]}) for j in range(len(self.layers))]
        self.local = torch.nn.ModuleList([m for m, place, _ in self.layers if place == rank()])

    def forward(self, x=None):
        me, values = rank(), {}  # values: item -> its output, computed here or received
        for i, (module, place, inputs) in enumerate(self.layers):
            if place != me:
                continue
            out = module(*[x if j is None else self._output_of(j, values) for j in inputs])
            values[i] = out
            for reader in self.readers[i]:
                send(out, reader)
        last = len(self.layers) - 1
        return values.get(last) if self.layers[last][1] == me else None

    def _output_of(self, j: int, values: dict):
        """Item j's output here: received from its process, which sends each output it owes
        this process in item order, so the ones before j are taken (and kept) first."""
        if j not in values:
            source, me = self.layers[j][1], rank()
            for k in range(j + 1):
                if k not in values and self.layers[k][1] == source and me in self.readers[k]:
                    values[k] = recv(source)
        return values[j]
