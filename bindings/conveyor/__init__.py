"""conveyor: train any PyTorch model split automatically across many devices.

One line turns a model into a pipelined one; its first call captures, profiles and plans it
on this machine (or, under `conveyor launch -n N`, across N processes):

    model = conveyor.Module(model, optimizer)
    loss = model(x, labels=y)      # every microbatch forward and backward, in the plan's schedule
    loss.backward()                # the parameter gradients, scaled by the incoming gradient
    optimizer.step()               # updates the model's own parameters

The pieces it is built of are here too: capture (the model as conveyor's graph), profile
and plan (the planner's cut), Graph.split (a graph run in stages); and
conveyor.distributed, for models split by hand.
"""
import pkgutil as _pkgutil

# The compiled extension may live in a build directory beside the sources.
__path__ = _pkgutil.extend_path(__path__, __name__)  # noqa: F821

import torch as _torch  # noqa: E402  (loads libtorch before the extension)

from . import _C  # noqa: E402
from .errors import (  # noqa: E402
    CaptureError,
    ConveyorError,
    ConveyorIOError,
    ConveyorValueError,
    DoesNotFitError,
    ExecutionError,
    GraphCorruptError,
    GraphFormatError,
    GraphVersionError,
    InvalidGraphError,
    InvalidStageError,
    UnknownOpError,
    UnsupportedError,
)
from .graph import Graph, StagedGraph  # noqa: E402
from .capture import capture  # noqa: E402
from .planning import Plan, plan, profile  # noqa: E402
from .module import Module  # noqa: E402
from .microbatches import Microbatches  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "capture", "Graph", "StagedGraph", "profile", "plan", "Plan", "Module", "Microbatches", "DoesNotFitError",
    "ConveyorError", "ConveyorIOError", "CaptureError", "ConveyorValueError", "ExecutionError", "GraphCorruptError",
    "GraphFormatError", "GraphVersionError", "InvalidGraphError", "InvalidStageError",
    "UnknownOpError", "UnsupportedError",
]
