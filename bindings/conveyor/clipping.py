"""Gradient clipping across processes, as users write it.

Across processes each process holds the gradients of its stages only, so the norm that
`torch.nn.utils.clip_grad_norm_` computes over one process's gradients is that process's
part, and clipping by it trains differently on each. Here the norm counts every gradient
once, in the process that owns its parameter, summed across processes: every process gets
the same norm and the same scale.

A Module across processes routes torch's own `torch.nn.utils.clip_grad_norm_` (the name
that scripts, transformers' Trainer and Lightning call) to this: when the parameters given
include one of a Module running across processes, the norm is that Module's; any other call
runs torch's unchanged. `Module.clip_grad_norm_(max_norm)` is the same over all its
parameters. Every process must call it (it is collective), as every process runs the same
script.
"""
from __future__ import annotations

import math
import weakref

import torch

__all__ = ["GradientClipping", "route_torch_clip"]

_ROUTED: weakref.WeakSet = weakref.WeakSet()  # the GradientClipping of each live Module across processes
_TORCH_CLIP = torch.nn.utils.clip_grad_norm_


class GradientClipping:
    """The clipping of one Module: its model's parameters, and (once a pipeline runs across
    processes) which this process owns."""

    def __init__(self, model: torch.nn.Module, captures, job):
        self.model, self.captures, self.job = model, captures, job
        self._param_ids = {id(p) for p in model.parameters()}

    def covers(self, params: list) -> bool:
        return any(id(p) in self._param_ids for p in params)

    def _owned(self) -> set[int] | None:
        """data_ptr of the tensors this process owns; None where one process holds everything."""
        state, group = self.captures.current, self.job.group
        if group is None or state is None or state.pipeline is None:
            return None
        owners = state.pipeline.owners()
        return {t.data_ptr() for name, t in state.graph.tensors.items() if owners.get(name) == group.rank}

    def clip(self, params, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
             foreach=None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over `params`, the norm across processes."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owned = self._owned()
        if owned is None:
            return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        norm_type = float(norm_type)
        grads = [p.grad for p in params if p.grad is not None]
        mine = [g for p, g in ((p, p.grad) for p in params) if g is not None and p.data_ptr() in owned]
        if math.isinf(norm_type):
            local = max((g.detach().abs().max().double().cpu() for g in mine if g.numel()),
                        default=torch.zeros((), dtype=torch.float64))
            values = [float(x) for x in self._each(local)]
            norm = torch.tensor(max(values), dtype=torch.float64)
        else:
            total = torch.zeros(1, dtype=torch.float64)
            for g in mine:
                total += g.detach().double().abs().pow(norm_type).sum().cpu()
            self.job.group.allreduce(total)
            norm = total[0] ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                               "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1:
            for g in grads:
                g.mul_(scale)
        return norm.to(grads[0].dtype if grads else torch.float32)

    def _each(self, value: torch.Tensor) -> list:
        group = self.job.group
        return [float(group.broadcast_bytes(r, repr(float(value)).encode() if r == group.rank else b"").decode())
                for r in range(group.world_size)]


def _routed_clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for clipping in list(_ROUTED):
        if clipping.covers(params):
            return clipping.clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)


_routed_clip_grad_norm_.__doc__ = (_TORCH_CLIP.__doc__ or "") + "\n(conveyor: across processes, the norm of a " \
    "conveyor.Module's parameters counts every process's gradients; bindings/conveyor/clipping.py)"


def route_torch_clip(clipping: GradientClipping) -> None:
    """From now on torch.nn.utils.clip_grad_norm_ over `clipping`'s parameters takes the norm
    across processes (installed once, for every Module running across processes)."""
    _ROUTED.add(clipping)
    torch.nn.utils.clip_grad_norm_ = _routed_clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = _routed_clip_grad_norm_
