"""How conveyor.Module plans its model, kept so that it can plan again: on the first call
(module.py), and when a call brings a symbolic size beyond those the plan's memory was made
for (a longer sequence, a larger image), which with replan="auto" makes it profile the same
example tiled to the new sizes and plan again, keeping what the Module fixed; and the
cluster it plans for when none is given (this machine, local_cluster)."""
from __future__ import annotations

import ctypes
import json
import os

import torch

from .. import _C, errors
from ..errors import ConveyorError, ConveyorValueError
from ..memory import optimizer_state_per_param_byte
from ..sizes import largest_sizes, sizes_of, tiled_to, warn_beyond
from .planner import Plan, cluster_text, plan as make_plan
from .profiler import profile
from .plan_switch import switch_to


class PlanMaker:
    """What a Module's plans are made from: the captured graph, one microbatch of the first
    batch (the profile's example, flattened), the batch and microbatch count asked for, what
    the Module fixed, the cluster, the optimizer (its state per parameter byte) and, across
    processes, the group (process 0 profiles and plans; every process gets its plan)."""

    def __init__(self, graph, example: list, *, batch: int, microbatches: int, most_microbatches: int, fixed,
                 cluster: str, optimizer, group, threads: int, horizon_steps: int):
        self.graph, self.example = graph, example
        self.batch, self.microbatches, self.most_microbatches = batch, microbatches, most_microbatches
        self.fixed, self.cluster, self.optimizer, self.group = fixed, cluster, optimizer, group
        self.threads, self.horizon_steps = threads, horizon_steps
        self.sizes: dict[str, int] = {}  # the symbolic sizes the last profile was taken at
        self.last_profile: dict = {}  # its units, units measured (the others alike) and peak memory

    @property
    def plans_here(self) -> bool:
        """Whether this process profiles and plans (process 0, or the only one)."""
        return self.group is None or self.group.rank == 0

    def profile(self, sizes: dict[str, int]) -> dict | None:
        """The example tiled to `sizes` (by name), profiled at the intra-op threads each device's
        replica runs with; the model's gradients left as they were. None off process 0."""
        flat = tiled_to(self.graph, self.example, sizes)
        self.sizes = sizes_of(self.graph, flat)
        if not self.plans_here:
            return None
        grads = {t: t.grad for t in self.graph.tensors.values() if isinstance(t, torch.Tensor) and t.requires_grad}
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            doc = profile(self.graph, (), flat_inputs=flat)
            self.last_profile = {k: doc.get(k) for k in ("units", "units_measured", "peak_rss_bytes", "peak_device_bytes")}
            _return_freed_memory()  # what profiling freed, to the system before the stages are made
            return doc
        finally:
            torch.set_num_threads(saved_threads)
            for p, g in grads.items():
                p.grad = g

    def plan(self, prof: dict | None) -> Plan:
        """The plan for `prof` (process 0's; every process returns the same)."""
        made, refused = None, None
        if self.plans_here:
            try:
                made = make_plan(self.graph, prof, self.cluster, batch=self.batch, microbatches=self.microbatches,
                                 schedules=self.fixed.schedules,
                                 max_microbatches=self.most_microbatches,
                                 optimizer_state=optimizer_state_per_param_byte(self.optimizer), **self.fixed.options())
            except ConveyorError as e:
                refused = e
        if self.group is None:
            if refused is not None:
                raise refused
            return made
        # Process 0 plans for one device per process; every process runs that plan, or hears
        # why there is none (instead of waiting for it until the timeout). The plan travels as
        # its document; each other process reads it once into its own plan.
        if made is not None:
            sent = b"plan\0" + made.handle.to_json().encode()
        else:
            sent = f"refused\0{type(refused).__name__}\0{refused}".encode() if refused is not None else b""
        kind, _, body = self.group.broadcast_bytes(0, sent).decode().partition("\0")
        if kind == "refused":
            if refused is not None:
                raise refused
            name, _, text = body.partition("\0")
            raise getattr(errors, name, ConveyorError)(f"process 0 found no plan: {text}")
        return made if made is not None else Plan(_C.read_plan(body))

    def replanner(self, prof: dict | None, running: Plan):
        """The re-planning partitioner (partitioner/replan.h) over `prof`, from the running
        plan; None off process 0."""
        if prof is None:
            return None
        return _C.Replanner(self.graph.ir, json.dumps(prof), cluster_text(self.cluster), running.handle,
                            batch=self.batch, microbatches=self.microbatches, schedules=self.fixed.schedules,
                            max_microbatches=self.most_microbatches,
                            horizon_steps=self.horizon_steps, moves_bytes=self.group is not None,
                            probes_each_device=self.group is not None,
                            optimizer_state=optimizer_state_per_param_byte(self.optimizer), **self.fixed.options())


def plan_for_larger_sizes(state, calls: list[list], *, job, optimizer, history, gather_whole_model) -> None:
    """Before a step of a capture (a CaptureState) over `calls` (each call's inputs,
    flattened): where a symbolic size runs beyond those its plan's memory was made for, with
    replan="auto" and a plan conveyor made, the example is profiled again tiled to the larger
    sizes, planned again with what the Module fixed, and the job switches to that plan before
    the step (collective across processes: every process is fed the same batches); otherwise
    one warning per size names it and what to declare. A size no plan fits is refused before
    anything runs, the running plan kept for the sizes it holds. `gather_whole_model`: makes
    the whole model present in every process (collective), as profiling needs it."""
    seen = largest_sizes(state.graph, calls)
    planned = state.planned_sizes
    beyond = {name: size for name, size in seen.items() if size > planned.get(name, size)}
    if not beyond:
        return
    maker = state.plan_maker
    if maker is None:
        warn_beyond(planned, seen, history.warned_sizes)
        return
    # Across processes, profiling needs the whole model where process 0 runs only its stages:
    # every part from its owner (collective; the next step frees again what is not read).
    gather_whole_model()
    what = ", ".join(f"{name} is {size} (planned for {planned[name]})" for name, size in sorted(beyond.items()))
    prof = maker.profile({**planned, **beyond})
    try:
        plan = maker.plan(prof)
    except ConveyorError as e:
        maker.sizes = dict(planned)
        raise ConveyorValueError(f"{what}, and no plan holds it: {e}. Nothing ran; the "
                                 "running plan still takes the sizes it was made for (cut the batch's rows or "
                                 "its length, or add memory)") from None
    switch_to(state, plan, None, job=job, optimizer=optimizer, history=history,
              reason=f"{what}: planned again for the larger size")
    state.planned_sizes = dict(maker.sizes)
    if state.replanning is not None:
        state.replanning.replanner = maker.replanner(prof, plan)


def _return_freed_memory() -> None:
    """glibc keeps freed heap for reuse; malloc_trim hands it back (elsewhere: nothing)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def local_cluster(devices: int, threads: int, gpu_memory: int | None = None, one_gpu: bool = True) -> str:
    """This machine as `devices` devices. On the CPU: virtual devices of `threads` intra-op
    threads each; with more threads in all than cores they share the cores, each at cores /
    threads' speed. On a GPU of `gpu_memory` bytes: `one_gpu` (one process) splits that GPU
    into virtual devices sharing its memory and compute, handing values over in device
    memory; otherwise (one process per GPU) each device is a whole GPU, its values crossing
    between processes through host memory."""
    if gpu_memory is not None:
        memory = gpu_memory // devices if one_gpu else gpu_memory
        speed = 1.0 / devices if one_gpu else 1.0
        bandwidth, latency = ("300 GB/s", "10 us") if one_gpu else ("10 GB/s", "50 us")
    else:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices
        except (ValueError, OSError):
            memory = (8 << 30) // devices
        speed = min(1.0, torch.get_num_threads() / (devices * threads))
        bandwidth, latency = "10 GB/s", "5 us"
    return (f'name = "local"\n[[node]]\ndevices = {devices}\nmemory = {memory}\nspeed = {speed}\n'
            f'[link.intra_node]\nbandwidth = "{bandwidth}"\nlatency = "{latency}"\n')


def model_gpu_memory(module: torch.nn.Module) -> int | None:
    """The memory of the GPU the model's parameters live on, or None for a CPU model."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory
