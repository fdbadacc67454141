"""Re-planning while training (docs/design.md, "Re-planning"): what conveyor.Module does
between steps when `replan="auto"`.

At the end of each window of the running pipeline's steps (its first step, warm-up, left
out; `WINDOW` steps, later ones at least `window_s` of them: window_steps) the live
profile's per-stage times go to the Replanner (partitioner/replan.h) on a thread of process
0, beside the next window's steps, yielding the CPU to them: the other processes send theirs
as messages (replanning_messages.py), and the thread merges them with process 0's (a
gradient sum's wait for the slowest process told from its moving time). It corrects the
planning inputs (the profile's error per kind of work, each device's speed), plans again
where they moved, and decides whether moving to the new plan pays for itself within the
horizon. Process 0 sends the decision at the first window boundary after it is made (a
window that confirms a switch, which needs no search: at its own boundary), and every
process applies it a step later, together; a switch moves the job there (plan_switch.py).
With `trace=`, process 0 writes the planner's evaluations beside its steps
(replanning_trace.py).
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import sys
import threading
import time
import weakref

from .. import environment
from ..errors import ConveyorValueError, ExecutionError
from ..progress import LOGGER
from .core_sharing import CoreSharing, NeighbourWaits, run_on_spare_time, thread_cpu_s, wait_while_given
from .device_probe import READING_S, DeviceProbe
from .replanning_messages import DECIDED_AFTER, FIGURES, WindowFigures, WindowMessages
from .replanning_trace import PLANNER, window_line
from .step_clock import StepClock
from .window_decisions import WINDOW, confirming_steps, idle_devices, is_census, superseding
from .window_figures import merge_processes, step_terms, window_figures

# The least wall time of a window after a running plan's first, so that what a boundary costs
# (its figures, messages, and an evaluation the training waits for) is a small part of it.
# Five steps of 35 ms (GPT-2 of 8 blocks on an H200) made windows of 0.18 s, each boundary
# cost about 48 ms, and re-planning took 23% of the steps. CONVEYOR_REPLAN_WINDOW_S sets it
# (0: every window WINDOW steps).
WINDOW_S = 2.0


def window_seconds() -> float:
    """The least wall time of a window: CONVEYOR_REPLAN_WINDOW_S, else WINDOW_S."""
    text = environment.variable("CONVEYOR_REPLAN_WINDOW_S")
    if text is None:
        return WINDOW_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise ConveyorValueError(f"CONVEYOR_REPLAN_WINDOW_S={text!r}: give the least seconds of steps between two "
                                 f"re-planning evaluations, a number of 0 or more (default {WINDOW_S}; 0: every "
                                 f"{WINDOW} steps)")
    return value


def window_steps(step_s: float, window_s: float) -> int:
    """The steps of a window after a running plan's first, at `step_s` a step: enough for
    `window_s` of them, and at least WINDOW."""
    if step_s <= 0 or window_s <= 0:
        return WINDOW
    return max(WINDOW, math.ceil(window_s / step_s))


# Windows between probes of a device whose census probe set a ceiling on its speed (it runs
# stages, so a light one measures full speed on a core it shares: partitioner/replan.h): a
# reading as the census's (three probes of 50 ms) every fifth window of at least 2 s, so that
# the ceiling lifts once its straggler goes, at 1.5% of that process's time.
REPROBE_EVERY = 5
# ... and at once where its threads waited for a CPU at least NEIGHBOURS_TOOK of their runnable
# time in its census window and less than half that share since (core_sharing.NeighbourWaits:
# the busy neighbour that slowed it left): a timm ViT's hog gone at step 55 was probed at step
# 61, not at the fifth window (step 76). And where the decision heard owes it (a switch found
# on a ceiling its device's stages dispute waits for a second reading: partitioner/replan.h,
# reprobe_owed); process 0 then waits a reading longer for the window's confirmation.
NEIGHBOURS_TOOK = 0.2

# The most of one core the planner's searches take, over the time from one search's start to
# the next's: a search of 0.45 s of CPU (GPT-2 of 8 blocks) waits 2.5 min for the next.
# Searching every window, as noise in the corrections asked, took 9% of the core of a process
# pinned to one: its steps slowed, it measured as a slow device, and plans moved for nothing.
# A search's CPU lengthens a pipeline's step by about three times as much (a ResNet-18 in two
# processes: 11 ms of CPU, a step 30 ms longer, both processes waiting), so at 1% the searches
# took 1.5% of the steps, most of what re-planning may cost a training that gains nothing.
# A search owed (a device's speed moved, a new plan runs) runs at once (partitioner/replan.h).
SEARCH_SHARE = 0.003

# The longest process 0 waits at a boundary, in steps of the window it closes, for the
# evaluation that confirms a switch (no search: a few ms of CPU, at a tenth of a core).
CONFIRMING_WAIT = 0.5

# A window whose mean step moved by more than this from the last one's (a straggler came or
# went: twice the noise a plan is held to) is heard at its own boundary where its evaluation
# ends within CONFIRMING_WAIT of a step, as a confirmation is, rather than a window later: its
# switch is then confirmed by the next window, not the one after.
STEP_MOVED = 0.2


_ACROSS_PROCESSES: "weakref.WeakSet[Replanning]" = weakref.WeakSet()  # settled at exit


def moved_here(entry: dict, across_processes: bool) -> str:
    """What a switch (`entry`: its log entry) moved to this process, and in what time: a
    process that received nothing spent it exchanging (it said "0 bytes ... received here in
    12 ms"), and one process moves nothing."""
    taken = f"{entry['transfer_s'] * 1e3:.1f} ms"
    if not across_processes:
        return "one process: nothing moves"
    if not entry["received_bytes"]:
        return f"nothing received here; exchanging with the other processes took {taken}"
    return f"{entry['received_bytes']} bytes of parameters, buffers and optimizer state received here in {taken}"


def _settle_at_exit() -> None:
    """Before the job's group closes (an exit handler registered after its own, so run
    before it): what re-planning sent and nobody read yet is read, so that no process leaves
    a message in flight. A job already failing (its group aborted) reads nothing; its error
    was said where it happened."""
    for replanning in list(_ACROSS_PROCESSES):
        try:
            replanning.settle()
        except Exception:  # noqa: BLE001
            pass


class Replanning:
    """The Module's re-planning between steps: when a window is due, what the Replanner
    decided (process 0 decides, every process hears it), and the log of switches.

    The Replanner thinks beside the training steps. At a window's boundary the other
    processes send process 0 their figures (replanning_messages.py) and go on; process 0
    starts an evaluation on a thread of its own (the planner releases the GIL) that reads
    them, merges them with its own and plans, yielding the CPU to the training
    (run_on_spare_time). At the next boundary after it ends, process 0 sends every process
    the decision, and every process applies it `DECIDED_AFTER` steps later, together. So a
    decision comes one or two windows after what it measured, and no step waits on another
    process for re-planning (an evaluation that outlasts two windows is waited for at the
    second boundary, by process 0 alone, while the wait gives it the core:
    core_sharing.wait_while_given); a window that ends while an evaluation is under
    way is not evaluated. Two windows are heard at once (process 0 waits for its peers'
    figures of them), since neither searches (partitioner/replan.cc): the first window after
    a switch the Replanner decided, which judges it (one that measures slower is undone a
    window sooner), and the window after one that found a switch, which confirms it (within
    half a step, else it is heard at the next boundary)."""

    def __init__(self, replanner, group, device=None, build_s: float = 0.0, optimizer=None):
        self.replanner = replanner  # process 0 (or the only process); None elsewhere
        self.group = group
        # Across processes (device d is process d): this process's device, probed at each
        # running plan's first window and while the plan leaves it idle (device_probe.py).
        # One process's devices are one device shared (its CPU, or its GPU's streams): each
        # runs as fast as the others, which a census says at each running plan's first window
        # with no probe (else a stage's pricing error read as its device's speed).
        self.probe = DeviceProbe(device) if group is not None and device is not None else None
        self.devices = 0  # one process: the running plan's devices, at its census
        self.decides = group is None or group.rank == 0  # process 0 decides; the others hear it
        # Process 0: what its planner thread takes of the training's threads, per window; read
        # out of the compute where that runs on the CPU (core_sharing.py).
        self.sharing = CoreSharing() if replanner is not None else None
        # Per window, the share of its threads' runnable time this process waited for a CPU,
        # and that share in the running plan's census window (REPROBE_EVERY).
        self.neighbours, self.waited_at_census = NeighbourWaits(), 0.0
        self.on_cpu = getattr(device, "type", "cpu") == "cpu"
        self.messages = WindowMessages(group) if group is not None else None
        if group is not None:
            atexit.unregister(_settle_at_exit)
            atexit.register(_settle_at_exit)  # once, and after the group's close: run before it
            _ACROSS_PROCESSES.add(self)
        self.window_s = window_seconds()
        # The step as the caller saw it (from one call's start to the next) and the optimizer's
        # part of it: per step of this window (walls, optimizer_times), and the last window's mean.
        self.clock = StepClock(optimizer)
        self.restart_windows()
        self.last_wall_s = 0.0
        self.trained = 0  # the job's training steps so far (Module's count: the switch log's)
        # What building the current pipeline took (the first: as the Module built it), the
        # part of a move's price that is not bytes (a first move priced without it was
        # predicted at 3.3 ms and took 115 ms, 16 of them rebuilding).
        self.rebuild_s = build_s
        self.bytes_per_s = 0.0  # the last move's measured speed
        self.last: dict | None = None
        self.thinking: tuple | None = None  # process 0: (thread, result box) of the evaluation under way
        self.passed = 0  # process 0: boundaries passed while that evaluation ran on
        self.judging = False  # process 0: the next window judges a switch the Replanner decided
        self.timeline = None  # process 0, with trace=: a ReplanningTimeline (replanning_trace.py)
        self.windows = 0  # windows whose boundary passed (every process alike): the last one's number
        self.evaluated = 0  # process 0: evaluations heard
        self.planner_cpu_s = 0.0  # process 0: the CPU time they took, in all
        self.next_search_at = 0.0  # process 0 (time.perf_counter): when a search not owed may run again
        # The decision on its way: applied once the pipeline has run `decided_at` steps;
        # process 0 holds it, the others read it then. (window, decided_at, decision) or None.
        self.on_its_way: tuple | None = None
        # What re-planning costs the training when it moves nothing, over every step so far:
        # the training thread's time at step boundaries (figures, probes, messages, waits for
        # a judgement or a confirmation) and the steps' wall time it is part of.
        self.boundary_s = 0.0
        self.steps_wall_s = 0.0
        self.steps_counted = 0

    def restart_windows(self) -> None:
        """A new pipeline runs (a switch, or a capture's pipeline built again): its windows
        count its steps, from a first window of WINDOW steps."""
        # steps: run by this pipeline; next_boundary: the step after which the next window ends,
        # its first after WINDOW, each later one as process 0 sized it from its steps' time and
        # sent with its decision (every process ends each window at the same step).
        self.steps, self.walls, self.optimizer_times, self.next_boundary = 0, [], [], 1 + WINDOW
        self.census_owed = False  # the first window's is the census
        self.census_why = ""  # the Replanner's reason for the census owed
        self.reprobe_owed = False  # the decision heard owes a second reading of a device under a ceiling
        self.census_figures = None  # process 0: a census (figures, last step) not evaluated yet: the planner was busy
        self.confirming = False  # process 0: the next window confirms a switch found, heard at its own boundary
        self.window_report = None  # the last whole window's live profile, as it ended (live_profile.py)
        self.clock.forget()

    def ran_step(self, trained: int) -> None:
        """A step of the running pipeline ran (measured from its call's start to the next's), the
        `trained`th of the job's: what the log's step numbers count."""
        self.steps, self.trained = self.steps + 1, trained
        if self.steps == 1 and self.sharing is not None:  # the first window starts
            self.sharing.mark(self._planner_cpu_so_far(), self._planner_thread())
        if self.steps > 1:  # the first, warm-up, measures nothing
            self.clock.measure_this_step()

    def _call_began(self, started: float) -> None:
        """A training call began at `started`: the last step's wall time closes."""
        closed = self.clock.began(started)
        if closed is not None:
            wall_s, optimizer_s = closed
            self.walls.append(wall_s)
            self.optimizer_times.append(optimizer_s)
            self.steps_wall_s += wall_s
            self.steps_counted += 1

    def cost(self) -> dict:
        """What re-planning took of the steps so far (each pipeline's first, warm-up, and a
        switch's move left out):
        `boundary_s`, the training thread's time at window boundaries; `planner_cpu_s`, the
        planner thread's CPU (process 0), which at worst came out of the training's core;
        `planner_took_s`, what of that CPU the training's threads waited for (core_sharing.py);
        `steps_wall_s`, the wall time of the `steps` they are part of."""
        return dict(boundary_s=self.boundary_s, planner_cpu_s=self.planner_cpu_s,
                    planner_took_s=self.sharing.taken_s if self.sharing is not None else 0.0,
                    steps_wall_s=self.steps_wall_s, steps=self.steps_counted)

    def due(self) -> bool:
        return self.steps >= self.next_boundary

    def at_step_boundary(self, step, switches: list, running=None, started: float | None = None) -> dict | None:
        """Before a step of pipeline `step`: a window's boundary when one is due, and the
        decision to apply now, if any (every process alike). The last of the Module's
        `switches` (forced ones included) gets its measured gain from the first window after it.
        `running`: the Plan that runs (whether it leaves this process's device idle);
        `started`: when the training call began (time.perf_counter; None: now)."""
        t0 = time.perf_counter()
        self._call_began(t0 if started is None else started)
        try:
            if self.due():
                self._boundary(step, switches, running)
            if self.on_its_way is None or self.steps < self.on_its_way[1]:
                return None
            return self._hear(step)
        finally:
            self.boundary_s += time.perf_counter() - t0

    def _boundary(self, step, switches: list, running) -> None:
        """A window's boundary: its figures to process 0's planner, and the decision heard
        there (process 0) on its way to every process."""
        self.windows += 1
        window = self.windows
        taken = self.sharing.share_taken(self._planner_cpu_so_far(), self._planner_thread()) if self.sharing else 0.0
        probe_rate = 0.0
        # The running plan's first window, or one owed (a straggler may have gone): every process probes.
        owed = self.census_owed and self.steps != 1 + WINDOW
        census, self.census_owed = self.steps == 1 + WINDOW or owed, False
        if owed and self.decides:
            self.say(f"every process probes its device at this window (a census, owed: {self.census_why})")
        ceiling = self.last.get("speed_ceiling", []) if self.last is not None else []
        reprobe_owed, self.reprobe_owed = self.reprobe_owed, False
        waited = self.neighbours.share(self._planner_thread())
        self.waited_at_census = waited if census else self.waited_at_census
        left = self.waited_at_census >= NEIGHBOURS_TOOK and waited < self.waited_at_census / 2
        again = self.group is not None and (window % REPROBE_EVERY == 0 or left or reprobe_owed) and \
            self.group.rank < len(ceiling) and ceiling[self.group.rank] > 0
        if self.probe is not None and running is not None and (
                census or again or self.group.rank in idle_devices(running.document)):
            probe_rate = self.probe.rate()
        elif self.group is None and running is not None and census:
            probe_rate, self.devices = 1.0, len(running.document["devices"])
        walls, optimizers, self.walls, self.optimizer_times = self.walls, self.optimizer_times, [], []
        wall_s = sum(walls) / len(walls) if walls else 0.0
        optimizer_s = sum(optimizers) / len(optimizers) if optimizers else 0.0
        report = step.profile_report()
        self.window_report = report
        figures = window_figures(report, window, probe_rate, 1.0 - taken if self.on_cpu else 1.0, wall_s, optimizer_s)
        self._measure_switch(switches, wall_s or figures.step_s)
        step_moved = self.last_wall_s > 0 and abs((wall_s or figures.step_s) / self.last_wall_s - 1) > STEP_MOVED
        self.last_wall_s = wall_s or figures.step_s
        if not self.decides:
            self.next_boundary = self.steps + WINDOW  # until process 0's is heard (_hear), a step from now
            self.messages.send_figures(figures)
            self.on_its_way = (window, self.steps + DECIDED_AFTER, None)
            return
        # An evaluation still under way is heard at a later boundary; at the second one it
        # is waited for while the wait gives the planner the core (nothing else wants it), so
        # a decision is at most a window late even where the training leaves the planner no
        # time, and no step stalls for a planner that a busy neighbour starves.
        under_way = self.thinking is not None and self.thinking[0].is_alive()
        decision = None if under_way and self.passed < 1 else self._decided(while_given=under_way)
        busy = self.thinking is not None  # still under way: heard at a later boundary
        self.passed = self.passed + 1 if busy else 0
        if census and busy:  # evaluated once the planner is free, in place of a later window: an owed census
            self.census_figures = (figures, self.trained)  # skipped left ResNet-18's straggler unconfirmed for good
        if not busy and (decision is None or not decision["switch"]):  # a switch measures anew under its plan
            self._think(*(self.census_figures or (figures, self.trained)))
            if self.judging:  # the first window after a switch it decided: heard at once, so a
                decision = self._decided()  # switch that measures slower is undone a window sooner
            elif not (decision is not None and is_census(decision)) and (
                    self.confirming or step_moved or (decision is not None and decision["confirmations"] > 0)):
                # This window confirms the switch just heard, or not: the plan found is priced
                # again on it, with no search unless a device's speed moved, so it is heard
                # here if it ends within CONFIRMING_WAIT of a step (else at the next boundary,
                # as any evaluation). Heard a window later, every switch came 5 steps later.
                # A census is heard itself (what it read of each device, said and reported),
                # and its confirmation at the next boundary, 5 steps later: taken in its place,
                # a GPT-NeoX's first census went unheard in 1 run of 3. A window whose step
                # moved (STEP_MOVED) is waited for likewise: its switch is confirmed by the next.
                own = self._decided(within_s=CONFIRMING_WAIT * figures.step_s + (READING_S if reprobe_owed else 0.0))
                if own is not None and decision is not None:
                    LOGGER.debug("re-planning: window %d (ended after %d steps), evaluated: %s; superseded by window "
                                 "%d's, heard at its own boundary", decision["window"], decision["window_ended"],
                                 window_line(decision), window)
                    own = superseding(decision, own)
                decision = own or decision
            self.judging = False
        self.confirming = decision is not None and not decision["switch"] and decision["confirmations"] > 0 and \
            self.thinking is None and not is_census(decision)
        # A window that takes an owed census or confirms a switch is the shortest: a ViT's plan
        # came back 46-59 steps after its straggler went, through four windows of 2 s.
        short = decision is not None and (decision.get("census_owed") or decision["confirmations"] > 0)
        self.next_boundary = self.steps + (confirming_steps(decision) if short else
                                           window_steps(wall_s or figures.step_s, self.window_s))
        if self.messages is not None:
            self.messages.send_decision(decision, window, self.next_boundary)
        self.on_its_way = (window, self.steps + (DECIDED_AFTER if self.messages is not None else 0), decision)

    def _hear(self, step) -> dict | None:
        """The decision on its way, now due: process 0's own, the others' from its message."""
        window, _, decision = self.on_its_way
        self.on_its_way = None
        if not self.decides:
            decision, self.next_boundary = self.messages.read_decision(window, self.steps)
        if decision is not None:
            step.set_prediction(decision["running"])
            self.last = decision
            self.census_owed = self.census_owed or decision.get("census_owed", False)  # every process alike
            self.census_why = decision.get("census_why") or self.census_why
            self.reprobe_owed = decision.get("reprobe_owed", False)
            if self.decides and is_census(decision):
                f = decision["factors"]
                self.say(("every device probed" if self.probe is not None else "every device given one probe rate "
                          "(one process: one device shared)") + " (a census): speeds x["
                         + ", ".join(f"{x:.2f}" for x in f["speed"]) + "]; the operators' own pricing per stage x["
                         + ", ".join(f"{x:.2f}" for x in f["stage_pricing"]) + "]" + (
                             "; measured beyond that price (later windows take it out of its stage's times): x["
                             + ", ".join(f"{x:.2f}" for x in f["unpriced"]) + "]"
                             if any(abs(x - 1) > 0.005 for x in f.get("unpriced", [])) else ""))
        if decision is not None and self.decides and LOGGER.isEnabledFor(logging.DEBUG):
            LOGGER.debug("re-planning: window %d (ended after %d steps) heard after %d steps: %s", decision["window"],
                         decision["window_ended"], self.trained, window_line(decision))
        if self.timeline is not None:
            if decision is not None:
                self.timeline.instant(PLANNER, "decided: " + decision["reason"],
                                      time.perf_counter(), arithmetic=decision["arithmetic"],
                                      waited_for_planning_s=decision.get("waited_s", 0.0))
            self.timeline.write()
        return decision

    def settle(self) -> None:
        """Before the pipeline this re-plans stops (a switch, or another capture's turn;
        every process alike): the decision on its way is dropped, the evaluation under way
        waited for and dropped, and every figure the peers sent read, so that nothing of
        this pipeline's windows is left to be read as a later one's."""
        if self.on_its_way is not None and not self.decides:
            self.messages.read_decision(self.on_its_way[0], self.steps)
        self.on_its_way = None
        if self.thinking is not None:  # a switch changes what it measured
            self.thinking[0].join()
            self.thinking = None
        if self.decides and self.messages is not None:
            for window in self.messages.unread(self.windows):
                for peer in range(1, self.group.world_size):
                    self.messages.read_figures(peer, window)

    def switched(self, entry: dict, plan, decision: dict | None) -> None:
        """After a switch to `plan` (`entry`: its log entry; `decision`: the Replanner's, or
        None when forced): its windows start over."""
        if self.replanner is not None:
            self.replanner.switched_to(plan.handle, self.last_wall_s)
            self.judging = decision is not None and not decision["undo"]
        self.restart_windows()
        self.rebuild_s = entry["rebuild_s"]
        entry["step_before_s"] = self.last_wall_s or entry["step_before_s"]  # as the first window after it is measured
        if entry["received_bytes"] and entry["transfer_s"] > 0:
            self.bytes_per_s = entry["received_bytes"] / entry["transfer_s"]
        self.say(f"step {entry['step']}: {entry['old']} -> {entry['new']}; {entry['arithmetic'] or entry['reason']}; "
                 f"moved in {entry['move_s'] * 1e3:.1f} ms ({moved_here(entry, self.group is not None)}, rebuilding "
                 f"{entry['rebuild_s'] * 1e3:.1f} ms)")

    def _think(self, mine: WindowFigures, ended: int) -> None:
        """Starts the evaluation of one window (ended after the job's `ended` steps) on a thread
        of its own, which first reads the other processes' figures of it (and of any window
        before it left unread; those of later windows are read by the next evaluation)."""
        self.census_figures = None
        box: dict = {}
        unread = self.messages.unread(mine.window) if self.messages is not None else range(0)
        peers = range(1, self.group.world_size) if self.group is not None else range(0)
        may_search = time.perf_counter() >= self.next_search_at

        def run():
            run_on_spare_time()
            box["thread"] = threading.get_native_id()
            t0, cpu0 = time.perf_counter(), time.thread_time()
            box["started"] = t0
            try:
                reports, every, probe_rate = [mine.stages], [mine], [mine.probe_rate]
                for peer in peers:
                    for window in unread:  # the last is this window's; earlier ones went unevaluated
                        theirs = self.messages.read_figures(peer, window)
                    if len(theirs.stages) != len(mine.stages):
                        raise ExecutionError(f"process {peer}'s figures of re-planning window {mine.window} have "
                                             f"{len(theirs.stages)} stages, this process's {len(mine.stages)}: the "
                                             "processes run different plans (restart the job)")
                    reports.append(theirs.stages)
                    every.append(theirs)
                    probe_rate.append(theirs.probe_rate)
                stages, waiting = merge_processes(reports) if len(reports) > 1 else (reports[0], [])
                box["read_s"] = time.perf_counter() - t0
                measured = [{k: s[k] for k in FIGURES if k != "across_s"} for s in stages]
                # Device d is process d; one process's devices are one (its census: alike).
                probed = probe_rate if self.probe is not None else [1.0] * self.devices if mine.probe_rate else []
                step_s, optimizer_s, host_s = step_terms(every, per_device=self.probe is not None)
                box["decision"] = self.replanner.evaluate(measured, step_s, rebuild_s=self.rebuild_s,
                                                          bytes_per_s=self.bytes_per_s, may_search=may_search,
                                                          probe_rate=probed, optimizer_s=optimizer_s, host_s=host_s,
                                                          caller_step_s=mine.wall_s or mine.step_s)
                box["decision"].update(waiting=waiting, across_s=[s["across_s"] for s in stages], probe_rate=probed,
                                       window=mine.window, window_ended=ended)
            except BaseException as e:  # raised where the decision is heard, on the caller's thread
                box["error"] = e
            t1 = time.perf_counter()
            box["planning_s"], box["planning_cpu_s"] = t1 - t0, time.thread_time() - cpu0
            if self.timeline is not None:
                decided = box.get("decision")
                self.timeline.span(PLANNER, f"evaluating window {mine.window}", t0, t1,
                                   reason=decided["reason"] if decided else repr(box.get("error")))

        # Not a daemon: the interpreter waits for an evaluation at exit rather than tearing the
        # planner down under it (a daemon still searching at exit aborted the process).
        thread = threading.Thread(target=run, name="conveyor-replanning", daemon=False)
        thread.start()
        self.thinking = (thread, box)

    def _planner_thread(self) -> set:
        """Process 0: the native id of the planner thread under way, if any (one that ended is
        no longer among the process's threads)."""
        return {self.thinking[1]["thread"]} if self.thinking is not None and "thread" in self.thinking[1] else set()

    def _planner_cpu_so_far(self) -> float:
        """Process 0: the planner thread's CPU time over every evaluation so far, the one
        under way included."""
        if self.thinking is None:
            return self.planner_cpu_s
        box = self.thinking[1]
        live = thread_cpu_s(box["thread"]) if "thread" in box else None
        return self.planner_cpu_s + box.get("planning_cpu_s", live or 0.0)

    def _decided(self, within_s: float | None = None, while_given: bool = False) -> dict | None:
        """The evaluation under way, once it ends: waited for here if it is not over yet
        (judging a switch, which needs no search), or at most `within_s`, or while the
        planner gets the core the wait gives up (`while_given`: wait_while_given); None if
        it runs on."""
        if self.thinking is None:
            return None
        thread, box = self.thinking
        t0 = time.perf_counter()
        if while_given:
            wait_while_given(thread, box.get("thread"))
        else:
            thread.join(within_s)
        if thread.is_alive():
            return None
        self.thinking = None
        if "error" in box:
            raise box["error"]
        decision = box["decision"]
        self.evaluated += 1
        self.planner_cpu_s += box["planning_cpu_s"]
        if decision["searched"]:
            self.next_search_at = box["started"] + box["planning_cpu_s"] / SEARCH_SHARE
        decision.update(planning_s=box["planning_s"], planning_cpu_s=box["planning_cpu_s"], read_figures_s=box["read_s"],
                        waited_s=time.perf_counter() - t0, evaluated=self.evaluated, planner_cpu_s=self.planner_cpu_s)
        return decision

    def _measure_switch(self, switches: list, step_s: float) -> None:
        """The last switch's measured gain, from the first window after it: in the step as the
        caller saw it (`step_s`), against the window's before it."""
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
            return (f"re-planning: no evaluation heard yet (the first window ends {WINDOW} steps after the first step, "
                    f"its evaluation heard at the next window's end, of at least {WINDOW} steps and {self.window_s:g} s)\n")
        d = self.last
        f = d["factors"]
        speeds = ", ".join(f"{s:.2f}" for s in f["speed"])
        running = json.loads(d["running"].to_json())
        idle = idle_devices(running)
        probed = d.get("probe_rate") or []
        one_device = self.probe is None and self.devices > 0  # one process's census (it has no other probes)
        unprobed = [] if one_device else [i for i in idle if i >= len(probed) or probed[i] <= 0]
        unmeasured = "".join(
            (f"  device {i} idle under the running plan: as fast as the devices that run (one process: one device "
             f"shared), speed x{f['speed'][i]:.2f}\n" if one_device else
             f"  device {i} idle under the running plan: its process probes it each window ({probed[i]:.0f} matrix "
             f"products/s), speed x{f['speed'][i]:.2f} against the devices that run\n")
            for i in idle if i not in unprobed)
        unmeasured += (f"  device{'s' if len(unprobed) > 1 else ''} {', '.join(map(str, unprobed))} idle under the "
                       "running plan: never measured, so how it compares with the devices that run is the cluster's "
                       "speeds, uncorrected\n") if unprobed else ""
        ceilings = "".join(
            f"  device {i} probed slower than the fastest: its speed taken as x{c:.2f} at most, whatever a light stage "
            f"there measures (on a core it shares, a process woken from waiting runs ahead of its neighbour); probed "
            f"again every {REPROBE_EVERY} windows\n" for i, c in enumerate(d.get("speed_ceiling", [])) if c > 0)
        pricing = f.get("stage_pricing") or []
        per_byte = d.get("optimizer_s_per_param_byte", 0.0)
        optimizer = (f"the optimizer's step {per_byte * 1e12:.1f} ms per GB of parameters a device updates"
                     if per_byte > 0 else "the optimizer's step counted with the host's time, the same under any plan "
                     "(one process, or not timed)")
        if any(abs(x - 1) > 1e-9 for x in pricing):
            unmeasured += ("  the operators' own pricing per stage, told from the devices' speeds by the census: x["
                           + ", ".join(f"{x:.2f}" for x in pricing) + "]\n")
        sums = "".join(
            f"  stage {k}'s gradient sum across processes: {moving * 1e3:.2f} ms per step moving bytes; waiting "
            f"for the slowest process: " + ", ".join(f"process {p} {w * 1e3:.2f} ms" for p, w in enumerate(waits)) +
            (f" (process {waits.index(min(waits))} is the slowest)" if len(waits) > 1 and max(waits) > 0 else "") + "\n"
            for k, (moving, waits) in enumerate(zip(d.get("across_s", []), d.get("waiting", []))) if moving > 0)
        return (f"re-planning: {d['reason']}\n  {d['arithmetic']}\n{sums}{ceilings}  corrections: forward x{f['forward']:.2f}, "
                f"backward x{f['backward']:.2f}, weight gradient x{f['weight']:.2f}, transfers x{f['link']:.2f}; "
                f"device speeds x[{speeds}]; the runtime's cost per action {d['action_overhead_s'] * 1e6:.0f} us; "
                f"{optimizer}\n"
                f"{unmeasured}  the planner thread: {d['evaluated']} evaluations, {d['planner_cpu_s']:.3f} s of CPU in "
                f"all (the last: {d['planning_cpu_s'] * 1e3:.1f} ms of CPU over {d['planning_s'] * 1e3:.1f} ms, "
                f"{'a search' if d.get('searched') else 'no search'})\n{self.cost_line()}"
                f"  switches so far: {len(switches)}\n")

    def cost_line(self) -> str:
        """What re-planning took of the steps so far, as a line of profile_report()."""
        c = self.cost()
        of = (lambda s: f"{100 * s / c['steps_wall_s']:.2f}%") if c["steps_wall_s"] > 0 else (lambda s: "-")
        planner = (f"; the planner thread {c['planner_cpu_s']:.3f} s of CPU ({of(c['planner_cpu_s'])}), of which the "
                   f"training's threads waited for {c['planner_took_s']:.3f} s ({of(c['planner_took_s'])}"
                   f"{', left out of the compute they measured' if self.on_cpu else ''})"
                   if self.decides else "")
        return (f"  re-planning's own cost: {c['boundary_s'] * 1e3:.1f} ms of the training thread at window boundaries"
                f" over {c['steps']} steps ({of(c['boundary_s'])} of their {c['steps_wall_s']:.2f} s){planner}\n")
