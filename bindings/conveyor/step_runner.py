"""The one path every step of a conveyor.Module takes, whether it came from a call
(`model(x)`, `train_step(x)`) or as packed microbatches (`conveyor.Microbatches`): the
capture that fits it, re-planning at the step boundary, a plan for larger sizes, the
pipeline that runs it, and what the step leaves behind (counters, the trace)."""
from __future__ import annotations

import time

import torch

from .batch_feed import BatchFeed
from .capture_builder import batch_of
from .capture_set import CaptureSet
from .capture_state import CaptureState, RunHistory
from .distributed.processes import this_process_file
from .errors import ConveyorValueError
from .exchange import exchange
from .job import Job
from .memory import reset_device_peak
from .microbatches import Microbatches, is_packed
from .planning.plan_maker import plan_for_larger_sizes
from .planning import Plan
from .planning.plan_switch import switch_to
from .planning.replanning_trace import STEPS, ReplanningTimeline, timeline_path
from .users_rng import users_rng_kept

__all__ = ["StepRunner"]


class StepRunner:
    """Runs a Module's steps over its captures (`captures.current` is the one in use)."""

    def __init__(self, captures: CaptureSet, job: Job, optimizer, history: RunHistory, trace, batches: str = "same"):
        self.captures, self.job, self.optimizer, self.history, self.trace = captures, job, optimizer, history, trace
        self.feed = BatchFeed(job, batches)
        self.timeline = None  # process 0, with trace= and re-planning: its timeline across steps

    def calls_of(self, args: tuple, kwargs: dict) -> tuple[list[list], bool] | None:
        """The flattened inputs of this call's step, and whether they are packed
        microbatches, with the capture that fits them in use (captured and built on the first
        call); None for an eval-mode call that cannot be captured (CaptureSet.take_up)."""
        if is_packed(args, kwargs):
            if self.feed.mode != "same":
                raise ConveyorValueError("packed Microbatches are the whole step's batch: with batches='shares' call "
                                         "the model on each process's share instead")
            return self._packed_calls(args[0]), True
        args, kwargs = self.feed.whole_batch(args, kwargs)
        if not self.captures.take_up(args, kwargs):
            return None
        self.feed.check(args, kwargs)
        return [self.captures.current.graph.flatten_inputs(args, kwargs)], False

    def _packed_calls(self, packed: Microbatches) -> list[list]:
        if not (torch.is_grad_enabled() and self.captures.model.training):
            raise ConveyorValueError("Microbatches are one training step; to evaluate, call the model on each batch")
        first_args, first_kwargs = packed.calls[0]
        graph = self.captures.select(first_args, first_kwargs, packed).graph
        calls = []
        for k, (args, kwargs) in enumerate(packed.calls):
            try:
                calls.append(graph.flatten_inputs(args, kwargs))
            except ConveyorValueError as e:  # the counts of targets run the inputs (counted_targets.py)
                raise type(e)(f"microbatch {k}: {e}") from e
        calls = graph.counted_over(calls)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for inputs in calls for t in inputs):
            raise ConveyorValueError("an input of the packed microbatches requires a gradient, which a packed step does "
                                     "not compute; pass inputs that need gradients as one batch (model(x) or "
                                     "train_step(x))")
        return calls

    def train(self, calls: list[list], packed: bool, hold_gradients: bool):
        """One training step over `calls` (calls_of's): the loss and the pipeline that ran it."""
        state = self.captures.current
        started = time.perf_counter()
        with users_rng_kept(self.captures.model):
            self._maybe_replan(state, started)
            plan_for_larger_sizes(state, calls, job=self.job, optimizer=self.optimizer, history=self.history,
                                  gather_whole_model=self.captures.gather_for_profiling)
        pipeline = self._pipeline_for(state, calls, packed)
        pipeline.set_draws(self.job.draws_seed, self.history.steps_run)  # step k draws alike on any pipeline
        reset_device_peak(state.graph)
        if packed:
            loss, _, _ = pipeline.run_packed(calls, hold_gradients=hold_gradients)
        else:
            loss, _, _ = pipeline.run(calls[0], hold_gradients=hold_gradients)
        self.history.steps_run += 1
        state.trained_steps += 1
        if pipeline is state.pipeline and state.replanning is not None:
            state.replanning.ran_step(self.history.steps_run)
            self._on_timeline(state.replanning, started)
        if self.trace is not None and (self.history.steps_run <= 2 or self.history.marker is not None):
            # The second step (past warm-up), or the first after a switch of plan, marked.
            markers = [(0.0, self.history.marker)] if self.history.marker is not None else []
            self.history.marker = None
            self._write_trace(pipeline, markers)
        return loss, pipeline

    def _on_timeline(self, replanning, started: float) -> None:
        """The step just run, on process 0's re-planning timeline (with trace= only): from its
        call's start, the window's boundary included, to the end of its run."""
        if self.trace is None or replanning.replanner is None:
            return
        if self.timeline is None:
            self.timeline = ReplanningTimeline(timeline_path(self.trace), origin=started)
        replanning.timeline = self.timeline
        self.timeline.span(STEPS, f"step {self.history.steps_run}", started, time.perf_counter())

    def _write_trace(self, pipeline, markers: list) -> None:
        """The step's trace at `trace=`; across processes, each writes its own replicas' to
        <stem>.rank<R><suffix> too, and process 0 writes the job's at `trace=` itself: every
        process's tracks, and a flow from each send to its receive in whichever process."""
        group = self.job.group
        if group is None:
            pipeline.write_trace(str(self.trace), markers)
            return
        pipeline.write_trace(str(this_process_file(self.trace)), markers)
        records = exchange(group, pipeline.trace_record(), "the job's trace")
        if group.rank == 0:
            pipeline.write_job_trace(str(self.trace), records, markers)

    def evaluate(self, inputs: list) -> torch.Tensor:
        """The forwards alone over one call's inputs, through the same stages and processes."""
        loss, _, _ = self._pipeline_for(self.captures.current, [inputs], packed=False).evaluate(inputs)
        return loss

    def switch_plan(self, plan: Plan) -> None:
        """The capture in use runs `plan` from the next step on (collective across processes)."""
        switch_to(self.captures.current, plan, None, job=self.job, optimizer=self.optimizer, history=self.history)

    def _maybe_replan(self, state: CaptureState, started: float) -> None:
        """At a step boundary (the call began at `started`): a re-planning window's boundary when
        one is due, and the decision due now, with its switch."""
        if state.replanning is None:
            return
        decision = state.replanning.at_step_boundary(state.pipeline, self.history.switches, state.plan, started)
        if decision is not None and decision["switch"]:
            switch_to(state, Plan(decision["candidate"]), decision, job=self.job,
                      optimizer=self.optimizer, history=self.history)

    def _pipeline_for(self, state: CaptureState, calls: list[list], packed: bool):
        """The pipeline that runs this step: the plan's, except on one process for
        - packed microbatches of another count than the plan's: the same stages and replicas
          with as many microbatches as were packed;
        - a batch smaller than the one the pipeline was built for and too small to give every
          replica of every microbatch the samples the model runs at once (a data loader's last
          batch): the same stages with one replica each and as many microbatches as it allows,
          the same gradient accumulation over the same batch.
        Across processes, or for the batch the pipeline was built for, the plan's pipeline
        refuses what it cannot run, naming what to change."""
        _, schedule, m, chunks, replicas = state.layout
        ranks = len(replicas)
        if packed:
            k = len(calls)
            if k == m:
                return state.pipeline
            if self.job.group is not None:
                raise ConveyorValueError(f"packed {k} microbatches but the plan runs {m} a step across processes; "
                                         f"pack {m} (model.microbatches), or fix microbatches={k} when making the "
                                         "Module")
            if chunks > 1 and k % ranks:
                raise ConveyorValueError(f"the {schedule} schedule runs a multiple of {ranks} microbatches; packed {k}")
            return self._small(state, ("packed", k), schedule, k, replicas)
        batch, least = batch_of(calls[0]), state.least_share
        if (batch is None or self.job.group is not None or batch >= state.built_batch
                or batch // m // max(replicas) >= least):
            return state.pipeline
        fitting = [k for k in range(min(m, batch // least), 0, -1) if chunks == 1 or k % ranks == 0]
        if not fitting:
            return state.pipeline  # nothing runs it: the plan's pipeline names the sizes
        # DualPipeV needs 2 microbatches a stage; ZB-V places the stages alike and does not.
        return self._small(state, fitting[0], "zb-v" if schedule == "dualpipev" else schedule, fitting[0],
                           [1] * ranks)

    def _small(self, state: CaptureState, key, schedule: str, microbatches: int, replicas: list):
        if key not in state.small_pipelines:
            state.small_pipelines[key] = self.job.pipeline(state.graph, state.stage_nodes, schedule, microbatches,
                                                           state.layout.chunks, replicas, across_processes=False)
        return state.small_pipelines[key]
