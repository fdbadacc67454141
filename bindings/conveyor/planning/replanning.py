"""Re-planning while training (docs/design.md, "Re-planning"): what conveyor.Module does
between steps when `replan="auto"`.

Every `WINDOW` steps of the running pipeline (its first step, warm-up, left out) the live
profile's per-stage times, merged across the job's processes (a gradient sum's wait for the
slowest process told from its moving time), go to the Replanner (partitioner/replan.h) on a
thread of process 0, beside the next window's steps, yielding the CPU to them. It
corrects the planning inputs (the profile's error per kind of work, each device's speed),
plans again where they moved, and decides whether moving to the new plan pays for itself
within the horizon; every process hears the decision at the first window boundary after it
is made and, on a switch, the job moves at that step boundary: the pipeline rebuilt over
the same live parameters, each parameter, buffer and optimizer state (momentum, Adam's moments and step) sent from a
process that held it to each process whose new stages read it and lack it, and, once every
process has confirmed, whatever a process's new stages do not read released there. A
process that dies during a move fails the others' waits, naming it, within the job's
timeout; until every process has confirmed, each keeps all it held, so nothing is lost.
With `trace=`, process 0 writes the planner's evaluations beside its steps
(replanning_trace.py).
"""
from __future__ import annotations

import io
import json
import os
import sys
import threading
import time

import torch

from .. import _C
from ..errors import ConveyorError, ExecutionError
from .replanning_trace import PLANNER

WINDOW = 5  # steps of the running pipeline between two evaluations
PLANS = ("candidate", "running")  # a decision's plans (_C.Plan): on the wire, their documents


PLANNER_NICENESS = 10  # the planner thread's: a tenth of a core the training wants too


def run_on_spare_time() -> None:
    """The calling thread yields the CPU to the training (Linux: niceness 10, so beside a
    busy training thread it gets about a tenth of the core). Planning at the training's
    priority beside a process pinned to one core took half that core while it searched: the
    steps at the window boundaries ran 0.7-1.0 s against 0.45 s, that process then measured
    slower, and the plan moved work off it. Not Linux's SCHED_IDLE: beside any busy process
    (a straggler's neighbour) that never runs, and only a privileged process may undo it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PLANNER_NICENESS)  # this thread alone (Linux)
    except (AttributeError, OSError):
        pass  # elsewhere: it runs at the training's priority


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


def idle_devices(document: dict) -> list[int]:
    """The devices of a plan document that none of its stages' replicas runs on."""
    used = {s["first_device"] + i for s in document["stages"] for i in range(int(s["replicas"]))}
    return [d for d in range(len(document["devices"])) if d not in used]


FIGURES = ("forward_s", "backward_s", "backward_weight_s", "replica_compute_s", "send_s", "allreduce_s", "across_s")


def merge_processes(reports: list) -> tuple[list, list]:
    """Every process's stage figures as one: per stage, each kind of compute and transfer as
    the process that ran it measured it (the larger figure), each replica's compute from the
    process that runs it; and a gradient sum across processes told apart into moving and
    waiting. Each process's figure for that sum runs from when its own part was ready to
    when the sum completed, so it holds the wait for the last process to contribute; the
    last one waits for nobody, so the least figure is the time spent moving bytes, and each
    process's figure beyond it the time it waited for the slowest's compute. Returns the
    merged stages (allreduce_s: what the sums took without waiting) and per stage each
    process's wait in seconds."""
    merged = [dict(s) for s in reports[0]]
    waiting = []
    for k, stage in enumerate(merged):
        for theirs in (r[k] for r in reports[1:]):
            for key in ("forward_s", "backward_s", "backward_weight_s", "send_s"):
                stage[key] = max(stage[key], theirs[key])
            stage["replica_compute_s"] = [max(a, b) for a, b in zip(stage["replica_compute_s"],
                                                                     theirs["replica_compute_s"])]
        across = [r[k]["across_s"] for r in reports]
        measured = [a for a in across if a > 0]
        moving = min(measured) if measured else 0.0
        within = max(r[k]["allreduce_s"] - r[k]["across_s"] for r in reports)  # summed in one process: no wait
        stage["allreduce_s"], stage["across_s"] = within + moving, moving
        waiting.append([a - moving if a > 0 else 0.0 for a in across])
    return merged, waiting


def merged_window(report: dict, group) -> tuple[list, float, list]:
    """The window's stages, mean step and waits (merge_processes) from every process's live
    profile (collective across processes: each process's figures for the replicas it runs)."""
    stages = [{k: s[k] for k in FIGURES} for s in report["stages"]]
    step_s = report["measured_step_s"]
    if group is None:
        return stages, step_s, []
    mine = json.dumps([stages, step_s]).encode()
    reports = []
    for root in range(group.world_size):
        theirs, their_step = json.loads(group.broadcast_bytes(root, mine if root == group.rank else b""))
        reports.append(theirs)
        step_s = max(step_s, their_step)
    merged, waiting = merge_processes(reports)
    return merged, step_s, waiting


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


class Replanning:
    """The Module's re-planning between steps: when a window is due, what the Replanner
    decided (process 0 decides, every process hears it), and the log of switches.

    The Replanner thinks beside the training steps: a window's merged profile starts its
    evaluation on a thread of process 0 (the planner releases the GIL) that yields the CPU to
    the training (run_on_spare_time), and the decision is heard by every process
    at the first window boundary after it is made, where every process applies it at once.
    So a decision comes one or two windows after what it measured, and the steps wait for
    nothing but the small exchange of profiles (an evaluation that outlasts two windows is
    waited for at the second boundary); a window that ends while an evaluation is under way
    is not evaluated. The first window after a switch the Replanner decided is
    heard at once: judging it needs no search, and a switch that measures slower is undone a
    window sooner."""

    def __init__(self, replanner, group):
        self.replanner = replanner  # process 0 (or the only process); None elsewhere
        self.group = group
        self.steps = 0          # steps run by the current pipeline
        self.rebuild_s = 0.0    # what building the current pipeline took
        self.bytes_per_s = 0.0  # the last move's measured speed
        self.last: dict | None = None
        self.thinking: tuple | None = None  # process 0: (thread, result box) of the evaluation under way
        self.passed = 0  # process 0: boundaries passed while that evaluation ran on
        self.judging = False  # process 0: the next window judges a switch the Replanner decided
        self.timeline = None  # process 0, with trace=: a ReplanningTimeline (replanning_trace.py)
        self.windows = 0  # windows evaluated

    def due(self) -> bool:
        return self.steps >= 1 + WINDOW and (self.steps - 1) % WINDOW == 0

    def evaluate(self, step, switches: list) -> dict | None:
        """One window: the merged live profile starts the Replanner's next evaluation, and the
        previous window's decision is heard (collective across processes); None while none
        is ready (the first window). The pipeline compares the next window with the running
        plan as the corrected inputs price it; the last of the Module's `switches` (forced
        ones included) gets its measured gain from the first window after it."""
        stages, step_s, waiting = merged_window(step.profile_report(), self.group)
        self.windows += 1
        self._measure_switch(switches, step_s)
        decision = None
        if self.replanner is not None:
            # An evaluation still under way is heard at a later boundary; at the second one
            # it is waited for (the training then waits, so it has the core), so a decision
            # is at most a window late even where the training leaves the planner no time.
            busy = self.thinking is not None and self.thinking[0].is_alive() and self.passed < 1
            self.passed = self.passed + 1 if busy else 0
            decision = None if busy else self._decided()
            if not busy and (decision is None or not decision["switch"]):  # a switch measures anew under its plan
                self._think(stages, step_s, waiting)
                if self.judging:  # the first window after a switch it decided: heard at once, so a
                    decision = self._decided()  # switch that measures slower is undone a window sooner
                self.judging = False
        if self.group is not None:
            sent = b""
            if self.group.rank == 0:
                sent = json.dumps(None if decision is None else
                                  {**decision, **{k: decision[k].to_json() for k in PLANS}}).encode()
            heard = json.loads(self.group.broadcast_bytes(0, sent))
            if self.group.rank != 0 and heard is not None:  # process 0 keeps its own; the others read each plan once
                decision = {**heard, **{k: _C.read_plan(heard[k]) for k in PLANS}}
        if decision is not None:
            step.set_prediction(decision["running"])
            self.last = decision
        if self.timeline is not None:
            if decision is not None:
                self.timeline.instant(PLANNER, "decided: " + decision["reason"],
                                      time.perf_counter(), arithmetic=decision["arithmetic"],
                                      waited_for_planning_s=decision.get("waited_s", 0.0))
            self.timeline.write()
        return decision

    def _think(self, stages: list, step_s: float, waiting: list) -> None:
        """Starts the evaluation of one window on a thread of its own."""
        measured = [{k: s[k] for k in FIGURES if k != "across_s"} for s in stages]
        box: dict = {}
        window = self.windows

        def run():
            run_on_spare_time()
            t0 = time.perf_counter()
            try:
                box["decision"] = self.replanner.evaluate(measured, step_s, rebuild_s=self.rebuild_s,
                                                          bytes_per_s=self.bytes_per_s)
            except BaseException as e:  # raised where the decision is heard, on the caller's thread
                box["error"] = e
            t1 = time.perf_counter()
            box["planning_s"] = t1 - t0
            if self.timeline is not None:
                decided = box.get("decision")
                self.timeline.span(PLANNER, f"evaluating window {window}", t0, t1,
                                   reason=decided["reason"] if decided else repr(box.get("error")))

        # Not a daemon: the interpreter waits for an evaluation at exit rather than tearing the
        # planner down under it (a daemon still searching at exit aborted the process).
        thread = threading.Thread(target=run, name="conveyor-replanning", daemon=False)
        thread.start()
        self.thinking = (thread, box, waiting, [s["across_s"] for s in stages])

    def _decided(self) -> dict | None:
        """The evaluation under way, once it ends (waited for here if it is not over yet:
        judging a switch, which needs no search)."""
        if self.thinking is None:
            return None
        thread, box, waiting, across = self.thinking
        t0 = time.perf_counter()
        thread.join()
        self.thinking = None
        if "error" in box:
            raise box["error"]
        decision = box["decision"]
        decision.update(waiting=waiting, across_s=across, planning_s=box["planning_s"],
                        waited_s=time.perf_counter() - t0)
        return decision

    def forget_thinking(self) -> None:
        """Drops the evaluation under way (a switch the user forces changes what it measured)."""
        if self.thinking is not None:
            self.thinking[0].join()
            self.thinking = None

    def _measure_switch(self, switches: list, step_s: float) -> None:
        """The last switch's measured gain, from the first window after it."""
        if switches and switches[-1]["measured_gain_s"] is None:
            last = switches[-1]
            last["measured_step_s"] = step_s
            last["measured_gain_s"] = last["step_before_s"] - step_s
            self.say(f"step {last['step']}: the switch measured {last['measured_gain_s'] * 1e3:.2f} ms saved per step "
                     f"({last['step_before_s'] * 1e3:.2f} -> {step_s * 1e3:.2f} ms; predicted "
                     f"{last['predicted_gain_s'] * 1e3:.2f} ms)")

    def say(self, text: str) -> None:
        if self.group is None or self.group.rank == 0:
            print(f"conveyor: re-planning: {text}", file=sys.stderr, flush=True)

    def report(self, switches: list) -> str:
        """What the partitioner concluded last, for Module.profile_report()."""
        if self.last is None:
            return f"re-planning: no window evaluated yet (every {WINDOW} steps after the first)\n"
        d = self.last
        f = d["factors"]
        speeds = ", ".join(f"{s:.2f}" for s in f["speed"])
        idle = idle_devices(json.loads(d["running"].to_json()))
        unmeasured = (f"  device{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} idle under the running "
                      "plan: never measured, so how it compares with the devices that run is the cluster's "
                      "speeds, uncorrected\n") if idle else ""
        sums = "".join(
            f"  stage {k}'s gradient sum across processes: {moving * 1e3:.2f} ms per step moving bytes; waiting "
            f"for the slowest process: " + ", ".join(f"process {p} {w * 1e3:.2f} ms" for p, w in enumerate(waits)) +
            (f" (process {waits.index(min(waits))} is the slowest)" if len(waits) > 1 and max(waits) > 0 else "") + "\n"
            for k, (moving, waits) in enumerate(zip(d.get("across_s", []), d.get("waiting", []))) if moving > 0)
        return (f"re-planning: {d['reason']}\n  {d['arithmetic']}\n{sums}  corrections: forward x{f['forward']:.2f}, "
                f"backward x{f['backward']:.2f}, weight gradient x{f['weight']:.2f}, transfers x{f['link']:.2f}; "
                f"device speeds x[{speeds}]; the runtime's cost per action {d['action_overhead_s'] * 1e6:.0f} us\n"
                f"{unmeasured}  switches so far: {len(switches)}\n")


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
                 move_bytes=moved, tensor_bytes=pipeline.handed_over_bytes() if group is not None else 0,
                 transfer_s=transfer_s, rebuild_s=rebuild_s, measured_step_s=None,
                 measured_gain_s=None if decision else 0.0, factors=decision["factors"] if decision else None)
    history.marker = f"replan: {entry['old']} -> {entry['new']}"
    history.switches.append(entry)
    if state.replanning is not None:
        r = state.replanning
        if r.replanner is not None:
            r.forget_thinking()
            r.replanner.switched_to(plan.handle)
            r.judging = decision is not None and not decision["undo"]
        r.steps, r.rebuild_s = 0, rebuild_s
        if moved and transfer_s > 0:
            r.bytes_per_s = moved / transfer_s
        r.say(f"step {entry['step']}: {entry['old']} -> {entry['new']}; {entry['arithmetic'] or entry['reason']}; moved in "
              f"{entry['move_s'] * 1e3:.1f} ms ({moved} bytes of parameters, buffers and optimizer state received "
              f"here in {transfer_s * 1e3:.1f} ms, rebuilding {rebuild_s * 1e3:.1f} ms)")
