"""transformers' eager mixture-of-experts, captured through its grouped implementation.

transformers runs a mixture of experts through one of several interchangeable
implementations (`config._experts_implementation`). The eager one loops in Python over the
experts a batch routes to (`for expert_idx in expert_hit`, from a nonzero), which no one
graph holds: torch.export refuses it as data-dependent control flow. The default one,
"grouped_mm", computes the same thing without the loop: it sorts the (token, expert) pairs by
expert, multiplies each expert's group by its weights (torch's grouped_mm, or transformers'
product per expert where that has no kernel) and puts the tokens back, which the batch
analysis proves keeps every token to itself (row_order.py). So capture traces a model whose
experts are eager through "grouped_mm" and gives the model its setting back: the graph
computes each token's experts as the eager loop does, up to the order of rounding.
"""
from __future__ import annotations

import contextlib

import torch

_EAGER, _GROUPED = "eager", "grouped_mm"
_FIELD = "_experts_implementation_internal"  # transformers' PretrainedConfig._experts_implementation


@contextlib.contextmanager
def eager_experts_grouped(model: torch.nn.Module):
    """Within: every config of `model`'s modules whose experts run eagerly runs them through
    "grouped_mm"; on leaving, each has its own setting again."""
    switched = []
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        # The field behind the property: its setter would set every sub-config alike.
        if getattr(config, _FIELD, None) == _EAGER:
            setattr(config, _FIELD, _GROUPED)
            switched.append(config)
    try:
        yield switched
    finally:
        for config in switched:
            setattr(config, _FIELD, _EAGER)
