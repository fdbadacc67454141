"""Gradient clipping across processes, as users write it.

Across processes each process holds the gradients of its stages only, so the norm torch
computes over one process's gradients is that process's part, and clipping by it trains
differently on each. Here the norm counts every gradient once, in the process that owns its
parameter, summed across processes (the largest, for the infinity norm): every process gets
the same norm, and so the same scale.

A Module across processes routes torch's own total-norm function to this: the module-level
`_get_total_norm` that `torch.nn.utils.clip_grad_norm_` calls (so `clip_grad_norm_` works
however it was imported), and `torch.nn.utils.get_total_norm` (before
`clip_grads_with_norm_`). Given gradients of a Module running across processes, the norm is
that Module's; any other call runs torch's unchanged. Gradients given beside the Module's
(a module outside it, alike on every process) count once, on process 0. Only a
`get_total_norm` imported by name before the Module was made keeps torch's own.
`Module.clip_grad_norm_(max_norm)` is the same over all its parameters. Every process must
call it (it is collective), as every process runs the same script.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn.utils.clip_grad as _torch_clip

from .exchange import exchange

__all__ = ["GradientClipping", "route_torch_clip"]

_ROUTED: weakref.WeakSet = weakref.WeakSet()  # the GradientClipping of each live Module across processes
_TORCH_TOTAL_NORM = _torch_clip._get_total_norm


class GradientClipping:
    """The clipping of one Module: its model's parameters, and (once a pipeline runs across
    processes) which this process owns."""

    def __init__(self, model: torch.nn.Module, captures, job):
        self.model, self.captures, self.job = model, captures, job

    def _owned(self) -> set[int] | None:
        """data_ptr of the tensors this process owns; None where one process holds everything."""
        state, group = self.captures.current, self.job.group
        if group is None or state is None or state.pipeline is None:
            return None
        owners = state.pipeline.owners()
        return {t.data_ptr() for name, t in state.graph.tensors.items() if owners.get(name) == group.rank}

    def params_of(self, grads: list) -> dict[int, torch.nn.Parameter]:
        """The model's parameters whose gradient is among `grads`, by the gradient's id."""
        given = {id(g) for g in grads}
        return {id(p.grad): p for p in self.model.parameters() if p.grad is not None and id(p.grad) in given}

    def total_norm(self, grads: list, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach=None) -> torch.Tensor:
        """The norm of `grads` across processes (torch's where one process holds everything)."""
        owned = self._owned()
        if owned is None:
            return _TORCH_TOTAL_NORM(grads, norm_type, error_if_nonfinite, foreach)
        group, norm_type = self.job.group, float(norm_type)
        params = self.params_of(grads)
        counted = [g for g in grads if (id(g) in params and params[id(g)].data_ptr() in owned)
                   or (id(g) not in params and group.rank == 0)]
        if math.isinf(norm_type):
            mine = max((float(g.detach().abs().max()) for g in counted if g.numel()), default=0.0)
            norm = torch.tensor(max(exchange(group, mine, "clip_grad_norm_")), dtype=torch.float64)
        else:
            total = torch.zeros(1, dtype=torch.float64)
            for g in counted:
                total += g.detach().double().abs().pow(norm_type).sum().cpu()
            group.allreduce(total)
            norm = total[0] ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                               "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
        first = grads[0] if grads else None
        return norm.to(dtype=first.dtype if first is not None else torch.float32,
                       device=first.device if first is not None else "cpu")

    def clip(self, params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over `params`, the norm across processes."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        norm = self.total_norm([p.grad for p in params if p.grad is not None], norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


def _routed_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for clipping in list(_ROUTED):
        if clipping.params_of(grads):
            return clipping.total_norm(grads, norm_type, error_if_nonfinite, foreach)
    return _TORCH_TOTAL_NORM(grads, norm_type, error_if_nonfinite, foreach)


_routed_total_norm.__doc__ = (_TORCH_TOTAL_NORM.__doc__ or "") + "\n(conveyor: across processes, the norm of a " \
    "conveyor.Module's gradients counts every process's; bindings/conveyor/clipping.py)"


def route_torch_clip(clipping: GradientClipping) -> None:
    """From now on torch's total norm of `clipping`'s gradients is taken across processes
    (installed once, for every Module running across processes)."""
    _ROUTED.add(clipping)
    _torch_clip._get_total_norm = _routed_total_norm  # what clip_grad_norm_ calls, however it was imported
    torch.nn.utils.get_total_norm = _routed_total_norm
