"""Memory per device: what the plan predicted against what the last step held.

A device's measured peak is what its stages found held (their parameters and buffers, and
on the replica that applies the optimizer its state) plus the most its compute held at
once during the step: on the CPU, what the replica's thread allocated through torch's
allocator (`PipelineStep.memory_peaks`: activations, gradients, working memory); on CUDA,
the process's allocator peak (torch.cuda.max_memory_allocated) where the process runs one
device: the stages' tensors, the step's own (its peak over what the allocator held as it
began), and what else the process held there then (`other_bytes`: the batch, and the cuBLAS
workspace torch keeps per stream that has run a matrix product, which no plan counts; on an
H200 the measured peak of a 5 MiB plan was 135 MiB). The prediction is the plan's
`memory_bytes` of the device's stages.
"""
from __future__ import annotations

import torch


def optimizer_state_per_param_byte(optimizer) -> float:
    """The optimizer state an optimizer keeps per byte of parameters: what the planner
    reserves beside each stage's weights and gradients."""
    if optimizer is None:
        return 0.0
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if isinstance(optimizer, torch.optim.SGD):
        return 1.0 if group.get("momentum", 0) else 0.0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3.0 if group.get("amsgrad", False) else 2.0
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1.0
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1.0 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    return 2.0  # unknown: Adam's two moments, the common case


_held_at_step_start = {"bytes": 0}  # on CUDA: what the allocator held when the last step began


def reset_device_peak(graph) -> None:
    """Before a step of a model on CUDA: the allocator's peak starts again from what is held."""
    if graph is not None and torch.cuda.is_available() and any(t.is_cuda for t in graph.tensors.values()):
        torch.cuda.reset_peak_memory_stats()
        _held_at_step_start["bytes"] = torch.cuda.memory_allocated()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def stage_tensors(graph, nodes: list) -> list[str]:
    """The parameters and buffers `nodes` read, by name."""
    doc = graph.document
    named = {b["value"]: b["name"] for b in doc["bindings"] if b["kind"] != "constant"}
    chosen = set(nodes)
    out = set()
    for n in doc["nodes"]:
        if n["id"] in chosen:
            out.update(named[a["value"]] for a in n["args"] if a.get("value") in named)
    return sorted(out)


def _predicted_for_replica(document: dict, stages: list, replica: int) -> float:
    """The plan's peak for one replica of a rank's stages. The plan gives each rank the peak
    of its stages' largest share of a microbatch; a replica with a smaller share holds the
    same weights, gradients and optimizer state, and its share of the rest (activations,
    outputs, working memory: they grow with its samples)."""
    docs = [document["stages"][s] for s in stages]
    peak = max(float(d["memory_bytes"]) for d in docs)
    static = sum(float(d.get("static_bytes", 0.0)) for d in docs)
    fraction = max((d["shares"][replica] / max(d["shares"]) if len(d.get("shares") or []) > replica else 1.0)
                   for d in docs)
    return static + max(0.0, peak - static) * fraction


def memory_rows(state, optimizer) -> list[dict]:
    """One row per device of this process that ran a capture's (a CaptureState's) last step:
    (rank, replica), predicted and measured bytes (None where unknown)."""
    step, plan, graph = state.pipeline, state.plan, state.graph
    if step is None or graph is None:
        return []
    stage_nodes = state.stage_nodes
    peaks = step.memory_peaks()
    cuda = any(t.is_cuda for t in graph.tensors.values())
    rows = []
    for (rank, replica), peak in sorted(peaks.items()):
        stages = step.stages_of_rank(rank)
        names = sorted({n for s in stages for n in stage_tensors(graph, stage_nodes[s])})
        held = sum(_nbytes(graph.tensors[n]) for n in names)
        if replica == 0 and optimizer is not None:
            params = {graph.tensors[n] for n in names}
            for p, kept in optimizer.state.items():
                if p in params:
                    held += sum(_nbytes(v) for v in kept.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        predicted, other = None, 0.0
        if plan is not None:
            predicted = _predicted_for_replica(plan.document, stages, replica)
        measured = None
        if cuda and len(peaks) == 1:
            measured = float(torch.cuda.max_memory_allocated())
            start = _held_at_step_start["bytes"]
            other, peak = max(0.0, start - held), measured - start
        elif not cuda:
            measured = float(held + peak)
        rows.append(dict(rank=rank, replica=replica, predicted_bytes=predicted, measured_bytes=measured,
                         held_bytes=float(held), step_peak_bytes=float(peak), other_bytes=float(other)))
    return rows


def memory_table(rows: list[dict]) -> str:
    """The rows as the profile report prints them."""
    if not rows:
        return ""
    mib = 1 << 20
    lines = ["memory per device (MiB): predicted / measured peak (held before the step + the step's own)"]
    for r in rows:
        pred = f"{r['predicted_bytes'] / mib:9.3f}" if r["predicted_bytes"] is not None else "        -"
        meas = f"{r['measured_bytes'] / mib:9.3f}" if r["measured_bytes"] is not None else "        -"
        ratio = (f"  ratio {r['measured_bytes'] / r['predicted_bytes']:.3f}"
                 if r["predicted_bytes"] and r["measured_bytes"] else "")
        other = (f"; and {r['other_bytes'] / mib:.3f} the process held beyond its stages as the step began"
                 if r.get("other_bytes") else "")
        lines.append(f"  rank {r['rank']} replica {r['replica']}: {pred} / {meas}  "
                     f"({r['held_bytes'] / mib:.3f} + {r['step_peak_bytes'] / mib:.3f}{other}){ratio}")
    return "\n".join(lines) + "\n"
