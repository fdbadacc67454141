"""Groups of some of a job's processes, for collectives among them: a model split by hand
two ways at once (each pipeline stage split across processes, its tensor-parallel
collectives over that stage's processes only; or replicas of a stage averaging their
gradients) calls each collective with `group=`.

A group is the set of its processes, in rank order. Making one is local (no message: every
process may make its groups when and where it likes, members or not); only its members call
its collectives, in the same order. Roots are the job's ranks, and lists (gather, scatter,
allgather, alltoall, reduce_scatter) run over the group's processes in rank order. A message
carries its group (a bit per process of the job), so a process in one group's collective
that receives another group's message (or the whole job's) fails naming both groups.
"""
from __future__ import annotations

import functools

from ..errors import ConveyorValueError
from .arguments import process_number
from .processes import world

__all__ = ["Group", "new_group"]

# Bits of a process set per word of a message's flags (int32 words, kept non-negative).
_BITS = 31


class Group:
    """Some processes of the job (new_group): `ranks` in rank order, `size`, and `rank`, this
    process's place among them."""

    def __init__(self, ranks: tuple[int, ...], me: int, world_size: int):
        self.ranks = ranks
        self.size = len(ranks)
        self._me = me
        self.mask = mask(ranks, world_size)  # what its messages carry

    @property
    def rank(self) -> int:
        """This process's place in the group (0 to size - 1)."""
        if self._me not in self.ranks:
            raise ConveyorValueError(f"process {self._me} is not in {self}")
        return self.ranks.index(self._me)

    def __contains__(self, process) -> bool:
        return process in self.ranks

    def __eq__(self, other) -> bool:
        return isinstance(other, Group) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(self.ranks)

    def __repr__(self) -> str:
        return f"group {list(self.ranks)}"


def new_group(ranks=None) -> Group:
    """The group of the job's processes `ranks` (distinct ranks, any order; they are kept in
    rank order; None: every process). Local: no process waits for another to make it."""
    found = world()
    if found is None:
        raise ConveyorValueError("conveyor.distributed.new_group needs the processes of a job: start the script "
                                 "with `conveyor launch -n N -- python script.py`, or as torchrun does")
    me, n = found[0], found[1]
    if ranks is None:
        return whole_job(me, n)
    try:
        ranks = list(ranks)
    except TypeError:
        raise ConveyorValueError(f"new_group({ranks!r}): expected a list of process ranks") from None
    if not ranks:
        raise ConveyorValueError("new_group([]): a group needs at least one process")
    checked = []
    for p in ranks:
        q = process_number(p)
        if q is None or not 0 <= q < n:
            raise ConveyorValueError(f"new_group({ranks}): {p!r} is not a process of this job of {n} (0 to {n - 1})")
        if q in checked:
            raise ConveyorValueError(f"new_group({ranks}): process {q} is named twice")
        checked.append(q)
    return Group(tuple(sorted(checked)), me, n)


@functools.cache
def whole_job(rank: int, world_size: int) -> Group:
    return Group(tuple(range(world_size)), rank, world_size)


def words(world_size: int) -> int:
    """How many words of a message's flags name a set of the job's processes."""
    return (world_size + _BITS - 1) // _BITS


def mask(ranks, world_size: int) -> tuple[int, ...]:
    """The set `ranks` as words of bits (all zero: no group, a point-to-point message)."""
    out = [0] * words(world_size)
    for p in ranks:
        out[p // _BITS] |= 1 << (p % _BITS)
    return tuple(out)


def named(mask_: tuple[int, ...]) -> str:
    """How the group of `mask_` is named in errors: its ranks."""
    return f"group {[w * _BITS + b for w, word in enumerate(mask_) for b in range(_BITS) if word >> b & 1]}"
