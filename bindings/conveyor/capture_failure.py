"""Why a model could not be captured, said the user's way: the first line of torch's error,
the innermost line of the user's own code it came from, and a hint naming what to change
(capture.py raises what capture_failure makes)."""
from __future__ import annotations

import contextlib
import os
import re

import torch

from . import guards
from .errors import CaptureError

FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # with the separator: torchvision/ is not torch's


def is_user_path(path: str) -> bool:
    """Frames in torch, generated code or guards.py's Tensor.__bool__ say nothing of the user's model."""
    return not path.startswith(_TORCH_DIR) and not path.startswith("<") and path != guards.__file__


@contextlib.contextmanager
def helpers_in_stack_traces():
    """While conveyor exports, each node's stack trace keeps every frame from the first
    `forward` in, as torch.fx's own tracer does. torch.export keeps only the frames named
    `forward`, so a node made in a helper (transformers' experts function in moe.py, a
    model's own `self.route(h)`) was placed at the forward that calls it, and so was a
    refusal citing that node; with every frame outside torch, the innermost is the
    operator's own line, in any package."""
    tracer = torch.fx.proxy.TracerBase
    original = tracer.__dict__.get("_filter_traceback_frames")
    if original is None:  # a torch that filters otherwise: its traces as they are
        yield
        return

    def every_frame(self, summary):
        forward_only = getattr(self, "_record_forward_stack_traces_only", False)
        self._record_forward_stack_traces_only = False
        try:
            frames = original(self, summary)
        finally:
            self._record_forward_stack_traces_only = forward_only
        # torch's own frames but the forwards (what torch keeps) name nothing of the model's
        return type(frames).from_list([f for f in frames if f.name == "forward" or is_user_path(f.filename)])

    tracer._filter_traceback_frames = every_frame
    try:
        yield
    finally:
        tracer._filter_traceback_frames = original


def _user_frame(text: str) -> str | None:
    """The innermost source location in `text` that is not inside torch itself."""
    frames = [(p, l) for p, l in FRAME.findall(text) if is_user_path(p)]
    if not frames:
        return None
    path, line = frames[-1]
    code = ""
    try:
        with open(path, encoding="utf-8") as f:
            code = f.readlines()[int(line) - 1].strip()
    except (OSError, IndexError, ValueError):
        pass
    return f"{path}:{line}" + (f": {code}" if code else "")


_SIZE_LIKE = re.compile(r"Size-like symbols: ([^)]*)\)")
_EXPRESSION = re.compile(r"data-dependent expression (.*?) \(unhinted")


def _branches_on_a_drawn_size(text: str) -> bool:
    """Whether torch.export's error is a branch on sizes drawn from tensor values alone (its
    expression's unbacked symbols all size-like: `if boxes.numel() == 0:` after a filter)."""
    sizes, expression = _SIZE_LIKE.search(text), _EXPRESSION.search(text)
    if sizes is None or expression is None:
        return False
    drawn = set(re.findall(r"\bu\d+\b", expression.group(1)))
    return bool(drawn) and drawn <= {name.strip() for name in sizes.group(1).split(",")}


def capture_failure(model: torch.nn.Module, exc: BaseException) -> CaptureError:
    text = f"{type(exc).__name__}: {exc}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = _user_frame(str(exc)) or _user_frame("".join(_traceback_lines(exc)))
    hint = ""
    low = text.lower()
    if "extract specialized integer" in low or "trunctoint" in low:
        hint = ("the model reads a tensor's value as a Python number (.item(), int(tensor)) and uses it as a "
                "size or an index, so the graph would differ from input to input; compute that number outside "
                "the model (in the data loader, or as an argument), or keep it a tensor (torch.where, indexing "
                "with a tensor)")
    elif _branches_on_a_drawn_size(str(exc)):
        hint = ("the model branches on a size that tensor values decide (how many elements nonzero, masked_select "
                "or boolean indexing keep: a detector's boxes left after filtering), so no one graph holds every "
                "input, and no guard keeps it: keep that size fixed (a fixed number of candidates, topk instead of "
                "a threshold, padding), or compute that part outside the model")
    elif "data-dependent" in low or "data dependent" in low or "guard on data" in low:
        hint = ("the model branches on the value of a tensor (data-dependent control flow); "
                "conveyor needs a graph that is the same for every input: use torch.where or "
                "torch.cond instead of a Python if on tensor values")
    elif "cache" in low and "pytree" in low:
        hint = ("the model returns a cache object; for training set use_cache=False in the "
                "model's config (or pass use_cache=False)")
    elif "higher_order" in low or "higher-order" in low:
        hint = "the model uses a higher-order operator conveyor cannot run"
    msg = f"cannot capture {type(model).__name__}: {first}"
    if where:
        msg += f"\n  at {where}"
    if hint:
        msg += f"\n  hint: {hint}"
    return CaptureError(msg)


def _traceback_lines(exc: BaseException) -> list[str]:
    import traceback
    return traceback.format_exception(type(exc), exc, exc.__traceback__)
