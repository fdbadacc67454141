"""What makes a conveyor.Module look like the model it wraps to code that inspects it
(transformers' Trainer, Lightning, a user's own loop):

- `forward`'s signature is the model's (with `target` added where loss_fn= takes it), so a
  Trainer keeps the dataset columns the model takes;
- with returns="model", a call returns what the model's forward returns, of the same type:
  a ModelOutput or dict holds the pipelined loss as `loss`, and nothing else. The rule for
  the other outputs: they are absent (a ModelOutput's fields None, a dict's keys missing),
  because a pipelined step keeps only each microbatch's loss; joining every microbatch's
  logits across replicas and processes is not built. A model that returns a tensor or a
  tuple, or one trained through loss_fn=, returns the loss alone;
- attributes that describe the model (`config`, `generation_config`, `main_input_name`,
  `dtype`, ...) are the model's; those that would change or run it outside the pipeline
  (`gradient_checkpointing_enable`, `generate`, `resize_token_embeddings`) are refused,
  naming what to do instead.
"""
from __future__ import annotations

import inspect

import torch

from .errors import UnsupportedError

__all__ = ["signed_forward", "shaped_like_model", "model_attribute", "RETURNS"]

RETURNS = ("loss", "model")

# Read-only descriptions of the model, the wrapped model's own.
_DESCRIBING = frozenset({
    "config", "generation_config", "name_or_path", "main_input_name", "base_model_prefix", "model_tags",
    "dtype", "device", "loss_type", "is_parallelizable", "supports_gradient_checkpointing", "hf_quantizer",
    "is_quantized", "warnings_issued", "_keep_in_fp32_modules", "_no_split_modules", "_tied_weights_keys",
    "get_input_embeddings", "get_output_embeddings", "num_parameters", "floating_point_ops",
    "estimate_tokens", "get_memory_footprint", "add_model_tags", "create_model_card",
})

# What would change the model, or run it, outside conveyor's pipeline: what to do instead.
_REFUSED = {
    "gradient_checkpointing_enable": "conveyor recomputes activations itself: pass recompute=True (or "
                                     "'selective') to conveyor.Module instead",
    "activation_checkpointing_enable": "conveyor recomputes activations itself: pass recompute=True (or "
                                       "'selective') to conveyor.Module instead",
    "generate": "conveyor.Module trains and evaluates losses; generation is not pipelined: call generate on the "
                "model itself (model.module), in a process that holds all of it",
    "resize_token_embeddings": "resize the model's embeddings before wrapping it: the capture holds their shapes",
    "tie_weights": "tie the model's weights before wrapping it: the capture holds which tensors are shared",
}


def signed_forward(module: torch.nn.Module, model: torch.nn.Module, takes_target: bool):
    """`module.forward` bound to it, signed as `model.forward` (plus `target` where loss_fn=
    takes it); None where the model's signature cannot be read."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if takes_target and "target" not in signature.parameters:
        target = inspect.Parameter("target", inspect.Parameter.KEYWORD_ONLY, default=None)
        at = next((i for i, p in enumerate(params) if p.kind == p.VAR_KEYWORD), len(params))
        params.insert(at, target)
        signature = signature.replace(parameters=params)
    run = type(module).forward

    def forward(*args, **kwargs):
        return run(module, *args, **kwargs)
    forward.__signature__ = signature
    forward.__doc__ = model.forward.__doc__
    forward.__name__ = forward.__qualname__ = "forward"
    return forward


def shaped_like_model(loss: torch.Tensor, output_type) -> object:
    """The loss in the model's own output type where that is a ModelOutput or dict (`loss`
    its only entry), else the loss itself."""
    if output_type is None or not issubclass(output_type, dict):
        return loss
    try:
        return output_type(loss=loss)
    except TypeError:  # a dict type whose constructor takes no keywords
        return {"loss": loss}


def model_attribute(model: torch.nn.Module, name: str):
    """The wrapped model's `name` where it describes the model; for a refused method, one
    that raises UnsupportedError naming what to do instead when called (so that probing
    with hasattr still works); AttributeError otherwise."""
    if name == "can_generate" and hasattr(model, name):
        return lambda: False  # generation is not pipelined (_REFUSED["generate"])
    if name in _REFUSED and hasattr(model, name):
        def refused(*args, **kwargs):
            raise UnsupportedError(f"{type(model).__name__}.{name} through conveyor.Module: {_REFUSED[name]}")
        return refused
    if name in _DESCRIBING and hasattr(model, name):
        return getattr(model, name)
    raise AttributeError(f"'conveyor.Module' has no attribute {name!r} (the wrapped model is model.module: what "
                         f"it holds beyond its description is reached there)")
