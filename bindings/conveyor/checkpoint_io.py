"""A Module's checkpoint and pretrained-weight calls: loads asked for before the first call
wait for the plan (it says which tensors this process holds), and a checkpoint saved in the
background is waited for before the next save or load (checkpoint.py, checkpoint_save.py,
pretrained.py)."""
from __future__ import annotations

from . import checkpoint, checkpoint_save, pretrained

__all__ = ["CheckpointIO"]


class CheckpointIO:
    def __init__(self, model, optimizer, captures, job, history):
        self._model, self._optimizer, self._captures, self._job, self._history = \
            model, optimizer, captures, job, history
        self._waiting = []  # loads, in the order asked
        self.in_flight: checkpoint_save.SaveInFlight | None = None
        self._copies: dict = {}  # a background save's copy of this process's part, reused by the next

    def _tensors(self) -> checkpoint.CheckpointTensors:
        return self._captures.checkpoint_tensors()

    def run_waiting(self) -> None:
        """Runs the waiting loads once the first call has made the plan. A load that fails
        (a corrupt file) stays first in line: every call raises it again, and none trains
        from what the load should have replaced."""
        while self._waiting and self._captures.current is not None:
            self._waiting[0](self._tensors())
            self._waiting.pop(0)

    def _add(self, load) -> None:
        self.wait()
        self._waiting.append(load)
        self.run_waiting()

    def wait(self) -> None:
        """Returns once the save in flight (if any) is complete; raises what failed (unless
        the caller's own wait on it raised it already)."""
        saving, self.in_flight = self.in_flight, None
        if saving is not None and not saving.failure_raised:
            saving.wait()

    def save(self, path, extra: dict | None, background: bool) -> checkpoint_save.SaveInFlight | None:
        self.wait()
        plan = self._captures.current.plan if self._captures.current is not None else None
        meta = dict(steps_run=self._history.steps_run, plan=plan.document if plan is not None else None,
                    world_size=self._job.world_size, draws_seed=self._job.draws_seed)
        self.in_flight = checkpoint_save.save(
            path, model=self._model, optimizer=self._optimizer, tensors=self._tensors(), group=self._job.group,
            meta=meta, extra=extra, background=background, timeout_s=self._job.options.timeout_s, copies=self._copies)
        return self.in_flight

    def load(self, path) -> dict:
        self.wait()  # a background save to `path` completes first
        meta, _ = checkpoint.inspect(path, optimizer=self._optimizer, tensors=self._tensors())
        self._history.steps_run = meta["steps_run"]
        self._job.draws_seed = meta["draws_seed"]  # dropout draws on as the saved job's would have
        checkpoint.load_hyperparameters(self._optimizer, meta)
        self._add(lambda tensors: checkpoint.load(path, optimizer=self._optimizer, tensors=tensors))
        return meta["extra"]

    def load_pretrained(self, folder) -> None:
        self.wait()
        self._add(pretrained.loader(folder, self._model, self._tensors()))

    def save_pretrained(self, folder) -> None:
        self.wait()
        pretrained.save(folder, model=self._model, tensors=self._tensors(), group=self._job.group)
