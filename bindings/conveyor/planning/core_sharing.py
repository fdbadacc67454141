"""What the planner thread took from the training where they share a core (docs/design.md,
"Re-planning"), so that a window's compute is read without it.

Process 0's planner searches beside the training at a lower priority and on any core the
process may use (run_on_spare_time), yet where both share one core (a process allowed one,
or every core busy) a search still takes about a tenth of it, and that window's compute on process 0
runs slower by what the search took. Read as process 0's device being slower, it made a
straggler elsewhere read faster (the kinds are read from the fastest replica): a user's
Llama read its straggler at x0.62, x0.83 and x0.51 in three windows, the windows that
confirm a switch disagreed, and the switch came 37 steps after the straggler did.

Linux tells how long each thread waited for a CPU while it could run (its schedstat's run
delay). Over a window, the planner took from the training at most its own CPU time and at
most the other threads' waits (beside a busy neighbour they also wait for it, but never
longer than they waited); that time over the other threads' runnable time (CPU and waits)
is the share of their compute's wall time it took. Elsewhere nothing is read, and nothing
corrected.

Where the training waits for the planner (an evaluation two windows late), the wait gives
the planner the core only where nothing else wants it: wait_while_given.
"""
from __future__ import annotations

import os
import threading
import time

TASKS = "/proc/self/task"
MOST_TAKEN = 0.5  # the largest share a window's compute is corrected by (the planner runs at a tenth)


PLANNER_NICENESS = 10  # the planner thread's: a tenth of a core the training wants too
# Where the cores this process may use are listed (cgroup v2, then v1's cpuset); else every core.
CGROUP_CPUS = ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus")


def lower_priority() -> None:
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


def machine_cores() -> set[int]:
    """The cores this process may use whatever its threads are pinned to: its cgroup's
    cpuset, else every core of the machine."""
    for path in CGROUP_CPUS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        cores = set()
        for part in filter(None, text.split(",")):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
        if cores:
            return cores
    return set(range(os.cpu_count() or 1))


def run_on_spare_time() -> None:
    """The calling thread (the planner's) yields to the training (lower_priority) and runs on
    any core the process may use, not only those its training is pinned to: the training's
    pinning is for the training. Confined to a straggler's core, which it shared with the
    training and a busy neighbour, process 0's planner got about 5% of it, a search took
    some 6 s, and a Llama's first switch came 11-35 steps after its straggler did, while the
    other process's core idled, waiting for the straggler (13-15 steps once free of it)."""
    lower_priority()
    try:
        os.sched_setaffinity(0, machine_cores())  # this thread alone (Linux)
    except (AttributeError, OSError, ValueError):
        pass  # elsewhere, or cores the process may not use: where the training runs


def threads_run_s(leave_out: set) -> dict[int, tuple[float, float]]:
    """This process's threads but `leave_out` (native ids): per thread, its CPU time and its
    waits for a CPU while runnable so far, in seconds (none where Linux does not say)."""
    threads = {}
    try:
        tasks = os.listdir(TASKS)
    except OSError:
        return threads
    for tid in tasks:
        if not tid.isdigit() or int(tid) in leave_out:
            continue
        try:
            with open(f"{TASKS}/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            threads[int(tid)] = (int(ran) / 1e9, int(waited) / 1e9)
        except (OSError, ValueError):
            continue  # the thread ended since the listing
    return threads


def run_since(before: dict, now: dict) -> tuple[float, float]:
    """The CPU time and the waits for a CPU of the threads of `now` since `before` (both
    threads_run_s's): a thread started since counts whole, one ended since not at all (summed
    over the threads instead, a switch's new pipeline threads read as time run backwards)."""
    ran = waited = 0.0
    for tid, (cpu, wait) in now.items():
        cpu0, wait0 = before.get(tid, (0.0, 0.0))
        ran, waited = ran + max(0.0, cpu - cpu0), waited + max(0.0, wait - wait0)
    return ran, waited


def thread_cpu_s(native_id: int) -> float | None:
    """A thread of this process's CPU time so far (None: ended, or not Linux)."""
    try:
        with open(f"{TASKS}/{native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class CoreSharing:
    """From one mark to the next (a window's boundaries), what the planner thread took of
    this process's other threads: `planner_cpu_s` is the planner's CPU time so far (every
    evaluation's, the one under way included), `planners` the native ids of its threads
    still running."""

    def __init__(self):
        self.marked: tuple | None = None  # (planner CPU, the others' threads_run_s) at the last mark
        self.taken_s = 0.0  # over every window so far: what the planner took of the others

    def mark(self, planner_cpu_s: float, planners: set) -> None:
        self.marked = (planner_cpu_s, threads_run_s(planners))

    def share_taken(self, planner_cpu_s: float, planners: set) -> float:
        """Since the last mark: the share of the other threads' runnable time the planner
        took (0 before any mark); marks anew."""
        if self.marked is None:
            self.mark(planner_cpu_s, planners)
            return 0.0
        planner0, threads0 = self.marked
        self.mark(planner_cpu_s, planners)
        ran, waited = run_since(threads0, self.marked[1])
        taken = max(0.0, min(planner_cpu_s - planner0, waited))
        self.taken_s += taken
        return min(MOST_TAKEN, taken / (ran + waited)) if ran + waited > 0 else 0.0


class NeighbourWaits:
    """From one mark to the next (a window's boundaries), the share of this process's threads'
    runnable time (their CPU and their waits for a CPU) spent waiting, the threads in
    `leave_out` (the planner's) left out: how much of its core other processes took (0 where
    Linux does not say). Unlike a probe it costs nothing, and unlike the stages' times it does
    not move with the work the plan gives the process."""

    def __init__(self):
        self.marked: dict | None = None  # threads_run_s at the last mark

    def share(self, leave_out: set) -> float:
        now = threads_run_s(leave_out)
        before, self.marked = self.marked, now
        if before is None:
            return 0.0
        ran, waited = run_since(before, now)
        return waited / (ran + waited) if ran + waited > 0 else 0.0

# Process 0's training waits for an evaluation still under way at its second boundary; the
# wait gives the planner the training's core only where nothing else wants it. Beside a busy
# process at the training's priority (a straggler's neighbour on process 0's core) the
# niceness-10 planner got a tenth of it: GPT-2's search after a switch stalled a step 1.8 s
# for about 0.2 s of the planner's CPU. So the wait goes in slices, and is given up at that
# boundary (the decision is heard at a later one) once a slice gave the planner less than
# half of its wall time.
WAIT_SLICE_S = 0.02
LEAST_GIVEN = 0.5


def wait_while_given(thread: threading.Thread, native_id) -> None:
    """Waits for `thread` (Linux thread id `native_id`, None if not known yet) in slices of
    WAIT_SLICE_S while it gets at least LEAST_GIVEN of each slice's wall time as CPU (where
    Linux does not say, to its end)."""
    def cpu() -> float | None:
        return thread_cpu_s(native_id) if native_id is not None else None

    before, t0 = cpu(), time.perf_counter()
    while thread.is_alive():
        thread.join(WAIT_SLICE_S)
        now, t1 = cpu(), time.perf_counter()
        if thread.is_alive() and before is not None and now is not None and now - before < LEAST_GIVEN * (t1 - t0):
            return
        before, t0 = now, t1
