"""One capture of a conveyor.Module's model and everything built from it: the graph, the
plan, the pipeline running it, and what re-planning keeps of them. A Module holds one
such state per capture (capture_set.py); switching captures switches the state object."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Layout", "CaptureState", "RunHistory"]


class Layout(NamedTuple):
    """The shape of a running pipeline: its stages, schedule, microbatches per step, stages
    per rank (chunks) and replicas per pipeline rank."""
    stages: int
    schedule: str
    microbatches: int
    chunks: int
    replicas: list[int]

    @staticmethod
    def of_plan(plan) -> "Layout":
        stage_nodes, chunks = plan.stage_nodes, plan.chunks
        return Layout(len(stage_nodes), plan.schedule, plan.microbatches, chunks, plan.replicas[:len(stage_nodes) // chunks])


@dataclass
class CaptureState:
    """A capture and what runs it. `pipeline` is the _C.PipelineStep of the plan (None across
    processes while another capture runs: one pipeline at a time spans the job's processes);
    `small_pipelines` run on one process the batches too small for the plan, and packed steps
    of another microbatch count, keyed by their microbatches; `plan_maker` and `replanning`
    exist where conveyor made the plan and may plan again."""
    graph: Any
    stage_nodes: list
    layout: Layout
    built_batch: int
    least_share: int  # samples a replica must run at once (the model's own bound)
    plan: Any = None
    pipeline: Any = None
    from_plan_file: bool = False
    plan_maker: Any = None
    replanning: Any = None
    planned_sizes: dict = field(default_factory=dict)
    small_pipelines: dict = field(default_factory=dict)
    trained_steps: int = 0  # training steps this capture ran (evaluations not counted)

    def use_plan(self, plan, pipeline) -> None:
        """Runs `plan` on `pipeline` from now on (a switch of plan)."""
        self.plan, self.pipeline = plan, pipeline
        self.stage_nodes = plan.stage_nodes
        self.layout = Layout.of_plan(plan)


@dataclass
class RunHistory:
    """What a Module's steps leave behind across captures and plans: the steps run, the
    switches of plan (Module.replans), the marker the next traced step carries, and the
    sizes already warned of."""
    steps_run: int = 0
    switches: list = field(default_factory=list)
    marker: str | None = None
    warned_sizes: set = field(default_factory=set)
