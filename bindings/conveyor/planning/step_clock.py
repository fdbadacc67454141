"""The step as the caller sees it, for re-planning: from one training call's start to the
next's, with the optimizer's step, the caller's loop and its data in it; and of that, what
the optimizer's step took (timed by hooks on the Module's optimizer).

The live profile measures the pipeline's own step, which leaves both out: a user's BERT
(AdamW, 17 ms steps) ran its live-profile step 5-10 ms under the step its loop saw, and a
switch measured 8.5 ms saved where that step did not move."""
from __future__ import annotations

import time
import weakref


class StepClock:
    """Times each training step from its call's start to the next call's start, and the
    Module's `optimizer` steps (None: not timed) within it."""

    def __init__(self, optimizer=None):
        self.optimizer_total_s = 0.0
        self._entered = 0.0
        self._began: tuple | None = None   # (start, optimizer total then) of the call under way
        self._open: tuple | None = None    # the same, of the last step that ran and is measured
        self._hooks = []
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            me = weakref.ref(self)  # the hooks must not keep the clock alive
            self._hooks = [optimizer.register_step_pre_hook(lambda *_: _entered(me)),
                           optimizer.register_step_post_hook(lambda *_: _left(me))]
            weakref.finalize(self, _remove, self._hooks)

    def began(self, started: float) -> tuple[float, float] | None:
        """A training call began at `started` (time.perf_counter). Returns the last step's
        measure: its wall time, from its call's start to this one's, and the optimizer's time
        within it; None when no measured step is open."""
        closed = None
        if self._open is not None:
            start, optimizer = self._open
            closed = (started - start, self.optimizer_total_s - optimizer)
            self._open = None
        self._began = (started, self.optimizer_total_s)
        return closed

    def measure_this_step(self) -> None:
        """The call under way ran a step to be measured: it is closed at the next call's start."""
        self._open = self._began

    def forget(self) -> None:
        """Nothing open is measured (a new pipeline: its first step warms up)."""
        self._open = None


def _entered(ref) -> None:
    clock = ref()
    if clock is not None:
        clock._entered = time.perf_counter()


def _left(ref) -> None:
    clock = ref()
    if clock is not None and clock._entered > 0:
        clock.optimizer_total_s += time.perf_counter() - clock._entered
        clock._entered = 0.0


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
