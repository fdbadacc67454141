"""Data-dependent checks captured under guards.

A model that checks a tensor's values (`if not torch.isfinite(h).all():` in DETR's encoder, a
NaN check, `torch._assert((x >= 0).all(), ...)`, `assert mask.any()`) has no one graph:
torch.export refuses the branch. Where it does, the model runs once eagerly on the example
(no gradients, its buffers and random state restored), which records the truth value of
every tensor tested by `bool()`, by source line. Captured again, each check takes the
example's branch and leaves a `conveyor::guard` node in the graph that tests the same
tensor at run time, on each share of each step: a batch that would take the other branch
stops its step with an error naming the line and what changed ("GuardError: conveyor: a
guard stopped the step"), before any parameter is updated (a `model(x)` call's gradients
are held for its backward, which never comes; train_step's next call zeroes what a failed
one added to `.grad`).

Guarded: the truth value of a result of `all()`, `any()`, `isfinite()`, `isnan()` or
`isinf()`, tested in an `if`, `not`, `and`/`or`, `assert` or `torch._assert`: checks that
real data passes alike on every step. From torch 2.15 torch.export captures `torch._assert`
on a tensor itself (aten._assert_async); such an assertion is made a guard too, so that it
stops a step with the same error and is named in the same warning. Still refused, naming the line: other branches on a
value (`if h.sum() > 0:`, whose outcome changes from batch to batch), `.item()` or `int()`
read as a Python number, and models built on the meta device (nothing to run the example on).
"""
from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
import warnings

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from .errors import CaptureError
from .users_rng import users_rng_kept

__all__ = ["GuardError", "export_attempt_begins", "export_under_guards"]


class GuardError(RuntimeError):
    """A batch took another branch than the capture at a guarded data-dependent check."""


@torch.library.custom_op("conveyor::guard", mutates_args=())
def _guard(predicate: torch.Tensor, expected: bool, where: str) -> None:
    got = bool(predicate)
    if got != expected:
        raise GuardError(
            f"conveyor: a guard stopped the step, before any parameter was updated: {where} tested a tensor that "
            f"was {expected} when the model was captured and is {got} for this batch, so the graph would take a "
            "branch it does not hold. Drop or repair such batches, or write the branch as a tensor operation "
            "(torch.where) so that every batch runs the same graph")


@_guard.register_fake
def _(predicate, expected, where):
    return None


torch.fx.node.has_side_effect(torch.ops.conveyor.guard.default)  # kept although nothing reads it


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _call_site() -> tuple[str, int]:
    """The line that tests the tensor: the innermost caller of Tensor.__bool__ outside torch
    and this file (torch._assert's own `if not condition:` is every caller's)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                        or frame.f_code.co_filename.startswith("<")
                                        or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def _where(site: tuple[str, int]) -> str:
    code = linecache.getline(site[0], site[1]).strip()
    return f"{site[0]}:{site[1]}" + (f" (`{code}`)" if code else "")


@contextlib.contextmanager
def _recording(outcomes: dict):
    """Tensor.__bool__ records (site -> truth values, in call order) into `outcomes`."""
    original = torch.Tensor.__bool__

    def record(self):
        value = original(self)
        outcomes.setdefault(_call_site(), []).append(value)
        return value

    torch.Tensor.__bool__ = record
    try:
        yield
    finally:
        torch.Tensor.__bool__ = original


_CHECKS = {"all", "any", "isfinite", "isnan", "isinf"}


class _MarkingChecks(TorchFunctionMode):
    """Marks the boolean results of _CHECKS (methods and functions alike): the tensors whose
    truth value is a check."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in _CHECKS and isinstance(out, torch.Tensor) and out.dtype == torch.bool:
            out._conveyor_check = True
        return out


_replays: list = []  # a restart for each _taking under way: its outcomes and guards from the first again


def export_attempt_begins() -> None:
    """A torch.export attempt starts tracing the model from its first line: a capture tries
    several (a symbolic batch, a narrower range, fixed sizes), and each must meet the checks
    with the example's outcomes from the first, not with what an earlier attempt left."""
    for restart in _replays:
        restart()


@contextlib.contextmanager
def _taking(outcomes: dict, guarded: list):
    """Tensor.__bool__ on a traced tensor whose value is unknown takes the recorded outcome of
    its site and leaves a guard in the graph (its site appended to `guarded`); each export
    attempt (export_attempt_begins) takes them from the first."""
    original = torch.Tensor.__bool__
    queues: dict = {}

    def restart():
        queues.clear()
        queues.update({site: list(values) for site, values in outcomes.items()})
        guarded.clear()

    restart()

    def take(self):
        site = _call_site()
        queue = queues.get(site) or []
        known = not is_fake(self) or getattr(self, "constant", None) is not None
        if not queue or known or not getattr(self, "_conveyor_check", False):
            if queue:
                queue.pop(0)
            return original(self)  # known while tracing, not a check (refused), or never reached
        expected = bool(queue.pop(0))
        torch.ops.conveyor.guard(self, expected, _where(site))
        if site not in guarded:
            guarded.append(site)
        return expected

    torch.Tensor.__bool__ = take
    _replays.append(restart)
    try:
        with _MarkingChecks():
            yield
    finally:
        _replays.remove(restart)
        torch.Tensor.__bool__ = original


def _branches_on_a_value(error: BaseException) -> bool:
    cause = error.__cause__ or error
    text = f"{type(cause).__name__}: {cause}".lower()
    if "extract specialized integer" in text or "trunctoint" in text:
        return False  # a size drawn from a tensor: no guard makes one graph of it
    return "data-dependent" in text or "data dependent" in text or "guard on data" in text


def _outcomes_of_the_example(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """The truth values the example gives every tensor tested by bool(), by site; None for a
    model on the meta device, or where the eager run fails."""
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.is_meta for t in tensors):
        return None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    outcomes: dict = {}
    try:
        with users_rng_kept(model), torch.no_grad(), _recording(outcomes):
            model(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the capture's own error is the one to report
        return None
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return outcomes


def export_under_guards(export, model: torch.nn.Module, args: tuple, kwargs: dict, *more):
    """`export(model, args, kwargs, *more)`; where it fails on a branch on a tensor's value,
    again with each such branch taken as the example takes it, under a guard (warned of).
    The assertions torch captures itself (`torch._assert` on a tensor, from torch 2.15) become
    guards as well, so that they stop a step alike and are warned of."""
    try:
        result = export(model, args, kwargs, *more)
    except CaptureError as error:
        if not _branches_on_a_value(error):
            raise
        outcomes = _outcomes_of_the_example(model, args, kwargs)
        if not outcomes:
            raise
        guarded: list = []
        with _taking(outcomes, guarded):  # another construct in the way fails it, naming that one
            result = export(model, args, kwargs, *more)
    sites = _guards_of(result[0])
    if sites:
        warnings.warn(f"conveyor: {type(model).__name__} checks tensor values; captured with the branch the example "
                      f"takes, under a guard that stops a step whose batch would take the other: {'; '.join(sites)}",
                      stacklevel=4)
    return result


_ASSERTS = ("_assert_async.msg",)
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _guards_of(ep) -> list[str]:
    """Each guard of `ep`'s graph, in graph order, as the warning names it; an assertion of
    torch's own capture (aten._assert_async.msg) is made one first."""
    sites, asserted = [], False
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if str(node.target).endswith(_ASSERTS) and len(node.args) >= 2 and isinstance(node.args[1], str):
            frames = [(p, int(n)) for p, n in _FRAME.findall(node.meta.get("stack_trace") or "")
                      if not p.startswith(_TORCH_DIR) and not p.startswith("<") and p != __file__]
            where = (_where(frames[-1]) if frames else "an assertion") + f" ({node.args[1]})"
            node.target, node.args, node.kwargs = torch.ops.conveyor.guard.default, (node.args[0], True, where), {}
            sites.append(f"{where}, asserted")
            asserted = True
        elif node.target is torch.ops.conveyor.guard.default:
            sites.append(f"{node.args[2]}, {node.args[1]} on the example")
    if asserted:
        ep.graph_module.recompile()
    return sites
