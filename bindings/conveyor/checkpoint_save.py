"""Writing a checkpoint folder (the format: checkpoint.py and docs/formats.md), in the
caller's time or in the background.

Every process writes what it owns: DCP's items, plus `conveyor.part.<p>`, its checksums and
non-tensor optimizer state. The items and DCP's plan are agreed in the call (collective).
Then, in the caller's time, each process writes its file, the processes exchange what they
wrote, and process 0 writes DCP's `.metadata` and renames `<path>.incomplete` to `<path>`.

In the background (`background=True`, as torchtitan's async save) the call copies what this
process owns and returns (the cost: memory for one more copy of its part, kept from one
background save to the next as torchtitan keeps its staging memory, and the copy's time); a thread writes the copy while training goes on. The threads do not use the job's
messages: each process's thread leaves its DCP results in the staging folder as
`.written.<p>` (or its error as `.failed.<p>`), and process 0's thread finishes and renames
the folder once all are there. `SaveInFlight.wait()` returns once the folder is renamed (on
every process), and raises what failed. A wait gives up, naming the processes it waited
for, when the staging folder has not grown for the job's timeout.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import threading
import time
import uuid
from pathlib import Path

import torch

from .checkpoint import FORMAT, META_KEY, PART_KEY, CheckpointTensors, torch_dcp, checksum
from .errors import ConveyorIOError, ConveyorValueError
from .exchange import exchange
from .materialize import is_placeholder

__all__ = ["save", "publish", "SaveInFlight"]

POLL_S = 0.05
WHAT = "save_checkpoint"


def publish(staging: Path, path: Path, format_owns) -> None:
    """Complete: the staging folder takes the name `path`. Of a folder of that name before
    it, what the format does not own (`format_owns(name)` false: a tokenizer, a log, notes)
    moves into it first; the rest, the last save's, goes."""
    old = path.with_name(path.name + ".replaced")
    if path.is_dir():
        for entry in path.iterdir():
            if not format_owns(entry.name) and not (staging / entry.name).exists():
                entry.rename(staging / entry.name)
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
    staging.rename(path)
    if old.exists():
        shutil.rmtree(old)


def checkpoint_owns(name: str) -> bool:
    """The names a checkpoint folder's format owns (docs/formats.md, "Checkpoint folder")."""
    return name == ".metadata" or (name.startswith("__") and name.endswith(".distcp")) or \
        name.startswith((".written.", ".failed."))


def agreed_folder(path, group, what: str, refusal: str | None = None) -> Path:
    """`path` as an absolute folder name, the same on every process (collective): refused on
    every process alike, before anything is written, where it is a file, where the processes
    name different folders, or where any process has a `refusal` of its own."""
    path = Path(os.path.abspath(path))
    if refusal is None and path.exists() and not path.is_dir():
        refusal = f"{path} is a file, not a folder: {what} writes a folder; give another path"
    every = exchange(group, (str(path), refusal), what)
    refused = [(r, text) for r, (_, text) in enumerate(every) if text]
    if refused:
        raise ConveyorValueError(refused[0][1] if len(every) == 1 else f"process {refused[0][0]}: {refused[0][1]}")
    differ = [r for r, (p, _) in enumerate(every) if p != every[0][0]]
    if differ:
        raise ConveyorValueError(f"{what} was called with another folder on processes {differ} than on process 0 "
                                 f"({every[differ[0]][0]} against {every[0][0]}): every process names the same "
                                 "folder, each writing its part into it")
    return path


def _optimizer_state(optimizer, tensors: CheckpointTensors, names: list[str]) -> tuple[dict, dict]:
    """The tensor optimizer state of `names` as checkpoint items, and the rest (numbers) by name."""
    items, scalars = {}, {}
    if optimizer is None:
        return items, scalars
    for name in names:
        state = optimizer.state.get(tensors.tensors[name])
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor):
                items[f"optim.{name}.{key}"] = value.detach()
            elif value is not None:
                scalars.setdefault(name, {})[key] = value
    return items, scalars


def _param_groups(optimizer, tensors: CheckpointTensors) -> list[dict]:
    groups = []
    for group in optimizer.param_groups:
        names = [tensors.names.get(id(p)) for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return groups


def save(path, *, model, optimizer, tensors: CheckpointTensors, group, meta: dict, extra: dict | None,
         background: bool = False, timeout_s: float = 600.0, copies: dict | None = None) -> SaveInFlight | None:
    """Writes the checkpoint folder `path` (collective: every process calls it). In the
    background: returns once this process's part is copied, the writing in flight; the
    copies go into `copies` (by item, kept by the caller from one background save to the
    next, so that the next copies into memory already made)."""
    dcp = torch_dcp()
    rank = group.rank if group is not None else 0
    world = group.world_size if group is not None else 1
    mine = tensors.mine()
    unmade = [name for name in mine if is_placeholder(tensors.tensors[name])]
    refusal = None
    if unmade:
        refusal = (f"{', '.join(unmade[:3])}{' ...' if len(unmade) > 3 else ''} of the model built on the meta device "
                   "have no values yet (they are made once the plan exists): call the model first, or load a "
                   "checkpoint into it")
    path = agreed_folder(path, group, WHAT, refusal)
    staging = path.with_name(path.name + ".incomplete")
    items = {f"model.{name}": tensors.tensors[name].detach() for name in mine}
    optim_items, scalars = _optimizer_state(optimizer, tensors, mine)
    items.update(optim_items)
    if background:  # training goes on changing the originals
        copies = {} if copies is None else copies
        for key, t in items.items():
            kept = copies.get(key)
            if kept is None or kept.shape != t.shape or kept.dtype != t.dtype:
                kept = copies[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            kept.copy_(t)
            items[key] = kept
        for key in [k for k in copies if k not in items]:
            del copies[key]  # what this process no longer owns
    part = io.BytesIO()  # this process's checksums and optimizer numbers, filled just before writing
    items[f"{PART_KEY}.{rank}"] = part
    if rank == 0:
        everything = dict(meta, format=FORMAT, extra=extra or {}, rng=torch.get_rng_state(),
                          optimizer_class=type(optimizer).__name__ if optimizer else None, save_id=uuid.uuid4().hex,
                          param_groups=_param_groups(optimizer, tensors) if optimizer is not None else None)
        items[META_KEY] = io.BytesIO(pickle.dumps(everything))
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    exchange(group, None, WHAT)  # the staging folder exists before anyone writes
    planner, writer = dcp.DefaultSavePlanner(), dcp.FileSystemWriter(staging)
    planner.set_up_planner(items, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    plans = exchange(group, writer.prepare_local_plan(planner.create_local_plan()), WHAT)
    metadata = None
    if rank == 0:
        plans, metadata = planner.create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)
    local = planner.finish_plan(exchange(group, plans if rank == 0 else None, WHAT)[0][rank])

    def write() -> list:
        part.write(pickle.dumps(dict(checksums={key: checksum(t) for key, t in items.items()
                                                if isinstance(t, torch.Tensor)},
                                     optimizer_scalars=scalars)))
        written = writer.write_data(local, planner)
        written.wait()
        return written.value()

    def finish(results: list) -> None:
        writer.finish(metadata, results)
        publish(staging, path, checkpoint_owns)

    if not background:
        results = exchange(group, write(), WHAT)
        if rank == 0:
            finish(results)
        exchange(group, None, WHAT)  # every process returns once the checkpoint is complete
        return None
    return SaveInFlight(write, finish if rank == 0 else None, staging=staging, path=path, rank=rank, world=world,
                        timeout_s=timeout_s)


class SaveInFlight:
    """A checkpoint being written in the background: `done()`, and `wait()`, which returns once
    the checkpoint is complete (renamed into place) and raises what failed."""

    def __init__(self, write, finish, *, staging: Path, path: Path, rank: int, world: int, timeout_s: float):
        self.path, self._staging, self._rank, self._world, self._timeout_s = path, staging, rank, world, timeout_s
        self._write, self._finish, self._error = write, finish, None
        self.failure_raised = False  # wait() raised it: the next save or load does not raise it again
        # Not a daemon: an interpreter that exits waits for the checkpoint to be written.
        self._thread = threading.Thread(target=self._run, name="conveyor checkpoint save", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive() and (self._error is not None or not self._staging.exists())

    def wait(self) -> None:
        self._thread.join()
        if self._error is None and self._finish is None:
            self._error = self._wait_for(lambda: not self._staging.exists(), "process 0 to finish it")
        if self._error is not None:
            self.failure_raised = True
            raise ConveyorIOError(f"the checkpoint save to {self.path} did not complete: {self._error}")

    def _run(self) -> None:
        try:
            # The lowest priority: on cores training also uses, the step goes first and the
            # writing takes what is left (Linux: a thread's own nice value).
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            results = self._write()
            (self._staging / f".written.{self._rank}").write_bytes(pickle.dumps(results))
            if self._finish is not None:
                error = self._wait_for(lambda: self._missing() == [], "every process's part")
                if error is not None:
                    raise ConveyorIOError(error)
                gathered = [pickle.loads((self._staging / f".written.{p}").read_bytes()) for p in range(self._world)]
                for p in range(self._world):
                    os.unlink(self._staging / f".written.{p}")
                self._finish(gathered)
        except BaseException as e:  # raised by wait() in the caller's thread
            self._error = self._error or f"{type(e).__name__}: {e}"
            try:
                (self._staging / f".failed.{self._rank}").write_text(self._error)
            except OSError:
                pass

    def _missing(self) -> list[int]:
        return [p for p in range(self._world) if not (self._staging / f".written.{p}").exists()]

    def _failures(self) -> list[str]:
        return [f"process {f.name.rsplit('.', 1)[1]}: {f.read_text()}" for f in sorted(self._staging.glob(".failed.*"))]

    def _wait_for(self, ready, what: str) -> str | None:
        """None once `ready()`; else why not: a process's failure, or no byte written to the
        staging folder for the timeout."""
        grown, size = time.monotonic(), -1
        while not ready():
            failures = self._failures() if self._staging.exists() else []
            if failures:
                return "; ".join(failures)
            try:
                now_size = sum(f.stat().st_size for f in self._staging.glob("*"))
            except OSError:  # renamed, or a file replaced, meanwhile
                now_size = size
            if now_size != size:
                grown, size = time.monotonic(), now_size
            elif time.monotonic() - grown > self._timeout_s:
                return (f"waited {self._timeout_s:.0f} s for {what} with no byte written to {self._staging} "
                        f"(processes {self._missing()} had not written their parts: did they stop?)")
            time.sleep(POLL_S)
        return None
