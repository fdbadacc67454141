"""What each process feeds a call across processes, made the step's one batch.

Two ways, as `conveyor.Module(..., batches=)` says:
- "same" (the default): every process is fed the same whole batch. The first
  `CHECKED_CALLS` calls, then one in `CHECK_EVERY`, compare every process's inputs (their
  structure, shapes, dtypes and a hash of their bytes) and refuse a difference, naming the
  processes that differ and the way to feed shares.
- "shares": each process is fed its own share, as DDP users load data (DistributedSampler):
  the step's batch is every process's share concatenated in process order along dimension 0
  of every tensor input of one dimension or more (what a data loader batches), as DDP's
  semantics are. Every call exchanges the shares (each process sends its own to every other:
  the inputs' bytes cross the network once per process). Shares must agree in everything
  but their first dimension, and inputs of no dimension and other arguments must be equal;
  anything else is refused naming the processes and the input. Inputs that require a
  gradient are refused: the concatenation is a new tensor, which would not carry it back.

One process alone takes its batch as it is.
"""
from __future__ import annotations

import hashlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import ConveyorValueError
from .exchange import exchange

__all__ = ["BatchFeed", "BATCH_MODES", "CHECKED_CALLS", "CHECK_EVERY"]

BATCH_MODES = ("same", "shares")
CHECKED_CALLS = 3
CHECK_EVERY = 50


def _describe(leaves: list, with_hash: bool) -> list:
    """Each leaf as (kind, shape, dtype, hash) for a tensor, or its value's repr."""
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            digest = None
            if with_hash:
                data = leaf.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                digest = hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()
            out.append(("tensor", tuple(leaf.shape), str(leaf.dtype), digest))
        else:
            out.append(("value", repr(leaf)[:200], None, None))
    return out


def _input_name(names: list[str], i: int) -> str:
    return names[i] if i < len(names) else f"input {i}"


def _leaf_names(args: tuple, kwargs: dict) -> list[str]:
    """A readable name per leaf, in tree_flatten's order: positional k, or the keyword."""
    names = []
    for k, a in enumerate(args):
        names += [f"positional argument {k}"] * len(tree_flatten(a)[0])
    for key in kwargs:  # tree_flatten orders a dict's keys as they are
        names += [f"{key}="] * len(tree_flatten(kwargs[key])[0])
    return names


class BatchFeed:
    """Makes each call's inputs the step's batch (see the module docstring)."""

    def __init__(self, job, mode: str):
        self.job, self.mode, self.calls = job, mode, 0

    def whole_batch(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Before the capture: with shares, the step's batch (the job joined first, so that
        the first capture sees the whole batch); else the call's inputs as they are."""
        self.calls += 1
        if self.mode != "shares" or self.job.world is None:
            return args, kwargs
        self.job.join_before_capture()
        leaves, spec = tree_flatten((args, dict(kwargs)))
        return self._concatenated(self.job.group, leaves, spec, _leaf_names(args, kwargs))

    def check(self, args: tuple, kwargs: dict) -> None:
        """After the capture (the job joined): with the same batch everywhere, the sampled check."""
        group = self.job.group
        if self.mode != "same" or group is None or not (self.calls <= CHECKED_CALLS or self.calls % CHECK_EVERY == 0):
            return
        self._check_same(group, tree_flatten((args, dict(kwargs)))[0], _leaf_names(args, kwargs))

    def _check_same(self, group, leaves: list, names: list[str]) -> None:
        described = exchange(group, _describe(leaves, with_hash=True), f"call {self.calls}'s batch check")
        differ = [r for r, d in enumerate(described) if d != described[0]]
        if not differ:
            return
        r = differ[0]
        ours, theirs = described[0], described[r]
        if len(ours) != len(theirs):
            what = f"{len(theirs)} inputs against process 0's {len(ours)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            a, b = ours[i], theirs[i]
            what = (f"{_input_name(names, i)} has other bytes" if a[:3] == b[:3] else
                    f"{_input_name(names, i)} is {b[1]} {b[2] or ''} against process 0's {a[1]} {a[2] or ''}")
        raise ConveyorValueError(
            f"processes {differ} were fed another batch than process 0 (call {self.calls}; process {r}: "
            f"{what.strip()}): with batches='same' (the default) every process must be fed the same whole batch. "
            "If each process loads its own share (a DistributedSampler), pass batches='shares' to conveyor.Module")

    def _concatenated(self, group, leaves: list, spec, names: list[str]) -> tuple[tuple, dict]:
        grads = [_input_name(names, i) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads:
            raise ConveyorValueError(f"{grads[0]} requires a gradient, which batches='shares' cannot carry back to "
                                     "each process's share; feed every process the whole batch (batches='same')")
        shares = exchange(group, [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in leaves],
                          f"call {self.calls}'s shares")
        if any(len(share) != len(leaves) for share in shares):
            raise ConveyorValueError(f"the processes' shares have {[len(share) for share in shares]} inputs: every "
                                     "process must be fed the same kinds of inputs")
        out = []
        for i, mine in enumerate(leaves):
            column = [share[i] for share in shares]
            if not isinstance(mine, torch.Tensor) or mine.dim() == 0:
                differ = [r for r, v in enumerate(column) if not _equal(v, column[0])]
                if differ:
                    raise ConveyorValueError(f"{_input_name(names, i)} differs on processes {differ} from process 0's; "
                                             "with batches='shares' only tensors of one dimension or more are shares "
                                             "(concatenated along dimension 0); the rest must be equal")
                out.append(mine)
                continue
            rest = [tuple(t.shape[1:]) if isinstance(t, torch.Tensor) else None for t in column]
            kinds = [(str(t.dtype), t.dim()) if isinstance(t, torch.Tensor) else None for t in column]
            differ = [r for r in range(len(column)) if rest[r] != rest[0] or kinds[r] != kinds[0]]
            if differ:
                shapes = ", ".join(f"process {r}: {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                                   for r, t in enumerate(column))
                raise ConveyorValueError(
                    f"{_input_name(names, i)}: the processes' shares differ beyond their first dimension ({shapes}): "
                    "shares are concatenated along dimension 0, so pad every process's batches to one length "
                    "(e.g. a fixed max_length, or padding to a multiple) or feed every process the whole batch "
                    "(batches='same')")
            out.append(torch.cat([t.to(mine.device) if r != group.rank else mine for r, t in enumerate(column)]))
        args, kwargs = tree_unflatten(out, spec)
        return tuple(args), kwargs


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return repr(a) == repr(b)
