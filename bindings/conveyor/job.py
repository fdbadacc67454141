"""The processes and devices a conveyor.Module runs on, and the one place its pipelines are
built over them (_C.PipelineStep)."""
from __future__ import annotations

import hashlib

import torch

from . import _C, distributed
from .arguments import recomputation
from .errors import ConveyorValueError
from .exchange import exchange
from .options import Options

__all__ = ["Job"]


class Job:
    """One process alone (its CPU split into `options.devices` virtual devices, or the
    cluster file's), or under a launcher one of `world_size` processes, one device each,
    joined into `group` on the first capture."""

    def __init__(self, options: Options):
        self.options = options
        self.world = distributed.world()  # (rank, world_size, ...) under a launcher, else None
        self.group = None
        self.devices = self.world[1] if self.world is not None else options.devices
        self._draws_seed: int | None = None

    @property
    def rank(self) -> int:
        return self.world[0] if self.world else 0

    @property
    def world_size(self) -> int:
        return self.world[1] if self.world else 1

    def join(self, fingerprint: str) -> None:
        """Across processes: this process's member of the job (every process must bring the
        same `fingerprint`: the captured model and the pipeline asked for)."""
        if self.world is None:
            return
        if self.group is None:
            self.group = distributed.process_group(fingerprint, self.options.timeout_s)
            return
        # Joined before the capture (batch_feed.py): the fingerprints are compared now.
        theirs = exchange(self.group, fingerprint, "the first capture")
        differ = [r for r, f in enumerate(theirs) if f != theirs[0]]
        if differ:
            raise ConveyorValueError(f"processes {differ} captured another model, or asked for another pipeline, than "
                                     "process 0: every process must run the same script on the same model")

    def join_before_capture(self) -> None:
        """Joins the job before the first capture (each process fed its share: the capture
        needs the whole batch); join() then compares the captures' fingerprints."""
        if self.world is not None and self.group is None:
            self.group = distributed.process_group("joined before the capture", self.options.timeout_s)

    @property
    def draws_seed(self) -> int:
        """What the steps' random operators (dropout) draw from (PipelineStep.set_draws):
        derived from torch's seed when the Module was made, process 0's (collective the first
        time), or a checkpoint's."""
        if self._draws_seed is None:
            derived = hashlib.sha256(f"{self.options.seed}:draws".encode()).digest()[:8]
            self._draws_seed = self.agreed(int.from_bytes(derived, "little") & ((1 << 63) - 1))
        return self._draws_seed

    @draws_seed.setter
    def draws_seed(self, seed: int) -> None:
        self._draws_seed = int(seed)

    def agreed(self, value: int) -> int:
        """Process 0's `value` in every process (collective across processes)."""
        if self.group is None:
            return value
        return int(self.group.broadcast_bytes(0, str(value).encode() if self.rank == 0 else b"").decode())

    def threads_per_device(self) -> int:
        """The intra-op threads each device's replica runs with."""
        if self.world is not None:
            return torch.get_num_threads()  # a process is a device
        return max(1, torch.get_num_threads() // self.devices)

    def placement(self, replicas: list, plan=None) -> dict:
        """Across processes, the process of every replica of every pipeline rank: the plan's
        device when the plan was made for this job (device d is process d); otherwise the
        replicas rank by rank, spread evenly over the processes (one each when there are as
        many processes as replicas; a rank's replicas share a process when there are fewer).
        A stage whose replicas land on several processes sums its gradients across them."""
        if self.group is None:
            return {}
        n = self.group.world_size
        document = plan.document if plan is not None else {}
        stages = document.get("stages", [])
        if plan is not None and len(document.get("devices", [])) == n and len(stages) >= len(replicas) and all(
                0 <= stages[r].get("first_device", -1) and stages[r]["first_device"] + replicas[r] <= n
                for r in range(len(replicas))):
            where = [[stages[r]["first_device"] + i for i in range(replicas[r])] for r in range(len(replicas))]
        else:
            workers = [(r, i) for r in range(len(replicas)) for i in range(replicas[r])]
            where = [[0] * k for k in replicas]
            for w, (r, i) in enumerate(workers):
                where[r][i] = w * n // len(workers)
        return dict(processes=self.group, replica_process=where, step_timeout_s=self.options.timeout_s,
                    transport=self.options.transport)

    def pipeline_of(self, graph, plan, holders: dict | None = None):
        """The plan's pipeline (`holders`: what each process holds, as _C.PipelineStep.readers
        gives it, when a re-plan or a capture switch builds it)."""
        stage_nodes = plan.stage_nodes
        return self.pipeline(graph, stage_nodes, plan.schedule, plan.microbatches, plan.chunks,
                             plan.replicas[:len(stage_nodes) // plan.chunks], plan=plan, holders=holders)

    def pipeline(self, graph, stage_nodes: list, schedule: str, microbatches: int, chunks: int, replicas: list,
                 plan=None, across_processes: bool = True, holders: dict | None = None):
        """`stage_nodes` under `schedule`, with `replicas` per rank; `plan` (when the stages
        come from one) is what the live profile compares against; across processes, every
        replica on the process `placement` gives it."""
        placement = self.placement(replicas, plan) if across_processes else {}
        planned_stages = plan.document["stages"] if plan is not None else []
        asked = self.options.recompute
        if isinstance(asked, list):
            recompute = [recomputation(r) for r in asked]
        elif plan is not None and asked is None:  # the plan's choice, stage by stage
            recompute = [recomputation(s.get("recompute", False)) for s in planned_stages]
        else:
            recompute = [recomputation(asked)] * len(stage_nodes)
        if len(recompute) != len(stage_nodes):
            raise ConveyorValueError(f"recompute has {len(recompute)} flags but the pipeline has {len(stage_nodes)} stages")
        # The plan's shares: devices of different speeds take microbatch shares to match.
        shares = [list(s.get("shares", [])) for s in planned_stages[:len(replicas)]]
        return _C.PipelineStep(graph.executor, stage_nodes, schedule, microbatches, chunks, replicas,
                               plan=plan.handle if plan is not None else None, recompute=recompute,
                               shares=shares, holders=holders or {}, **placement)
