"""Every process's value, in process order: the one small collective the Python side uses
(checkpoints, pretrained weights, the batch check, fingerprints, clipping's infinity norm).

Each value travels with what the caller is doing (`what`). A process that is doing something
else at that moment (one process saving a checkpoint while another trains) receives a value
of another kind, and every process that notices refuses at once, naming both calls, rather
than misreading the bytes."""
from __future__ import annotations

import pickle

from .errors import ConveyorValueError

__all__ = ["exchange"]


def exchange(group, value, what: str) -> list:
    """Every process's `value` (picklable), in process order; one process alone: [value]."""
    if group is None:
        return [value]
    mine = pickle.dumps((what, value))
    out = []
    for root in range(group.world_size):
        their_what, their_value = pickle.loads(group.broadcast_bytes(root, mine if root == group.rank else b""))
        if their_what != what:
            raise ConveyorValueError(f"process {root} is in {their_what} while process {group.rank} is in {what}: "
                                     "every process must make the same calls in the same order (call it on every "
                                     "process, not only on one)")
        out.append(their_value)
    return out
