"""The sizes a Module's plan is made for. A capture keeps a sequence length or an image size
symbolic, so one plan runs every size; but memory grows with the size, and a plan made from
the first batch's sizes can leave too little for a larger one. `max_sizes` declares the
largest (by the names errors and captures use: {"input_ids dim 1": 512}; a size the
capture holds apart, such as labels whose length only the loss ties to the inputs', is
declared by its own name); the Module then
profiles the first batch tiled along those dimensions to that size, so the plan's memory is
for the largest, while the live profile measures the time of the sizes that run (and
re-planning corrects the plan's times with it). A call beyond the sizes planned for plans
again for them (bindings/conveyor/planning/plan_maker.py) or, where the Module does not re-plan,
gets one warning that names the size and what to declare."""
from __future__ import annotations

import warnings

import torch

from .errors import ConveyorValueError


def input_dims(graph, inputs: list):
    """(index, input name, tensor, dim, captured size: an int, or a symbol) for every dimension
    of `inputs`' (flattened) tensors whose rank the capture knows."""
    doc = graph.document
    for k, (entry, x) in enumerate(zip(doc["inputs"], inputs)):
        shape = doc["values"][entry["value"]].get("shape")
        if isinstance(x, torch.Tensor) and shape is not None and x.dim() == len(shape):
            for d, size in enumerate(shape):
                yield k, entry["name"], x, d, size


def range_text(bounds: dict) -> str:
    """A symbol's range as errors say it: "2 to 32", "11 and more"."""
    return f"{bounds.get('min', 0)} to {bounds['max']}" if "max" in bounds else f"{bounds.get('min', 0)} and more"


def _symbol_names(graph) -> dict[str, str]:
    """Symbolic non-batch sizes by name ("input_ids dim 1") -> symbol ("s70")."""
    return {name: sym for sym, name in graph.document.get("symbols", {}).items() if name != "batch"}


def as_max_sizes(max_sizes) -> dict:
    """A Module's `max_sizes`, checked for its form (its names are checked on capture)."""
    if max_sizes is None:
        return {}
    if not isinstance(max_sizes, dict) or not all(isinstance(k, str) for k in max_sizes):
        raise ConveyorValueError(f"max_sizes={max_sizes!r}: expected a dict from size names to sizes, such as "
                                 "{'input_ids dim 1': 512}")
    return dict(max_sizes)


def check_max_sizes(graph, max_sizes: dict) -> None:
    """Every declared size names a symbolic size of the capture, within its range."""
    names = _symbol_names(graph)
    ranges = graph.document.get("ranges", {})
    for name, size in max_sizes.items():
        if name not in names:
            known = ", ".join(repr(n) for n in sorted(names)) or "none (every size is fixed)"
            raise ConveyorValueError(f"max_sizes names {name!r}, which is not a size the capture kept symbolic; "
                                     f"its symbolic sizes: {known}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConveyorValueError(f"max_sizes[{name!r}] = {size!r}: expected a whole number, at least 1")
        bounds = ranges.get(names[name], {})
        lo, hi = bounds.get("min"), bounds.get("max")
        if (lo is not None and size < lo) or (hi is not None and size > hi):
            raise ConveyorValueError(f"max_sizes[{name!r}] = {size} lies outside the {range_text(bounds)} the capture "
                                     "holds for; declare a size within it")


def sizes_of(graph, inputs: list) -> dict[str, int]:
    """The symbolic non-batch sizes of `inputs` (flattened), by name."""
    symbols = graph.document.get("symbols", {})
    out: dict[str, int] = {}
    for _, _, x, d, size in input_dims(graph, inputs):
        name = symbols.get(size) if isinstance(size, str) else None
        if name is not None and name != "batch":
            out[name] = max(out.get(name, 0), int(x.shape[d]))
    return out


def largest_sizes(graph, calls: list[list], start: dict | None = None) -> dict[str, int]:
    """The largest of each symbolic non-batch size over `calls` (each call's inputs,
    flattened), and over `start` (sizes by name) where given."""
    out = dict(start or {})
    for inputs in calls:
        for name, size in sizes_of(graph, inputs).items():
            out[name] = max(out.get(name, 0), size)
    return out


def tiled_to(graph, inputs: list, max_sizes: dict) -> list:
    """`inputs` (flattened) with every dimension of a declared size tiled to it: the batch's
    own values repeated, so token ids, masks and labels stay valid."""
    symbols = graph.document.get("symbols", {})
    out = list(inputs)
    for k, _, x, d, size in input_dims(graph, inputs):
        want = max_sizes.get(symbols.get(size)) if isinstance(size, str) else None
        if want is not None and x.shape[d] != want:
            reps = [1] * x.dim()
            reps[d] = -(-want // x.shape[d])
            out[k] = out[k].repeat(*reps).narrow(d, 0, want)
    return out


def warn_beyond(planned: dict[str, int], inputs_sizes: dict[str, int], warned: set) -> None:
    """One warning per size that runs beyond what the plan's memory was made for."""
    for name, size in inputs_sizes.items():
        if size > planned.get(name, size) and name not in warned:
            warned.add(name)
            warnings.warn(f"conveyor: {name} is {size} here, beyond the {planned[name]} the plan's memory was made "
                          f"for; declare the largest with conveyor.Module(..., max_sizes={{{name!r}: {size}}}) "
                          "(or more) so that every device has room for it", stacklevel=4)
