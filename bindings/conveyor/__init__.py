"""conveyor: train any PyTorch model split automatically across many devices.

Capture a model into conveyor's graph, run it (or any cut of it into stages) in C++:

    g = conveyor.capture(model, (x,))
    loss = g(x); loss.backward()          # same gradients as model(x)
    staged = g.split(3, seed=0)           # three convex stages, chained
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
