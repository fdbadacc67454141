"""Captures of one model for the sizes and arguments it fixes: a model that branches on a
size (a sequence length, an image size) is captured for its example's side of the branch
(the size fixed, or symbolic within the branch's bound), so a call with a size on the other
side needs another graph; so does a call whose non-tensor arguments (a flag, a temperature)
differ from the capture's, which the graph holds as constants, and a call in the other
mode (model.eval(): BatchNorm's running statistics, no dropout, the model's own branches
on self.training), which the graph holds as its operators. conveyor.Module keeps one
pipeline per such capture (a CaptureState), built on the first call that needs it, and switches between
them call by call (across processes a capture's pipeline is built again at each switch,
from what the other capture's stages held)."""
from __future__ import annotations

import warnings

import torch

from .capture import modes_of
from .capture_builder import build_capture
from .capture_state import CaptureState, RunHistory
from .checkpoint import CheckpointTensors
from .errors import CaptureError, ConveyorError, ConveyorValueError, NotALossError
from .job import Job
from .live_profile import as_it_stood, live_profile
from .microbatches import Microbatches
from .options import Options
from .planning.plan_switch import carry_optimizer_state
from .sizes import input_dims, range_text
from .users_rng import users_rng_kept

__all__ = ["CaptureSet", "call_mismatch", "fixed_size_mismatch", "MOST_CAPTURES"]

MOST_CAPTURES = 16  # beyond this many, a model that fixes a size is asked to pad batches instead


def call_mismatch(graph, args: tuple, kwargs: dict, modes: tuple) -> tuple[str, str] | None:
    """Why `graph` cannot run this call (its modules' train/eval flags: `modes`, as
    capture.modes_of gives them) as captured, and what lets few captures serve such calls:
    another mode (no hint: a capture per mode is expected), a non-tensor argument of another
    value (the graph holds them as constants), or a size the capture fixed; None when the
    call fits."""
    if graph.modes and modes != graph.modes:
        if modes[0] != graph.modes[0]:
            return f"the model is in {'train' if modes[0] else 'eval'} mode", ""
        return "a module's train/eval flag differs from the capture's", ""
    changed = graph.constant_mismatch(args, kwargs)
    if changed is not None:
        return (f"{changed}: the graph holds the model's non-tensor arguments as constants",
                "pass a value that changes from call to call as a tensor")
    size = fixed_size_mismatch(graph, graph.user_inputs(args, kwargs))
    if size is not None:
        return f"{size}: the model fixes that size", "pad batches to a few sizes (bucket the lengths) so that few " \
                                                     "captures serve them"
    return None


def fixed_size_mismatch(graph, inputs: list) -> str | None:
    """Where `inputs` (flattened) differ from `graph` in a size the capture fixed, or lie
    outside the range a branch of the model bounds a symbolic size to: "input_ids dim 1 is 20
    (captured fixed at 12)", "ids dim 1 is 6 (the capture holds 11 and more)"; None when they
    fit (the inputs may still be wrong in other ways, which the graph's own checks name). The
    batch's range is about shares, which the pipeline checks."""
    doc = graph.document
    if len(inputs) not in (len(doc["inputs"]), len(doc["inputs"]) - len(graph.counted_targets)):
        return None
    ranges, symbols = doc.get("ranges", {}), doc.get("symbols", {})
    for _, name, x, d, size in input_dims(graph, inputs):
        where = f"{name} dim {d} is {x.shape[d]}"
        if isinstance(size, int) and x.shape[d] != size:
            return f"{where} (captured fixed at {size})"
        bounds = ranges.get(size) if isinstance(size, str) and symbols.get(size) != "batch" else None
        if bounds and not bounds.get("min", 0) <= x.shape[d] <= bounds.get("max", x.shape[d]):
            return f"{where} (the capture holds {range_text(bounds)})"
    return None


class CaptureSet:
    """Every capture of a Module's model: `current`, the one in use (None before the first
    call), and the others, stashed. A call takes up the capture that fits it, capturing and
    building a new one where none does; switching captures switches the CaptureState."""

    def __init__(self, model, optimizer, options: Options, job: Job, history: RunHistory):
        self.model, self.optimizer, self.options, self.job, self.history = model, optimizer, options, job, history
        self.current: CaptureState | None = None
        self._stashed: list[CaptureState] = []
        self._uncapturable: set[tuple] = set()  # eval modes (capture.modes_of) that cannot be captured
        # The live profile of the capture that trained last, kept when another took over (an
        # evaluation's): Module.profile_report's while the capture in use has not trained.
        self.kept_profile = None
        # Across processes, per parameter and buffer, the processes that hold it whole and
        # current with its optimizer state: the readers under the last pipeline that read it
        # (a capture's pipeline leaves what its graph does not read as it found it); a tensor
        # no pipeline has read yet is held by every process, as the job began.
        self._holders: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._stashed) + 1

    def _build(self, args: tuple, kwargs: dict, packed: Microbatches | None = None,
               holders: dict | None = None) -> CaptureState:
        taken = any(s.from_plan_file for s in [self.current, *self._stashed] if s is not None)
        with users_rng_kept(self.model):
            return build_capture(self.model, self.optimizer, self.options, self.job, args, kwargs, packed=packed,
                                 plan_file_taken=taken, holders=holders)

    def take_up(self, args: tuple, kwargs: dict) -> bool:
        """Makes the capture of this call's mode, sizes and arguments current (select),
        captured and built on the first call. False for a call in an eval mode that cannot be
        captured, or whose model returns outputs rather than a loss (inference; said once,
        naming why): the caller evaluates the model whole, as eager, and returns what it
        returns; in train mode the error is raised."""
        modes = modes_of(self.model)
        if modes in self._uncapturable:
            return False
        try:
            self.select(args, kwargs)
        except (CaptureError, NotALossError) as e:
            if modes[0]:
                raise
            self._uncapturable.add(modes)
            why = "returns outputs, not a loss" if isinstance(e, NotALossError) else "cannot be captured"
            warnings.warn(f"conveyor: the model in eval mode {why}, so it is evaluated whole and unpipelined on every "
                          f"process (it must fit one device): {e}", stacklevel=4)
            return False
        return True

    def select(self, args: tuple, kwargs: dict, packed: Microbatches | None = None) -> CaptureState:
        """The capture whose fixed sizes and arguments `args`, `kwargs` fit, made current and
        returned; when none fits, captured, planned and built for them (`packed`: a packed
        step's, its first call). A size the model cannot take at all (a weight's width) gets
        the captured graph's own error. Across processes every process changes capture at the
        same call (they are fed the same batches): the pipeline of the capture taken up is
        built again from what the other's stages held, parameters and optimizer state moving
        as a re-plan moves them."""
        if self.current is None:
            self.current = self._build(args, kwargs, packed)
            return self.current
        modes = modes_of(self.model)
        found = call_mismatch(self.current.graph, args, kwargs, modes)
        if found is None:
            return self.current
        mismatch, hint = found
        if self.options.stages_given:
            raise ConveyorValueError(f"{mismatch}, and the stages given as node lists name the nodes of one capture; "
                                     "pass a number of stages, or call the model as it was captured")
        group = self.job.group
        holders = {}
        if group is not None:
            self._holders.update(self.current.pipeline.readers())
            everyone = list(range(group.world_size))
            holders = {name: self._holders.get(name, everyone)
                       for name in {*self._holders, *self.current.graph.tensors}}
        for k, saved in enumerate(self._stashed):
            if call_mismatch(saved.graph, args, kwargs, modes) is None:
                self._stashed[k] = self._stash()
                self._resume(saved, holders)
                return self.current
        if len(self) >= MOST_CAPTURES:
            raise ConveyorValueError(f"{mismatch}, and {len(self)} captures of the model exist already; {hint}")
        if group is not None and not self.options.meta_built:
            self.gather_whole_model()  # process 0 profiles the whole model; the new pipeline starts from it
        saved = self._stash()
        try:
            # A meta-built model is profiled unit by unit; its new pipeline starts from the holders.
            self.current = self._build(args, kwargs, holders=holders if self.options.meta_built else None)
        except CaptureError:
            self._resume(saved, holders)
            # Inputs the capture in use refuses are named (checked, not run: running it would
            # update a train-mode BatchNorm's statistics on a call in eval mode).
            self.current.graph.executor.check_inputs(self.current.graph.flatten_inputs(args, kwargs))
            raise
        except BaseException:
            self._resume(saved, holders)
            raise
        if group is not None:
            carry_optimizer_state(self.current.pipeline, self.current.graph.tensors, self.optimizer, group, holders)
        self._stashed.append(saved)
        if hint:  # not the other mode's capture, which is expected: a sign of sizes to bucket
            warnings.warn(f"conveyor: {mismatch}, so conveyor captures it again for this call; {len(self)} captures "
                          "of the model now exist (one graph and pipeline each)", stacklevel=4)
        return self.current

    def gather_for_profiling(self) -> None:
        """What profiling a new size needs: the whole model in every process, except for a
        meta-built model, which the profiler makes unit by unit (collective)."""
        if not self.options.meta_built:
            self.gather_whole_model()

    def gather_whole_model(self) -> None:
        """Across processes: the whole model, every part from its owner, in every process
        (collective; the next training step frees again what this process's stages do not
        read). Every parameter and buffer that only the other captures read (the other
        branch's weights) comes from the lowest process that holds it."""
        group, state = self.job.group, self.current
        if self.options.meta_built:
            raise ConveyorValueError("the model was built on the meta device, so no process may hold it whole: save "
                                     "it with model.save_checkpoint(path) (each process writes its part) or "
                                     "model.save_pretrained(path), and load with load_checkpoint / load_pretrained")
        if group is None or state is None or state.pipeline is None:
            return
        state.pipeline.gather_state()
        current = set(state.pipeline.readers())  # what the pipeline in use gathered
        others: dict[str, tuple] = {}
        for graph in [saved.graph for saved in self._stashed]:
            for b in graph.document["bindings"]:
                name = b["name"]
                if name not in current and name not in others and name in self._holders:
                    others[name] = (graph.tensors[name], graph.document["values"][b["value"]]["shape"])
        with torch.no_grad():
            for name in sorted(others):
                t, shape = others[name]
                if list(t.shape) != list(shape):  # released here by the pipeline that read it
                    t.data = torch.empty(shape, dtype=t.dtype, device=t.device)
                group.broadcast(t, min(self._holders[name]))

    def _stash(self) -> CaptureState:
        """The capture in use, put aside (across processes without its pipeline: its actors
        stop before another pipeline's start); its live profile kept if it trained."""
        state = self.current
        if state.pipeline is not None and state.trained_steps:
            try:
                self.kept_profile = as_it_stood(live_profile(state, self.optimizer, self.history.switches),
                                                self.history.steps_run)
            except ConveyorError:  # a pipeline out of step reports nothing: no report kept
                self.kept_profile = None
        if self.job.group is not None:
            if state.replanning is not None:  # its windows end with its pipeline
                state.replanning.settle()
            state.pipeline = None
            state.small_pipelines = {}
        self.current = None
        return state

    def _resume(self, state: CaptureState, holders: dict) -> None:
        """`state` in use again; across processes its pipeline built again from what `holders`
        hold (a stashed capture keeps no pipeline there: only one runs at a time over the
        job's processes)."""
        self.current = state
        group = self.job.group
        if group is None or state.pipeline is not None:
            return
        state.pipeline = self.job.pipeline_of(state.graph, state.plan, holders=holders)
        carry_optimizer_state(state.pipeline, state.graph.tensors, self.optimizer, group, holders)
        if state.replanning is not None:  # its windows count the new pipeline's steps, which its live profile holds
            state.replanning.restart_windows()

    def checkpoint_tensors(self) -> CheckpointTensors:
        """The model's tensors, with the process that owns each under the running plan and
        whether this process holds it (what a checkpoint's save writes and its load fills)."""
        group = self.job.group
        rank = group.rank if group is not None else 0
        states = [s for s in [self.current, *self._stashed] if s is not None]
        by_name, shapes = {}, {}
        for graph in [s.graph for s in states]:
            for b in graph.document["bindings"]:
                if b["kind"] != "constant" and b["name"] in graph.tensors:
                    by_name[b["name"]] = graph.tensors[b["name"]]
                    shapes[id(graph.tensors[b["name"]])] = list(graph.document["values"][b["value"]]["shape"])
        owner_of, readers = {}, {}
        if group is not None and self.current is not None and self.current.pipeline is not None:
            readers = {**self._holders, **self.current.pipeline.readers()}
            owners = self.current.pipeline.owners()
            for name, ranks in readers.items():
                if name in by_name:
                    owner_of[id(by_name[name])] = owners.get(name, min(ranks))
        read_here = {id(by_name[name]) for name, ranks in readers.items() if name in by_name and rank in ranks}
        read_anywhere = {id(by_name[name]) for name in readers if name in by_name}
        return CheckpointTensors(self.model, owner_of=owner_of, shapes=shapes, rank=rank,
                                 held_here=lambda t: id(t) in read_here or id(t) not in read_anywhere)
