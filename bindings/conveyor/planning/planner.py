"""Plans: the C++ planner's result as a `Plan` (a _C.Plan handle, simulated once), planning a
profiled graph on a cluster, plan documents, and what a Module's arguments fix of a plan.

    plan = conveyor.plan(g, prof, cluster_toml, batch=64)
    print(plan)                                    # the table `conveyor plan` prints
    g.split(plan.stage_nodes)                      # the planned stages, runnable
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from .. import _C
from ..arguments import TWO_STAGES_PER_RANK, recomputation
from ..errors import ConveyorValueError, GraphFormatError
from ..graph import Graph

__all__ = ["Plan", "plan", "read_plan", "cluster_text", "FixedParts"]


class Plan:
    """A plan: its stages (`stage_nodes` runs with Graph.split), replicas, schedule and
    prediction, and its table. It wraps one _C.Plan, made once by the planner or read from a
    plan document, which a pipeline takes as it is (its simulated step simulated once);
    `table`: the text str() shows (default: the plan's own table)."""

    def __init__(self, plan: _C.Plan, table: str | None = None):
        if not isinstance(plan, _C.Plan):
            raise ConveyorValueError(f"Plan wraps a plan from conveyor.plan or a plan document, not "
                                     f"{type(plan).__name__}; read a document with conveyor.planning.read_plan")
        self.handle = plan
        self.table = plan.table if table is None else table

    @property
    def document(self) -> dict:
        """The plan document (docs/formats.md) as a dict: a new one each time (changing it
        changes nothing)."""
        return json.loads(self.handle.to_json())

    @property
    def stage_nodes(self) -> list[list[int]]:
        return self.handle.stage_nodes

    @property
    def replicas(self) -> list[int]:
        """Replicas of each stage."""
        return self.handle.replicas

    @property
    def schedule(self) -> str:
        return self.handle.schedule

    @property
    def microbatches(self) -> int:
        return self.handle.microbatches

    @property
    def chunks(self) -> int:
        """Stages per pipeline rank (2 for the interleaved, ZB-V and DualPipeV schedules)."""
        return self.handle.chunks

    @property
    def predicted_step_s(self) -> float:
        return self.handle.predicted_step_s

    def save(self, path) -> None:
        """Writes the plan document (docs/formats.md), as `conveyor plan --out` does."""
        Path(path).write_text(self.handle.to_json(), encoding="utf-8")

    def __str__(self) -> str:
        return self.table

    __repr__ = __str__


def cluster_text(cluster: str | os.PathLike) -> str:
    """A cluster's TOML text: `cluster` itself, or the file it names."""
    text = str(cluster)
    if "\n" not in text and os.path.exists(text):
        text = Path(text).read_text()
    return text


def plan(graph: Graph, profile_doc: dict, cluster: str | os.PathLike, *, batch: int, microbatches: int = 0,
         schedules: list[str] | None = None, optimizer_state: float = 2.0, max_replicas: int = 0,
         max_microbatches: int = 0, even_shares: bool = False, ranks: int = 0, replicas: list[int] | None = None,
         chunks: int = 0, recompute: str | None = None) -> Plan:
    """Plans `graph` on `cluster` (a TOML file path or TOML text) for `batch` samples a step;
    `max_replicas` caps the replicas per stage (0: no cap). Every replica's share of a
    microbatch keeps at least the least batch the graph holds for (its batch range). With
    `even_shares` replicas split microbatches evenly, as conveyor's runtime does (otherwise
    in proportion to their devices' speeds, the plan's `shares`). `ranks` (pipeline ranks),
    `replicas` (one count for every stage, or one per rank) and `chunks` (interleaved stages
    per rank) fix those parts of the plan; the planner chooses the rest. `recompute`: None
    (the planner chooses per stage: a stage recomputes its activations where it would not fit
    otherwise, selectively where that is enough, else fully), or every stage's: "none",
    "selective" (its cheap operators) or "full" (its whole forward)."""
    made = _C.plan(graph.ir, json.dumps(profile_doc), cluster_text(cluster), batch, microbatches, schedules or [],
                         optimizer_state, max_replicas, max_microbatches, even_shares, ranks, replicas or [], chunks,
                         recompute)
    return Plan(made)


def read_plan(path) -> Plan:
    """A plan document written by `conveyor plan --out` or Plan.save."""
    try:
        text = Path(path).read_bytes()  # bytes: the C++ reader judges the encoding
    except OSError as e:
        raise ConveyorValueError(f"plan={str(path)!r}: cannot read it ({e.strerror})") from None
    try:
        return Plan(_C.read_plan(text))
    except GraphFormatError as e:
        raise ConveyorValueError(f"plan={str(path)!r} is not a conveyor plan document ({e}); write one with "
                                 "`conveyor plan --out` or Plan.save") from None


class FixedParts:
    """What a Module's `stages`, `replicas` and `schedule` fix of a plan; the planner chooses
    the rest. `stages=N` is N pipeline stages (with the interleaved schedule N / 2 device
    groups of 2 stages each); a `replicas` int gives every stage that many, a list one count
    per device group (it needs `stages`)."""

    def __init__(self, stages: int | None, replicas: int | list | None, schedule: str, recompute=None):
        self.ranks, self.chunks = 0, 0
        # A Module's recompute: one value (True, False, a name) fixes it for every stage; None
        # or a list (which the runtime applies as given) leave it to the planner (None), which
        # recomputes where a stage would not fit otherwise.
        self.recompute = None if recompute is None or isinstance(recompute, list) else recomputation(recompute)
        if schedule == "auto":
            # A fixed stage count keeps the schedules whose stages are the device groups.
            self.schedules = [name for name in _C.schedule_names() if not stages or _C.chunks_of(name) == 1]
        else:
            self.schedules = [schedule]
        if stages is not None:
            if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
                raise ConveyorValueError(f"stages={stages!r}: expected a number of stages (at least 1) or node lists")
            if schedule in TWO_STAGES_PER_RANK:
                if stages % 2:
                    raise ConveyorValueError(f"the {schedule} schedule needs an even number of stages, not {stages}")
                self.ranks, self.chunks = stages // 2, 2
            else:
                self.ranks = stages
        if isinstance(replicas, list):
            if stages is None:
                raise ConveyorValueError("a list of replicas needs a number of stages (stages=); without it pass an int")
            if len(replicas) != self.ranks:
                raise ConveyorValueError(f"replicas has {len(replicas)} counts but the pipeline has {self.ranks} ranks")
            self.replicas = list(replicas)
        else:
            self.replicas = [replicas] if replicas else []

    def one_replica(self) -> "FixedParts":
        """The same parts with one replica per stage fixed (a call that cannot be split)."""
        out = copy.copy(self)
        out.replicas = [1]
        return out

    def devices(self) -> int:
        """The devices the fixed parts need at least (0: nothing fixed needs any)."""
        if not self.ranks:
            return max(self.replicas, default=0)
        return sum(self.replicas) if len(self.replicas) > 1 else self.ranks * (self.replicas[0] if self.replicas else 1)

    def options(self) -> dict:
        """The planner's options for them (`plan`, `_C.Replanner`)."""
        return dict(ranks=self.ranks, replicas=self.replicas, chunks=self.chunks, recompute=self.recompute)
