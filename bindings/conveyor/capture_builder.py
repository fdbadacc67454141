"""Capturing a conveyor.Module's model on a call and building what runs it: the plan
(planned from a profile, read from a plan file, or the user's own node lists) and its
pipeline, as one CaptureState."""
from __future__ import annotations

import hashlib
import json
import time
import warnings

import torch

from . import _C
from .call_splitting import (refuse_to_split, warn_of_a_loss_split_changes, warn_of_statistics_per_share,
                             why_calls_stay_whole)
from .capture import capture, modes_of
from .capture_state import CaptureState, Layout
from .errors import CaptureError, ConveyorValueError, NotALossError
from .job import Job
from .loss_wrapper import loss_wrapper
from .materialize import exported_on_meta, materialize, restore_placeholders
from .memory import stage_tensors
from .microbatches import Microbatches
from .progress import phase
from .options import Options
from .planning.plan_maker import PlanMaker, local_cluster, model_gpu_memory
from .planning import read_plan
from .planning.replanning import Replanning
from .sizes import check_max_sizes, largest_sizes

__all__ = ["build_capture", "batch_of"]


def plan_line(plan) -> str:
    """A plan in one line: stages, replicas, schedule, microbatches, the predicted step."""
    replicas = plan.replicas
    shown = f"replicas {replicas}" if any(r > 1 for r in replicas) else "1 replica each"
    return (f"{len(plan.stage_nodes)} stage{'s' if len(plan.stage_nodes) != 1 else ''} ({shown}), {plan.schedule}, "
            f"{plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''}; predicted step "
            f"{plan.predicted_step_s * 1e3:.1f} ms")


def batch_of(inputs: list) -> int | None:
    """The batch size of a call: dim 0 of its first tensor that has dimensions."""
    return next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)


def _least_share(graph) -> int:
    """The fewest samples the captured graph holds for (its batch range's min, docs/formats.md);
    1 where the model sets no bound."""
    ranges = graph.document.get("ranges", {})
    return max([1] + [ranges[s].get("min", 1) for s, role in graph.document["symbols"].items()
                      if role == "batch" and s in ranges])


def _job_fingerprint(options: Options, graph, batch: int) -> str:
    """What every process of the job must agree on: the captured model and the pipeline asked for."""
    asked = repr((options.stages, options.replicas, options.microbatches, options.schedule, options.cluster, batch))
    text = json.dumps(graph.document, sort_keys=True, default=str) + asked
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """Where a call's tensors live (a meta-built model's graph runs there)."""
    return next((x.device for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _off_meta(name: str, t: torch.Tensor, device) -> torch.Tensor:
    """A tensor the graph binds, after a capture on meta twins: the model's own, or a constant
    the model made while it ran (an empty cache): made on `device` where it holds no values."""
    if not t.is_meta:
        return t
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    raise CaptureError(f"{name}: the model made a tensor of {tuple(t.shape)} values while it ran, which a model built "
                       "on the meta device cannot give; make it in the model's __init__ as a buffer (its initializers "
                       "then set it), or build the model on a real device")


def _capture_loss(model, options: Options, args: tuple, kwargs: dict):
    """The model's graph on this call, its forward returning one scalar loss (a model built
    on the meta device exported on meta twins of its tensors and inputs, then bound to its own)."""
    wrapper = loss_wrapper(model, options.loss_fn, args, kwargs)
    if options.meta_built:
        on_meta = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in (*args, *kwargs.values())]
        with exported_on_meta(model, shapes=options.meta_shapes) as own:
            graph = capture(wrapper, tuple(on_meta[:len(args)]), dict(zip(kwargs, on_meta[len(args):])),
                            meta_runs_on=_device_of(args, kwargs), guards=options.guards)
        graph.rebind({name: _off_meta(name, own.get(id(t), t), _device_of(args, kwargs))
                      for name, t in graph.tensors.items()})
        restore_placeholders(graph.tensors.values(), options.meta_shapes)  # released here: the executor checks shapes
    else:
        graph = capture(wrapper, args, kwargs, guards=options.guards)
    graph.modes = modes_of(model)  # a call in another mode needs another capture
    graph.output_type = wrapper.output_type()  # what a call returns with returns="model" (as_model.py)
    outputs = graph.document["outputs"]
    if len(outputs) != 1 or graph.document["values"][outputs[0]].get("shape") != []:
        raise NotALossError(f"the model's forward must return one scalar loss to be trained pipelined (it returns "
                            f"{len(outputs)} value{'s' if len(outputs) != 1 else ''}: "
                            f"{', '.join(graph.document['values'][v]['name'] for v in outputs[:4])}); compute the "
                            "loss inside forward, wrap the model so that it does, or pass loss_fn= and target=")
    unseeded = graph.executor.unseeded_random_nodes()
    if unseeded:
        ops = sorted({graph.document["nodes"][n]["op"] for n in unseeded})
        warnings.warn(f"conveyor: {len(unseeded)} random operators ({', '.join(ops)}) take no generator, so they "
                      "draw from torch's global one: their draws depend on thread timing and on which process runs "
                      "them (dropout of every kind, attention dropout, rand, randn and bernoulli draw reproducibly)",
                      stacklevel=6)
    return graph


def _made_here(model, options: Options, job: Job, graph, stage_nodes: list, layout: Layout, device,
               plan=None) -> dict | None:
    """A model built on the meta device: this process makes on `device` (the call's) and
    initializes the tensors its stages read under this layout, and those no stage reads; the
    rest stay placeholders. Across processes, returns who holds each tensor then (its
    readers: each made it alike), for the pipeline to start from instead of gathering it."""
    if not options.meta_built:
        return None
    bound = {b["name"] for b in graph.document["bindings"] if b["kind"] != "constant"}
    read = {id(graph.tensors[n]) for n in bound}
    unread = [t for t in [*model.parameters(), *model.buffers()] if id(t) not in read]
    seed = job.agreed(options.seed)
    if job.group is None:
        materialize(model, [graph.tensors[n] for n in bound] + unread, device, seed=seed, init=options.init)
        return None
    where = job.placement(layout.replicas, plan)["replica_process"]
    ranks = len(layout.replicas)
    readers: dict[str, set[int]] = {}
    for r in range(ranks):
        nodes = [n for s in _C.stages_of_rank(layout.schedule, ranks, layout.chunks, r) for n in stage_nodes[s]]
        for name in stage_tensors(graph, nodes):
            readers.setdefault(name, set()).update(where[r])
    mine = [graph.tensors[n] for n, processes in readers.items() if job.rank in processes]
    materialize(model, mine + unread, device, seed=seed, init=options.init)
    return {name: sorted(processes) for name, processes in readers.items()}


def build_capture(model, optimizer, options: Options, job: Job, args: tuple, kwargs: dict, *,
                  packed: Microbatches | None = None, plan_file_taken: bool = False,
                  holders: dict | None = None) -> CaptureState:
    """Captures `model` on this call (`packed`: a first step of packed microbatches, the call
    its first one), then runs the user's node lists, or the plan file (the first train-mode
    capture's, unless `plan_file_taken`: another capture has other nodes), or plans it.
    `holders`: what each process holds, where the pipeline starts from them (a meta-built
    model's later captures: _C.PipelineStep.readers's form)."""
    with torch.enable_grad():  # an evaluation's first call builds as a step's would
        with phase(options.verbose, job.rank) as said:
            graph = _capture_loss(model, options, args, kwargs)
            said["text"] = (f"captured {type(model).__name__}: {len(graph.document['nodes'])} operators, "
                            f"{len(graph.tensors)} parameters and buffers")
        batch = (sum(packed.rows()) if packed is not None else batch_of(graph.flatten_inputs(args, kwargs))) or 1
        least = _least_share(graph)
        whole = None if packed is not None else why_calls_stay_whole(model, graph, batch)
        if whole:
            refuse_to_split(whole, options.microbatches, options.replicas)
        job.join(_job_fingerprint(options, graph, batch))
        if options.stages_given:
            state = _given_stages(model, graph, options, job, batch, least, whole, packed, _device_of(args, kwargs))
        elif options.plan_file is not None and not plan_file_taken and model.training:
            plan = read_plan(options.plan_file)
            if whole:
                refuse_to_split(whole, plan.microbatches, max(plan.replicas), f"the plan {options.plan_file}")
            made = _made_here(model, options, job, graph, plan.stage_nodes, Layout.of_plan(plan),
                              _device_of(args, kwargs), plan)
            state = CaptureState(graph, plan.stage_nodes, Layout.of_plan(plan), batch, least, plan=plan,
                                 pipeline=job.pipeline_of(graph, plan, holders or made), from_plan_file=True)
        else:
            state = _planned(model, optimizer, graph, options, job, args, kwargs, batch, least, whole, packed,
                             holders)
    if job.rank == 0:  # the job's shape, the same in every process: said once, as the phases are
        warn_of_a_loss_split_changes(state.pipeline, state.layout.microbatches, state.layout.replicas,
                                    state.graph.document)
        warn_of_statistics_per_share(state.graph.document, state.layout.microbatches, state.layout.replicas)
    return state


def _given_stages(model, graph, options: Options, job: Job, batch: int, least: int, whole, packed,
                  device) -> CaptureState:
    """The user's own cut, run as given."""
    stage_nodes = options.stages
    schedule = "1f1b" if options.schedule == "auto" else options.schedule
    chunks = _C.chunks_of(schedule)
    if len(stage_nodes) % chunks:
        raise ConveyorValueError(f"the {schedule} schedule needs an even number of stages, not {len(stage_nodes)}")
    ranks = len(stage_nodes) // chunks
    replicas = options.replicas if isinstance(options.replicas, list) else [options.replicas or 1] * ranks
    if len(replicas) != ranks:
        raise ConveyorValueError(f"replicas has {len(replicas)} counts but the pipeline has {ranks} ranks")
    m = options.microbatches or (len(packed) if packed is not None else 1 if whole else
                                 max(1, min(batch // (max(replicas) * least), 2 * ranks)))
    layout = Layout(len(stage_nodes), schedule, m, chunks, list(replicas))
    made = _made_here(model, options, job, graph, stage_nodes, layout, device)
    return CaptureState(graph, stage_nodes, layout, batch, least,
                        pipeline=job.pipeline(graph, stage_nodes, schedule, m, chunks, replicas, holders=made))


def _planned(model, optimizer, graph, options: Options, job: Job, args: tuple, kwargs: dict, batch: int, least: int,
             whole, packed, holders) -> CaptureState:
    """Profiled on one microbatch of this call and planned for the job's devices."""
    fixed = options.fixed.one_replica() if whole else options.fixed
    job.devices = max(job.devices, fixed.devices())  # every fixed stage replica gets a device to plan for
    # A packed first step: its microbatches are the plan's, its largest sizes planned for.
    m_hint = options.microbatches or (len(packed) if packed is not None else 1 if whole else 0)
    # Microbatches keep at least two samples (BatchNorm needs them), unless fixed.
    sample = max(1, batch // m_hint) if m_hint else min(batch, max(2, least, batch // (2 * job.devices)))
    most_microbatches = 1 if whole else max(1, batch // max(2, least))
    # The profile's example: the call's rows (a packed step's microbatch with most rows).
    example = graph.flatten_inputs(*(packed.calls[packed.rows().index(max(packed.rows()))]
                                     if packed is not None else (args, kwargs)))
    first = batch_of(example)
    example = [a[:sample] if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == first else a
               for a in example]
    check_max_sizes(graph, options.max_sizes)  # on every process: a bad one fails them all alike
    calls = [graph.flatten_inputs(*call) for call in packed.calls] if packed is not None else []
    sizes = largest_sizes(graph, calls, options.max_sizes)
    cluster = options.cluster or local_cluster(job.devices, job.threads_per_device(), model_gpu_memory(model),
                                               one_gpu=job.group is None)
    maker = PlanMaker(graph, example, batch=batch, microbatches=m_hint, most_microbatches=most_microbatches,
                      fixed=fixed, cluster=cluster, optimizer=optimizer, group=job.group,
                      threads=job.threads_per_device(), horizon_steps=options.replan_horizon)
    with phase(options.verbose, job.rank) as said:
        prof = maker.profile(sizes)
        if prof is not None:
            said["text"] = (f"profiled {prof.get('units', '?')} units, {prof.get('units_measured', '?')} measured "
                            "(the others alike)")
    with phase(options.verbose, job.rank) as said:
        plan = maker.plan(prof)
        said["text"] = f"planned: {plan_line(plan)}"
    with phase(options.verbose, job.rank) as said:
        made = _made_here(model, options, job, graph, plan.stage_nodes, Layout.of_plan(plan), _device_of(args, kwargs),
                          plan)
        built_at = time.perf_counter()
        pipeline = job.pipeline_of(graph, plan, holders or made)
        build_s = time.perf_counter() - built_at
        said["text"] = f"built the pipeline on {job.world_size if job.group is not None else job.devices} devices"
    state = CaptureState(graph, plan.stage_nodes, Layout.of_plan(plan), batch, least, plan=plan, pipeline=pipeline,
                         planned_sizes=dict(maker.sizes))
    if options.replan == "auto":
        state.plan_maker = maker
        state.replanning = Replanning(maker.replanner(prof, plan), job.group, _device_of(args, kwargs), build_s,
                                      optimizer)
    return state
