"""Moving a running capture to another plan between steps (docs/design.md, "Re-planning"):
the pipeline rebuilt over the same live parameters and, across processes, each parameter,
buffer and optimizer state (momentum, Adam's moments and step) sent from a process that held
it to each process whose new stages read it and lack it; once every process has confirmed,
whatever a process's new stages do not read is released there. A process that dies during a
move fails the others' waits, naming it, within the job's timeout; until every process has
confirmed, each keeps all it held, so nothing is lost. Re-planning's switches
(replanning.py), a user's switch_plan and a plan for larger sizes all move through
switch_to.
"""
from __future__ import annotations

import io
import time

import torch

from .. import _C
from ..errors import ConveyorError, ExecutionError

def plan_summary(document: dict) -> str:
    """One line: stages, schedule, microbatches, replicas and where the cuts fall."""
    stages = document["stages"]
    cuts = " | ".join(f"{min(s['ops'])}-{max(s['ops'])}" if s["ops"] else "-" for s in stages)
    text = (f"{len(stages)} stage{'s' if len(stages) != 1 else ''}, {document['schedule']}, "
            f"{document['microbatches']} microbatches")
    replicas = [int(s["replicas"]) for s in stages]
    if any(r > 1 for r in replicas):
        text += f", replicas {replicas}"
    for k, s in enumerate(stages):
        shares = s.get("shares", [])
        if len(set(round(x, 6) for x in shares)) > 1:  # devices of different speeds: uneven shares
            text += f", stage {k} shares " + "/".join(f"{x:.2f}" for x in shares)
    return f"{text}, ops {cuts}"


# The tag of the optimizer state's hand-over messages: beside the parameters' own
# (runtime/model_state.cc, kHandOverTag: bits 44-46) with bit 43 set.
STATE_TAG = (7 << 44) | (1 << 43)


def move_optimizer_state(optimizer, tensors: dict, holders: dict, readers: dict, group) -> int:
    """Each parameter's optimizer state (momentum, Adam's moments and step) from its lowest
    holder under the old plan to each process that reads it under the new one and did not
    hold it: one message per pair of processes, sends posted before any receive (collective
    over the processes that exchange). Returns the bytes received here."""
    if optimizer is None:
        return 0
    me = group.rank
    outgoing: dict[int, dict] = {}
    senders: set[int] = set()
    for name in sorted(readers):
        held = holders.get(name) or []
        if name not in tensors or not held:
            continue
        source = min(held)
        for p in readers[name]:
            if p in held:
                continue
            if source == me:
                t = tensors[name]
                outgoing.setdefault(p, {})[name] = optimizer.state[t] if t in optimizer.state else {}
            elif p == me:
                senders.add(source)
    sends = _C.SendsInFlight(group)
    for p, states in sorted(outgoing.items()):
        buffer = io.BytesIO()
        torch.save(states, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        sends.send(p, STATE_TAG, [payload], f"handing optimizer state to process {p} for the new plan")
    received = 0
    for source in sorted(senders):
        data = group.recv(source, STATE_TAG, f"receiving optimizer state from process {source} for the new plan")[0]
        received += data.numel()
        for name, state in torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False).items():
            if state:
                optimizer.state[tensors[name]] = state
    sends.wait()
    return received


def release_unread_state(optimizer, tensors: dict, readers: dict, me: int) -> None:
    """Optimizer state of parameters no stage of this process reads under the new plan."""
    if optimizer is None:
        return
    for name, t in tensors.items():
        if name in readers and me not in readers[name] and t in optimizer.state:
            del optimizer.state[t]


def carry_optimizer_state(pipeline, tensors: dict, optimizer, group, holders: dict) -> int:
    """After `pipeline` was built across processes from `holders` (the old pipeline's
    readers): each parameter's optimizer state to each process whose new stages read it,
    every process confirming, then what no stage here reads released (collective).
    `tensors`: the graph's parameters and buffers by name. Returns the bytes of optimizer
    state received here."""
    readers = pipeline.readers()
    moved = move_optimizer_state(optimizer, tensors, holders, readers, group)
    group.broadcast_bytes(0, b"")  # every process has what its stages read
    release_unread_state(optimizer, tensors, readers, group.rank)
    return moved


def switch_to(state, plan, decision: dict | None, *, job, optimizer, history, reason: str = "switch_plan") -> None:
    """Moves a capture (a CaptureState, between steps) to `plan`: the pipeline rebuilt over
    the same live parameters; across processes each parameter and buffer, and its optimizer
    state, goes from a process that holds it to each process whose new stages read it and
    lack it, and once every process has confirmed, what a process no longer reads is
    released (the state now, the tensors at the first step); the switch logged in
    `history` (a RunHistory; `decision`: the Replanner's, or None when forced, for `reason`)."""
    old_plan = state.plan
    old = old_plan.document if old_plan is not None else None
    t0 = time.perf_counter()
    moved, handed_s = 0, 0.0
    group = job.group
    if state.replanning is not None:  # nothing of the running plan's windows is left on its way
        state.replanning.settle()
    holders = state.pipeline.readers() if group is not None else {}
    state.pipeline = None  # the old pipeline's actors stop before the new ones start
    state.small_pipelines.clear()
    pipeline = None
    try:
        pipeline = job.pipeline_of(state.graph, plan, holders=holders)
        built = time.perf_counter()
        if group is not None:
            handed_s = pipeline.handed_over_s()
            moved = pipeline.handed_over_bytes() + carry_optimizer_state(pipeline, state.graph.tensors, optimizer,
                                                                        group, holders)
    except ConveyorError as e:
        if group is None or not isinstance(e, ExecutionError):
            # Refused before anything moved (alike on every process: the plan itself): the
            # old plan's pipeline again over what each process holds, and the error.
            pipeline = None  # its actors stop before the old plan's start again
            if old_plan is not None:
                state.pipeline = job.pipeline_of(state.graph, old_plan, holders=holders)
            raise
        raise ExecutionError(f"moving to a new plan after step {history.steps_run} failed: {e}. This process "
                             "keeps the parameters and optimizer state it held; save them (state_dict on "
                             "this process) and restart the job") from None
    moved_at = time.perf_counter()
    state.use_plan(plan, pipeline)
    transfer_s = handed_s + (moved_at - built)
    rebuild_s = built - t0 - handed_s
    entry = dict(step=history.steps_run, old=plan_summary(old) if old else None, new=plan_summary(plan.document),
                 reason=decision["reason"] if decision else reason, arithmetic=decision["arithmetic"] if decision else "",
                 predicted_gain_s=decision["gain_s"] if decision else 0.0,
                 step_before_s=decision["measured_step_s"] if decision else 0.0, move_s=moved_at - t0,
                 received_bytes=moved, received_tensor_bytes=pipeline.handed_over_bytes() if group is not None else 0,
                 priced_move_bytes=decision["move_bytes"] if decision else None,
                 transfer_s=transfer_s, rebuild_s=rebuild_s, measured_step_s=None,
                 measured_gain_s=None if decision else 0.0, factors=decision["factors"] if decision else None)
    history.marker = f"replan: {entry['old']} -> {entry['new']}"
    history.switches.append(entry)
    if state.replanning is not None:
        state.replanning.switched(entry, plan, decision)
