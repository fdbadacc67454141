"""Re-planning while training (docs/design.md, "Re-planning"): what conveyor.Module does
between steps when `replan="auto"`.

Every `WINDOW` steps of the running pipeline (its first step, warm-up, left out) the live
profile's per-stage times, merged across the job's processes, go to the Replanner
(partitioner/replan.h) on process 0. It corrects the planning inputs (the profile's error
per kind of work, each device's speed), plans again, and decides whether moving to the new
plan pays for itself within the horizon; every process hears the decision and, on a switch,
the job moves at that step boundary: parameters and buffers gathered whole from their
owners, the optimizer's state handed from the old owner of each parameter to every process,
the pipeline rebuilt over the same live parameters, and whatever a process's new stages do
not read released there (state included). A process that dies during a move fails the
collective waits, naming it, within the job's timeout; until the new pipeline is built
every process keeps every tensor whole, so nothing is lost.
"""
from __future__ import annotations

import io
import json
import sys
import time

import torch

from .errors import ExecutionError

WINDOW = 5  # steps of the running pipeline between two evaluations


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


def _merge(into: list, stages: list) -> None:
    """Stage by stage the larger of two processes' figures (a stage runs where it is measured)."""
    for mine, theirs in zip(into, stages):
        for k in ("forward_s", "backward_s", "backward_weight_s", "send_s", "allreduce_s"):
            mine[k] = max(mine[k], theirs[k])
        mine["replica_compute_s"] = [max(a, b) for a, b in zip(mine["replica_compute_s"], theirs["replica_compute_s"])]


def merged_window(report: dict, group) -> tuple[list, float]:
    """The window's stages and mean step from every process's live profile (collective
    across processes: each process's figures for the replicas it runs)."""
    stages = [{k: s[k] for k in ("forward_s", "backward_s", "backward_weight_s", "replica_compute_s", "send_s",
                                 "allreduce_s")}
              for s in report["stages"]]
    step_s = report["measured_step_s"]
    if group is None:
        return stages, step_s
    mine = json.dumps([stages, step_s]).encode()
    merged = None
    for root in range(group.world_size):
        theirs, their_step = json.loads(group.broadcast_bytes(root, mine if root == group.rank else b""))
        if merged is None:
            merged, step_s = theirs, their_step
        else:
            _merge(merged, theirs)
            step_s = max(step_s, their_step)
    return merged, step_s


def move_optimizer_state(optimizer, tensors: dict, owners: dict, group) -> int:
    """Every parameter's optimizer state (momentum, Adam's moments and step) from its owner
    under the old plan to every process (collective). Returns the bytes received here."""
    if optimizer is None:
        return 0
    received = 0
    for root in range(group.world_size):
        payload = b""
        if root == group.rank:
            mine = {name: optimizer.state[t] for name, t in tensors.items()
                    if owners.get(name) == root and t in optimizer.state and optimizer.state[t]}
            buffer = io.BytesIO()
            torch.save(mine, buffer)
            payload = buffer.getvalue()
        data = group.broadcast_bytes(root, payload)
        received += len(data)
        if root != group.rank:
            for name, state in torch.load(io.BytesIO(data), weights_only=False).items():
                optimizer.state[tensors[name]] = state
    return received


def release_unread_state(optimizer, tensors: dict) -> None:
    """Optimizer state of parameters this process no longer holds (released: 0 elements)."""
    if optimizer is None:
        return
    for t in tensors.values():
        if t.numel() == 0 and t in optimizer.state:
            del optimizer.state[t]


class Replanning:
    """The Module's re-planning between steps: when a window is due, what the Replanner
    decided (process 0 decides, every process hears it), and the log of switches."""

    def __init__(self, replanner, group, switches: list):
        self.replanner = replanner  # process 0 (or the only process); None elsewhere
        self.group = group
        self.steps = 0          # steps run by the current pipeline
        self.rebuild_s = 0.0    # what building the current pipeline took
        self.bytes_per_s = 0.0  # the last move's measured speed
        self.last: dict | None = None
        self.switches = switches  # the Module's log of switches (forced ones included)

    def due(self) -> bool:
        return self.steps >= 1 + WINDOW and (self.steps - 1) % WINDOW == 0

    def evaluate(self, step) -> dict:
        """One window: the merged live profile to the Replanner and its decision back
        (collective across processes). The pipeline compares the next window with the running
        plan as the corrected inputs price it."""
        stages, step_s = merged_window(step.profile_report(), self.group)
        decision = None
        if self.replanner is not None:
            t0 = time.perf_counter()
            decision = self.replanner.evaluate(stages, step_s, rebuild_s=self.rebuild_s, bytes_per_s=self.bytes_per_s)
            decision["planning_s"] = time.perf_counter() - t0
        if self.group is not None:
            sent = json.dumps(decision).encode() if self.group.rank == 0 else b""
            decision = json.loads(self.group.broadcast_bytes(0, sent))
        step.set_prediction(decision["running"])
        self.last = decision
        if self.switches and self.switches[-1]["measured_gain_s"] is None:
            last = self.switches[-1]
            last["measured_step_s"] = step_s
            last["measured_gain_s"] = last["step_before_s"] - step_s
            self.say(f"step {last['step']}: the switch measured {last['measured_gain_s'] * 1e3:.2f} ms saved per step "
                     f"({last['step_before_s'] * 1e3:.2f} -> {step_s * 1e3:.2f} ms; predicted "
                     f"{last['predicted_gain_s'] * 1e3:.2f} ms)")
        return decision

    def say(self, text: str) -> None:
        if self.group is None or self.group.rank == 0:
            print(f"conveyor: re-planning: {text}", file=sys.stderr, flush=True)

    def report(self) -> str:
        """What the partitioner concluded last, for Module.profile_report()."""
        if self.last is None:
            return f"re-planning: no window evaluated yet (every {WINDOW} steps after the first)\n"
        d = self.last
        f = d["factors"]
        speeds = ", ".join(f"{s:.2f}" for s in f["speed"])
        return (f"re-planning: {d['reason']}\n  {d['arithmetic']}\n  corrections: forward x{f['forward']:.2f}, "
                f"backward x{f['backward']:.2f}, weight gradient x{f['weight']:.2f}, transfers x{f['link']:.2f}; "
                f"device speeds x[{speeds}]; the runtime's cost per action {d['action_overhead_s'] * 1e6:.0f} us\n"
                f"  switches so far: {len(self.switches)}\n")


def switch_to(module, plan, decision: dict | None) -> None:
    """Moves `module` (a conveyor.Module, between steps) to `plan`: across processes every
    tensor gathered whole and the optimizer's state handed over first, then the pipeline
    rebuilt and what this process's new stages do not read released; the switch logged
    (`decision`: the Replanner's, or None when forced)."""
    old = module.plan.document if module.plan is not None else None
    t0 = time.perf_counter()
    moved = 0
    tensors = module._graph.tensors
    if module._group is not None:
        owners = module._step.owners()
        try:
            module._step.gather_state()  # every tensor whole on every process until the new pipeline holds
            moved = move_optimizer_state(module.optimizer, tensors, owners, module._group)
        except ExecutionError as e:
            raise ExecutionError(f"moving to a new plan after step {module._steps_run} failed: {e}. This process "
                                 "keeps the parameters and optimizer state it held; save them (state_dict on "
                                 "this process) and restart the job") from None
    t1 = time.perf_counter()
    module._step = None  # the old pipeline's actors stop before the new ones start
    module._small_steps.clear()
    module._step = module._pipeline(module._graph, plan)
    built = time.perf_counter()
    if module._group is not None:
        release_unread_state(module.optimizer, tensors)
    module.plan = plan
    module._stage_nodes = plan.stage_nodes
    chunks = plan.document["chunks"]
    module._layout = (len(plan.stage_nodes), plan.schedule, plan.microbatches, chunks,
                    plan.replicas[:len(plan.stage_nodes) // chunks])
    entry = dict(step=module._steps_run, old=plan_summary(old) if old else None, new=plan_summary(plan.document),
                 reason=decision["reason"] if decision else "switch_plan", arithmetic=decision["arithmetic"] if decision else "",
                 predicted_gain_s=decision["gain_s"] if decision else 0.0,
                 step_before_s=decision["measured_step_s"] if decision else 0.0, move_s=built - t0,
                 move_bytes=moved, rebuild_s=built - t1, measured_step_s=None,
                 measured_gain_s=None if decision else 0.0, factors=decision["factors"] if decision else None)
    module._marker = f"replan: {entry['old']} -> {entry['new']}"
    module._switches.append(entry)
    if module._replanning is not None:
        r = module._replanning
        if r.replanner is not None:
            r.replanner.switched_to(json.dumps(plan.document))
        r.steps, r.rebuild_s = 0, built - t1
        if moved and t1 > t0:
            r.bytes_per_s = moved / (t1 - t0)
        r.say(f"step {entry['step']}: {entry['old']} -> {entry['new']}; {entry['arithmetic']}; moved in "
              f"{entry['move_s'] * 1e3:.1f} ms ({moved} bytes of optimizer state, rebuilding "
              f"{entry['rebuild_s'] * 1e3:.1f} ms)")
