"""Exception types. Every error conveyor raises is a ConveyorError with a message that
names what is wrong and what to do about it."""


class ConveyorError(RuntimeError):
    """Base class of conveyor's errors."""


class CaptureError(ConveyorError):
    """The model cannot be captured into conveyor's graph (names the construct and source line)."""


class GraphFormatError(ConveyorError):
    """A graph file or document is malformed."""


class GraphVersionError(GraphFormatError):
    """A graph file comes from a newer conveyor than this one."""


class GraphCorruptError(GraphFormatError):
    """A graph file is truncated or fails its checksum."""


class UnknownOpError(ConveyorError):
    """The graph uses an operator this torch does not have."""


class InvalidGraphError(ConveyorError):
    """The graph breaks a structural rule (undefined values, wrong argument counts, ...)."""


class InvalidStageError(ConveyorError):
    """A stage is not convex, splits an atomic group, or the stages do not partition the graph."""


class ExecutionError(ConveyorError):
    """An operator failed while running the graph."""


class ConveyorValueError(ConveyorError, ValueError):
    """An argument passed to conveyor is malformed."""


class NotALossError(ConveyorValueError):
    """The model's forward returns outputs, not one scalar loss: it cannot be trained
    pipelined (an eval-mode call of it is evaluated whole instead)."""


class ConveyorIOError(ConveyorError, OSError):
    """A file conveyor was asked to read or write cannot be (missing, a folder, unreadable)."""


class UnsupportedError(ConveyorError, NotImplementedError):
    """Valid input that conveyor does not handle yet."""


class DoesNotFitError(ConveyorError, MemoryError):
    """No plan fits the cluster's memory; the message states the smallest memory per device that would."""


_BY_CODE = {
    "does_not_fit": DoesNotFitError,
    "invalid_argument": ConveyorValueError,
    "format": GraphFormatError,
    "version": GraphVersionError,
    "corrupt": GraphCorruptError,
    "unknown_op": UnknownOpError,
    "invalid_graph": InvalidGraphError,
    "invalid_stage": InvalidStageError,
    "execution": ExecutionError,
    "io": ConveyorIOError,
    "unsupported": UnsupportedError,
}


def error_class(code: str) -> type:
    """The exception class for a C++ error-code name (used by the extension)."""
    return _BY_CODE.get(code, ConveyorError)
