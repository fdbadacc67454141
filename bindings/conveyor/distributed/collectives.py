"""Collectives for models split by hand, as the sends and receives they are
(communication.py), so their backward pairs fall out: bcast's gradient is the sum at
the root, reduce's is a bcast from it, gather and scatter pair, allgather's is a
reduce-scatter, alltoall pairs with itself, allreduce with allreduce. Each runs over the
whole job, or over a group of its processes (`group=`, groups.py).

Where a process's graph is connected (its loss reads the collective's output), plain
`loss.backward()` works as with torch.distributed.nn: the part of the output that is the
process's own (allgather's own tensor or tuple, bcast's at the root, alltoall's and
scatter's own part) comes out of one autograd node (`_Connected`) tied to every tensor the
process sent in the call, whose backward waits for the gradients the receivers return and
adds them.
It is made after the call's sends and before its receives, so autograd, which runs nodes
in the reverse of their making, returns the received parts' gradients first and then waits:
the reverse of the call's program order, as backward()'s replay does (docs/design.md,
"Differentiable communication"). Inside backward() the replay applies those gradients and
the node waits for nothing.
"""
from __future__ import annotations

import functools

import torch

from ..errors import ConveyorValueError
from . import arguments, records
from . import communication as c
from . import trace as tracing
from .groups import Group, whole_job

__all__ = ["bcast", "gather", "scatter", "allgather", "alltoall", "reduce", "reduce_scatter", "allreduce", "barrier"]


def _traced(f):
    """A collective, as one span of the job's trace around its messages' (where it traces)."""
    @functools.wraps(f)
    def call(*args, **kwargs):
        with tracing.span(c._job().trace, tracing.CALL, label=f.__name__):
            return f(*args, **kwargs)
    return call


class _Connected(torch.autograd.Function):
    """`own` (its first `count` inputs; copies where `copy`), tied to the tensors sent in the
    call that need a gradient (the rest, in the order of `sends`, their records): outside a replay
    its backward adds what their receivers return. A copy for what the caller gets: autograd
    treats an input returned by a custom Function as a view of it, and refuses an in-place op
    on such a view (`bcast(x, root)` then `y.div_(2)` failed at the root alone). A sum
    (allreduce) reads the view instead."""

    @staticmethod
    def forward(ctx, sends, copy, count, *own_and_sent):
        ctx.sends = sends
        own = own_and_sent[:count]
        out = tuple(t.clone() if copy else t.view_as(t) for t in own)
        ctx.mark_non_differentiable(*[o for o in out if not (o.is_floating_point() or o.is_complex())])
        return out

    @staticmethod
    def backward(ctx, *grads):
        st = c._state
        if st is None or st.replay is not None:  # the replay applies the receivers' gradients itself
            remote = [None] * sum(len(r.edges) for r in ctx.sends)
        else:
            remote = records.consume_answers(st, ctx.sends)
        return (None, None, None, *grads, *remote)


def _connect(own, sent: list, sends: list, copy: bool = True):
    """A copy of `own` (a tensor or a tuple of them), tied (_Connected) to the tensors of this
    call's sends (`sent`, what each of the records `sends` sent) that need a gradient. A copy, as the
    parts received are new tensors: writing the output in place never writes the caller's
    tensor, on whichever process (as torch.distributed.nn). Not a copy (`copy` False) where
    the caller only sums it into a new tensor."""
    pairs = [(x, r) for x, r in zip(sent, sends) if r is not None]
    if not pairs:
        return _copy(own) if copy else own
    tied = [t for x, _ in pairs for t in ([x] if isinstance(x, torch.Tensor) else x) if t.requires_grad]
    mine = [own] if isinstance(own, torch.Tensor) else list(own)
    out = _Connected.apply([r for _, r in pairs], copy, len(mine), *mine, *tied)
    return out[0] if isinstance(own, torch.Tensor) else tuple(out)


def _copy(x):
    """A copy of a tensor, or of each of a tuple's."""
    return x.clone() if isinstance(x, torch.Tensor) else tuple(t.clone() for t in x)


def _members(st, group, call: str) -> Group:
    """The group a collective runs over (the whole job for None), which this process is in."""
    if group is None:
        return whole_job(st.group.rank, st.group.world_size)
    if not isinstance(group, Group):
        raise ConveyorValueError(f"{call}: group={group!r}: expected a conveyor.distributed.new_group(ranks)")
    if group.ranks[-1] >= st.group.world_size:
        raise ConveyorValueError(f"{call}: {group} is not of this job of {st.group.world_size} processes")
    if st.group.rank not in group:
        raise ConveyorValueError(f"{call}: process {st.group.rank} is not in {group}: only its processes call its "
                                 "collectives")
    return group


def _others(st, g: Group) -> list:
    return [p for p in g.ranks if p != st.group.rank]


def _root(st, g: Group, root, call: str) -> int:
    root = arguments.process(root, st.group.world_size, "root")
    if root not in g:
        raise ConveyorValueError(f"{call}: root={root} is not in {g}")
    return root


def _device_of(x):
    return x.device if isinstance(x, torch.Tensor) else x[0].device


@_traced
def bcast(x, root: int, device=None, group=None):
    """`x` of process `root`, on every process of `group` (the job by default; pass None
    elsewhere; it arrives on `device`, by default where recv() puts it). Backward: the
    gradients of every process summed at the root."""
    st = c._job()
    g = _members(st, group, "bcast")
    root = _root(st, g, root, "bcast")
    if st.group.rank == root:
        others = _others(st, g)
        return _connect(x, [x] * len(others), [c._send(x, p, "bcast", g.mask) for p in others])
    return c._recv(root, device, "bcast", g.mask)


@_traced
def gather(x, root: int, group=None):
    """Every process's `x`, as a list in rank order over `group` (the job by default), at
    `root` (None elsewhere). Backward: each gradient scattered back to its process."""
    st = c._job()
    return _gather(st, _members(st, group, "gather"), x, root, "gather")


def _gather(st, g: Group, x, root: int, call: str, copy: bool = True):
    root = _root(st, g, root, call)
    if st.group.rank != root:
        c._send(x, root, call, g.mask)
        return None
    return [(_copy(x) if copy else x) if p == root else c._recv(p, _device_of(x), call, g.mask) for p in g.ranks]


@_traced
def scatter(xs, root: int, device=None, group=None):
    """The process at place i of `group` (the job by default) gets `xs[i]` of process `root`
    (pass None elsewhere; it arrives on `device`, by default where recv() puts it). Backward:
    the gradients gathered at the root."""
    st = c._job()
    g = _members(st, group, "scatter")
    root = _root(st, g, root, "scatter")
    if st.group.rank != root:
        return c._recv(root, device, "scatter", g.mask)
    xs = arguments.one_per_process(xs, g.size, "scatter")
    sent = [(xs[i], p) for i, p in enumerate(g.ranks) if p != root]
    return _connect(xs[g.rank], [x for x, _ in sent], [c._send(x, p, "scatter", g.mask) for x, p in sent])


@_traced
def allgather(x, group=None):
    """Every process's `x`, as a list in rank order over `group` (the job by default), on each
    of them. Backward: each process's gradient is the sum of every process's gradient for its
    `x` (reduce-scatter)."""
    st = c._job()
    return _allgather(st, _members(st, group, "allgather"), x, "allgather")


def _allgather(st, g: Group, x, call: str, copy: bool = True):
    others = _others(st, g)
    own = _connect(x, [x] * len(others), [c._send(x, p, call, g.mask) for p in others], copy)
    return [own if p == st.group.rank else c._recv(p, _device_of(x), call, g.mask) for p in g.ranks]


@_traced
def alltoall(xs, group=None):
    """The process at place i of `group` (the job by default) gets `xs[i]` of each of them,
    as a list in rank order. Backward: the gradients exchanged the other way (alltoall)."""
    st = c._job()
    return _alltoall(st, _members(st, group, "alltoall"), xs, "alltoall")


def _alltoall(st, g: Group, xs, call: str, copy: bool = True, each=arguments.values):
    """alltoall() as part of `call`; `each` checks every value of `xs` (a sum's: a tensor)."""
    xs = arguments.one_per_process(xs, g.size, call, each)
    me = g.rank
    sent = [(xs[i], p) for i, p in enumerate(g.ranks) if i != me]
    own = _connect(xs[me], [x for x, _ in sent], [c._send(x, p, call, g.mask) for x, p in sent], copy)
    return [own if i == me else c._recv(p, _device_of(xs[me]), call, g.mask) for i, p in enumerate(g.ranks)]


def _sum_in_rank_order(parts, g: Group, call: str):
    """The sum of every process's part, in rank order, a new tensor (a group of one: a copy of
    its part); parts of different shapes (which would broadcast silently) or dtypes (which
    would promote the sum, so one process got another dtype than it gave) are refused naming
    each process's, on every process that sums."""
    for what, of in (("shape", lambda t: list(t.shape)), ("dtype", lambda t: t.dtype)):
        each = [of(t) for t in parts]
        if any(e != each[0] for e in each):
            raise ConveyorValueError(f"{call}: the processes' tensors differ in {what}: "
                                     + ", ".join(f"process {p} {e}" for p, e in zip(g.ranks, each)))
    if len(parts) == 1:
        return parts[0].clone()
    total = parts[0]
    for t in parts[1:]:
        total = total + t
    return total


@_traced
def reduce(x, root: int, group=None):
    """The sum of every process's `x` over `group` (the job by default; summed in rank order)
    at `root` (None elsewhere). Backward: the root's gradient to every process (bcast); a
    process other than the root holds no output, and calls backward()."""
    st = c._job()
    g = _members(st, group, "reduce")
    arguments.summed(x, "reduce")
    parts = _gather(st, g, x, root, "reduce", copy=False)
    return None if parts is None else _sum_in_rank_order(parts, g, "reduce")


@_traced
def reduce_scatter(xs, group=None):
    """The process at place i of `group` (the job by default) gets the sum over them of their
    `xs[i]` (summed in rank order). Backward: the gradient goes to every process's `xs[i]`
    (allgather)."""
    st = c._job()
    g = _members(st, group, "reduce_scatter")
    parts = _alltoall(st, g, xs, "reduce_scatter", copy=False, each=arguments.summed)
    return _sum_in_rank_order(parts, g, "reduce_scatter")


# An allreduce of at least this many bytes among 3 or more processes runs as reduce_scatter
# then allgather (below this, or between 2, one exchange of whole tensors was as fast or
# faster: at 1 MB among 3 processes the two were within noise, at 256 KB whole was faster).
SPLIT_ALLREDUCE_BYTES = 4 << 20


@_traced
def allreduce(x, group=None):
    """The sum of every process's `x` over `group` (the job by default; summed in rank order),
    on each of them. Backward: the gradients summed the same way (allreduce).

    Between 2 processes, or below SPLIT_ALLREDUCE_BYTES, every process sends its whole `x`
    to each other and sums them. Larger, among 3 or more, it is reduce_scatter of `x`'s
    flattened parts, then allgather of the summed parts: each process sends 2 (n - 1) / n of
    `x` instead of n - 1 times it and sums 1/n of it, the same sums in the same order. Among
    3 processes of a 2-core host (`./run bench distributed --processes 3`), 1.3-1.4x faster at
    16 MB and 1.6x at 64 MB, where it now matches gloo's ring (0.92-1.00x; whole: 0.54-0.60x)."""
    st = c._job()
    g = _members(st, group, "allreduce")
    arguments.summed(x, "allreduce")
    if g.size < 3 or x.numel() < g.size or x.numel() * x.element_size() < SPLIT_ALLREDUCE_BYTES:
        return _sum_in_rank_order(_allgather(st, g, x, "allreduce", copy=False), g, "allreduce")
    parts = list(x.reshape(-1).tensor_split(g.size))
    mine = _sum_in_rank_order(_alltoall(st, g, parts, "allreduce", copy=False), g, "allreduce")
    return torch.cat(_allgather(st, g, mine, "allreduce", copy=False)).view(x.shape)


@_traced
def barrier(group=None) -> None:
    """Returns once every process of `group` (the job by default) has called it: an
    allreduce of one number, outside any graph."""
    with torch.no_grad():
        allreduce(torch.zeros(1, dtype=torch.int32), group)
