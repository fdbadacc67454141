"""Collectives for models split by hand, as the sends and receives they are
(conveyor/communication.py), so their backward pairs fall out: bcast's gradient is the sum at
the root, gather and scatter pair, allgather's is a reduce-scatter, alltoall pairs with
itself, allreduce with allreduce.

Where a process's graph is connected (its loss reads the collective's output), plain
`loss.backward()` works as with torch.distributed.nn: the part of the output that is the
process's own (allgather's own tensor, bcast's at the root, alltoall's and scatter's own
part) comes out of one autograd node (`_Connected`) tied to every tensor the process sent
in the call, whose backward waits for the gradients the receivers return and adds them.
It is made after the call's sends and before its receives, so autograd, which runs nodes
in the reverse of their making, returns the received parts' gradients first and then waits:
the reverse of the call's program order, as backward()'s replay does (docs/design.md,
"Differentiable communication"). Inside backward() the replay applies those gradients and
the node waits for nothing.
"""
from __future__ import annotations

import torch

from . import communication as c
from .errors import ConveyorValueError

__all__ = ["bcast", "gather", "scatter", "allgather", "alltoall", "reduce_scatter", "allreduce"]


class _Connected(torch.autograd.Function):
    """`own` as it is, tied to the tensors `sent` in the call (one per send record of
    `records`, in order): outside a replay its backward adds what their receivers return."""

    @staticmethod
    def forward(ctx, records, own, *sent):
        ctx.records = records
        return own.view_as(own)

    @staticmethod
    def backward(ctx, grad):
        st = c._state
        if st is None or st.replaying:  # the replay applies the receivers' gradients itself
            return (None, grad) + (None,) * len(ctx.records)
        remote = c._consume_answers(st, ctx.records)
        return (None, grad, *remote)


def _connect(own, sent: list, records: list):
    """`own`, tied (_Connected) to the tensors of this call's sends that need a gradient."""
    pairs = [(t, r) for t, r in zip(sent, records) if r is not None]
    if not pairs or not isinstance(own, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t, _ in pairs):
        return own
    return _Connected.apply([r for _, r in pairs], own, *[t for t, _ in pairs])


def _others(st):
    return [p for p in range(st.group.world_size) if p != st.group.rank]


def _device_of(x):
    return x.device if isinstance(x, torch.Tensor) else x[0].device


def bcast(x, root: int, device=None):
    """`x` of process `root`, on every process (pass None elsewhere; it arrives on `device`,
    by default where recv() puts it). Backward: the gradients of every process summed at the root."""
    st = c._job()
    root = c._process(st, root, "root")
    if st.group.rank == root:
        others = _others(st)
        return _connect(x, [x] * len(others), [c._send(x, p, "bcast") for p in others])
    return c._recv(root, device, "bcast")


def gather(x, root: int):
    """Every process's `x`, as a list in process order, at `root` (None elsewhere). Backward:
    each gradient scattered back to its process."""
    st = c._job()
    root = c._process(st, root, "root")
    if st.group.rank != root:
        c._send(x, root, "gather")
        return None
    return [x if p == root else c._recv(p, _device_of(x), "gather") for p in range(st.group.world_size)]


def scatter(xs, root: int, device=None):
    """Process p gets `xs[p]` of process `root` (pass None elsewhere; it arrives on `device`,
    by default where recv() puts it). Backward: the gradients gathered at the root."""
    st = c._job()
    root = c._process(st, root, "root")
    if st.group.rank != root:
        return c._recv(root, device, "scatter")
    if len(xs) != st.group.world_size:
        raise ConveyorValueError(f"scatter: {len(xs)} values for {st.group.world_size} processes")
    others = _others(st)
    return _connect(xs[root], [xs[p] for p in others], [c._send(xs[p], p, "scatter") for p in others])


def allgather(x):
    """Every process's `x`, as a list in process order, on every process. Backward: each
    process's gradient is the sum of every process's gradient for its `x` (reduce-scatter)."""
    return _allgather(x, "allgather")


def _allgather(x, call: str):
    st = c._job()
    others = _others(st)
    own = _connect(x, [x] * len(others), [c._send(x, p, call) for p in others])
    return [own if p == st.group.rank else c._recv(p, _device_of(x), call) for p in range(st.group.world_size)]


def alltoall(xs):
    """Process p gets `xs[p]` of every process, as a list in process order. Backward: the
    gradients exchanged the other way (alltoall)."""
    return _alltoall(xs, "alltoall")


def _alltoall(xs, call: str):
    st = c._job()
    if len(xs) != st.group.world_size:
        raise ConveyorValueError(f"{call}: {len(xs)} values for {st.group.world_size} processes")
    me, others = st.group.rank, _others(st)
    own = _connect(xs[me], [xs[p] for p in others], [c._send(xs[p], p, call) for p in others])
    return [own if p == me else c._recv(p, _device_of(xs[me]), call) for p in range(st.group.world_size)]


def _sum_in_process_order(parts, call: str):
    """The sum of every process's part, in process order; parts of different shapes (which
    would broadcast silently) are refused naming each process's shape, on every process."""
    shapes = [tuple(t.shape) for t in parts]
    if len(set(shapes)) > 1:
        raise ConveyorValueError(f"{call}: the processes' tensors differ in shape: "
                                 + ", ".join(f"process {p} {list(s)}" for p, s in enumerate(shapes)))
    total = parts[0]
    for t in parts[1:]:
        total = total + t
    return total


def reduce_scatter(xs):
    """Process p gets the sum over processes of their `xs[p]` (summed in process order).
    Backward: the gradient goes to every process's `xs[p]` (allgather)."""
    return _sum_in_process_order(_alltoall(xs, "reduce_scatter"), "reduce_scatter")


def allreduce(x):
    """The sum of every process's `x` (in process order), on every process. Backward: the
    gradients summed the same way (allreduce)."""
    return _sum_in_process_order(_allgather(x, "allreduce"), "allreduce")
