"""The model as conveyor captures it: its scalar loss as the only output, behind a forward
with plain argument names (conveyor.Module wraps every model this way before capture)."""
from __future__ import annotations

import inspect
import keyword
from typing import Any

import torch

from .errors import ConveyorValueError

__all__ = ["loss_wrapper"]


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConveyorValueError(
        f"the model's forward returned {type(output).__name__}, not a loss; return a scalar loss from forward "
        "(or an object with .loss), or pass loss_fn=")


def positional_names(model: torch.nn.Module, count: int, kwargs: dict) -> list[str]:
    """Names for a call's `count` positional arguments: the model's own forward parameters
    (so errors name `input_ids`, not `arg0`), or arg0, arg1, ... where they cannot be had."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:count]]
    if len(names) < count or len(set(names)) < count or set(names) & set(kwargs) or \
            not all(n.isidentifier() and not keyword.iskeyword(n) and n not in ("self", "target") for n in names):
        return [f"arg{i}" for i in range(count)]
    return names


def loss_wrapper(model: torch.nn.Module, loss_fn, args: tuple, kwargs: dict) -> torch.nn.Module:
    """The model with its scalar loss as the only output and the same argument names (the
    capture needs a plain signature). With `loss_fn`, a `target=` keyword goes to
    `loss_fn(output, target)` rather than to the model (torch.distributed.pipelining's
    `step(target=)` convention): `loss = model(x, target=y)` for `criterion(model(x), y)`."""
    pos = positional_names(model, len(args), kwargs)
    to_loss = loss_fn is not None and "target" in kwargs
    if loss_fn is not None:
        _refuse_a_target_under_another_name(model, kwargs)
    call = ", ".join(pos + [f"{k}={k}" for k in kwargs if not (to_loss and k == "target")])
    namespace: dict = {}
    exec(f"def forward(self, {', '.join(pos + list(kwargs))}):\n"
         f"    return self._loss(self.model({call}){', target' if to_loss else ''})", namespace)
    # Named as the user's model: capture errors and warnings name it.
    cls = type(type(model).__name__, (torch.nn.Module,), {"forward": namespace["forward"]})
    wrapper = cls()
    wrapper.training = model.training  # its own flag only: the model's modules keep theirs
    wrapper.model = model
    loss = _named_loss_fn(loss_fn) if loss_fn is not None else _loss_of
    returned: list = []  # the type of what the model's forward returned (as_model.py), once it ran

    def seen(output, *target):
        # Kept outside the module's attributes: torch.export restores those after tracing.
        returned[:] = [type(output) if loss_fn is None else None]  # loss_fn's loss is a tensor
        return loss(output, *target)
    wrapper._loss = seen
    wrapper.output_type = lambda: returned[0] if returned else None
    return wrapper


def _refuse_a_target_under_another_name(model: torch.nn.Module, kwargs: dict) -> None:
    """With loss_fn, a keyword the model's forward does not take (labels=, y=) is most likely
    the target under another name: said before the capture fails on it."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    foreign = [k for k in kwargs if k != "target" and k not in params]
    if foreign:
        raise ConveyorValueError(f"{type(model).__name__}.forward() takes no argument {foreign[0]!r}; with loss_fn= "
                                 f"the target goes as target=: model(x, target=y) calls loss_fn(model(x), y)")


def _named_loss_fn(loss_fn):
    """loss_fn(output[, target]), its failure on an output that is no tensor said as such."""
    def loss(output, *target):
        try:
            return loss_fn(output, *target)
        except Exception as e:
            if isinstance(output, torch.Tensor):
                raise
            keys = f" with keys {list(output.keys())}" if hasattr(output, "keys") else ""
            raise ConveyorValueError(
                f"loss_fn(output, target) failed ({type(e).__name__}: {e}): the model returns a "
                f"{type(output).__name__}{keys}, not a tensor; pass a loss_fn that takes it, e.g. "
                "loss_fn=lambda out, target: torch.nn.functional.cross_entropy(out['logits'], target)") from None
    return loss
