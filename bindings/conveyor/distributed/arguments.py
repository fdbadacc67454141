"""The checks of what a script passes to conveyor.distributed's calls (a process, a peer,
the tensors to send, the device to receive on), made before anything is counted, sent or
taken: a call refused here leaves the job's message numbering as it was, so the script may
correct it and go on."""
from __future__ import annotations

import operator

import torch

from ..errors import ConveyorValueError


def process_number(p) -> int | None:
    """`p` as a process's rank where it is a whole number (an int, numpy's, a 0-d integer
    tensor's; not a bool), else None."""
    if isinstance(p, bool):
        return None
    try:
        return operator.index(p)
    except TypeError:
        return None


def process(p, world_size: int, what: str) -> int:
    """`p`, a process of the job, as an int."""
    q = process_number(p)
    if q is None or not 0 <= q < world_size:
        raise ConveyorValueError(f"{what}={p!r}: expected a process from 0 to {world_size - 1}")
    return q


def peer(p, rank: int, world_size: int, what: str) -> int:
    """`p`, a process of the job other than this one (`rank`), as an int."""
    q = process(p, world_size, what)
    if q == rank:
        raise ConveyorValueError(f"{what}={q} is this process; a process does not send to itself")
    return q


def values(x, what: str) -> tuple[list, bool]:
    """A tensor or a tuple/list of tensors, as a list and whether it was a sequence; a tensor
    that cannot travel as a message (its bytes with a shape and dtype) is refused, naming what
    to send instead."""
    if isinstance(x, torch.Tensor):
        out, sequence = [x], False
    elif isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        out, sequence = list(x), True
    else:
        raise ConveyorValueError(f"{what}: expected a tensor or a tuple of tensors, got {type(x).__name__}")
    for i, t in enumerate(out):
        which = f"{what}: value {i}" if sequence else what
        if t.is_nested:
            raise ConveyorValueError(f"{which} is a nested tensor: send its components (t.unbind()) as a tuple")
        if t.layout != torch.strided:
            raise ConveyorValueError(f"{which} is a {t.layout} tensor: send t.to_dense(), or its indices and values "
                                     "as a tuple of tensors")
        if t.is_quantized:
            raise ConveyorValueError(f"{which} is a quantized tensor ({t.dtype}): send t.int_repr() with its scale "
                                     "and zero point, or t.dequantize()")
        if t.is_meta:
            raise ConveyorValueError(f"{which} is on the meta device and has no data to send")
    return out, sequence


def device(d, call: str):
    """`d`, where a receive's tensors land (None: where recv() puts them by default), checked
    before the message is taken: failing after (a typo, a GPU this process does not see), its
    sender waited out the timeout for the message's gradient."""
    if d is None:
        return None
    try:
        d = torch.device(d)
    except (RuntimeError, TypeError):
        raise ConveyorValueError(f"{call}: device={d!r} is not a device (as 'cpu' or 'cuda:0')") from None
    if d.type not in ("cpu", "cuda"):
        raise ConveyorValueError(f"{call}: device={str(d)!r}: what arrives lands on 'cpu' or a CUDA device")
    if d.type == "cuda" and (not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count()):
        raise ConveyorValueError(f"{call}: device={str(d)!r}, but this process sees "
                                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} GPU(s)")
    return d


def summed(x, call: str) -> torch.Tensor:
    """`x`, what a sum (allreduce, reduce) takes from each process: one tensor."""
    if not isinstance(x, torch.Tensor):
        raise ConveyorValueError(f"{call}: expected a tensor, got {type(x).__name__} (sum each tensor with a call "
                                 "of its own)")
    return x


def one_per_process(xs, size: int, call: str, each=values) -> list:
    """`xs`, a value per process of a group of `size` (a list or tuple; `each` checks them)."""
    if not isinstance(xs, (list, tuple)) or len(xs) != size:
        got = f"{len(xs)} values" if isinstance(xs, (list, tuple)) else f"a {type(xs).__name__}"
        raise ConveyorValueError(f"{call}: expected a list of {size} values, one per process of the group; got {got}")
    for x in xs:
        each(x, call)
    return list(xs)
