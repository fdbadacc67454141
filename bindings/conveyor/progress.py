"""What a Module's first call (and each later capture or plan) is doing, one line a phase on
process 0: captured, profiled (units measured), planned (the plan in a line), built. The
lines go to the `conveyor` logger at INFO, which writes them to stderr as `conveyor: ...`
unless the user configured that logger; `verbose=False` on the Module, or
`logging.getLogger("conveyor").setLevel(logging.WARNING)`, silences them."""
from __future__ import annotations

import contextlib
import logging
import sys
import time

__all__ = ["LOGGER", "phase"]

LOGGER = logging.getLogger("conveyor")


class _ToStderr(logging.Handler):
    """Writes to whatever sys.stderr is when a line is said (not the one at import)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


if not LOGGER.handlers:
    _handler = _ToStderr()
    _handler.setFormatter(logging.Formatter("conveyor: %(message)s"))
    LOGGER.addHandler(_handler)
    LOGGER.propagate = False  # its own line, not twice through a root handler too
    if LOGGER.level == logging.NOTSET:
        LOGGER.setLevel(logging.INFO)


@contextlib.contextmanager
def phase(verbose: bool, rank: int):
    """Times the block; the block sets `said["text"]`, logged with the time at its end."""
    said: dict = {}
    start = time.perf_counter()
    yield said
    if verbose and rank == 0 and said.get("text"):
        LOGGER.info("%s (%.1f s)", said["text"], time.perf_counter() - start)
