"""What the planner thread takes of the training where they share a core, read out of a
window's compute (conveyor/planning/core_sharing.py)."""
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import busy_cores
from conveyor.planning.core_sharing import (CoreSharing, NeighbourWaits, lower_priority, machine_cores,
                                           run_on_spare_time, run_since, thread_cpu_s, threads_run_s, wait_while_given)
from conveyor.planning.window_figures import window_figures
from conveyor.planning.replanning_messages import FIGURES

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux tells threads' run-queue waits")


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds  # CPU time: the same work however the core is shared
    x = 0
    while time.thread_time() < end:
        x += 1


def planner_beside(training_busy: bool) -> tuple:
    """A planner-like thread (niceness 10) busy for 0.3 s of CPU beside this thread, both on
    one core; this thread busy too, or sleeping. Returns (share taken, taken_s, planner CPU)."""
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    # Threads other tests left in this process (a module's transport, still closing) are left
    # out with the planner's: this thread stands for the training's.
    planners = {int(t) for t in os.listdir("/proc/self/task")} - {threading.get_native_id()}
    sharing, done = CoreSharing(), {}
    try:
        def planner():
            lower_priority()  # as the planner, kept on the training's core (one core to the process)
            planners.add(threading.get_native_id())
            busy(0.3)
            done["cpu"] = thread_cpu_s(threading.get_native_id())

        sharing.mark(0.0, planners)
        t = threading.Thread(target=planner)
        t.start()
        while t.is_alive():
            if training_busy:
                busy(0.05)
            else:
                time.sleep(0.05)
        t.join()
        return sharing.share_taken(done["cpu"], planners), sharing.taken_s, done["cpu"]
    finally:
        os.sched_setaffinity(0, before)


def test_a_planner_sharing_the_trainings_core_is_read_as_a_share_of_its_compute():
    share, taken_s, planner_cpu = planner_beside(training_busy=True)
    assert 0 < taken_s <= planner_cpu, (taken_s, planner_cpu)
    assert 0 < share <= 0.5, share


def test_a_planner_beside_a_training_that_waits_takes_nothing_from_it():
    busy_share, busy_taken, _ = planner_beside(training_busy=True)
    idle_share, idle_taken, _ = planner_beside(training_busy=False)
    assert idle_taken < busy_taken / 2, (idle_taken, busy_taken)


def test_the_threads_of_this_process_are_read():
    before = threads_run_s(set())
    busy(0.05)
    now = threads_run_s(set())
    assert now[threading.get_native_id()][0] > 0.05
    assert run_since(before, now)[0] >= 0.05
    assert run_since({}, now)[0] == pytest.approx(sum(cpu for cpu, _ in now.values()))  # threads started since: whole
    assert thread_cpu_s(threading.get_native_id()) > 0.05
    assert thread_cpu_s(2 ** 30) is None  # no such thread


def test_a_window_s_compute_is_scaled_and_nothing_else():
    stage = {k: 0.1 for k in FIGURES}
    stage["replica_compute_s"] = [0.2, 0.0]
    report = {"stages": [stage], "measured_step_s": 0.5}
    f = window_figures(report, 3, 0.0, compute_scale=0.9)
    s = f.stages[0]
    for k in ("forward_s", "backward_s", "backward_weight_s"):
        assert s[k] == pytest.approx(0.09)
    assert s["replica_compute_s"] == pytest.approx([0.18, 0.0])
    for k in ("send_s", "allreduce_s", "across_s", "waiting_s"):
        assert s[k] == 0.1
    assert f.step_s == 0.5 and f.window == 3


def planner_thread(cpu_s: float, niceness: bool) -> tuple:
    """A planner-like thread busy for `cpu_s` of CPU (at niceness 10 if `niceness`), started;
    returns it and its Linux thread id, once known."""
    ids = []

    def planner():
        if niceness:
            lower_priority()  # as the planner, kept on the training's core
        ids.append(threading.get_native_id())
        busy(cpu_s)

    t = threading.Thread(target=planner)
    t.start()
    while not ids:
        time.sleep(0.001)
    return t, ids[0]


def test_a_wait_for_a_planner_that_a_busy_neighbour_starves_is_given_up_while_it_runs():
    # Process 0's core shared with a straggler's neighbour at the training's priority: the
    # niceness-10 planner gets about a tenth of what the training's wait gives up.
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    neighbour = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                                  "while True: pass"])
    os.sched_setaffinity(0, {core})
    try:
        time.sleep(0.2)  # the neighbour pinned and busy
        planner, native_id = planner_thread(1.0, niceness=True)
        wait_while_given(planner, native_id)
        assert planner.is_alive()  # 1 s of CPU at a tenth of the core: seconds from its end
        planner.join()
    finally:
        neighbour.kill()
        neighbour.wait()
        os.sched_setaffinity(0, before)


def test_a_wait_that_gives_the_planner_the_core_lasts_until_its_evaluation_ends():
    busy = busy_cores(most=1.0)
    if busy > 1.0:
        pytest.skip(f"needs a core nothing else wants: other work keeps {busy:.1f} of the machine's cores busy")
    planner, native_id = planner_thread(0.2, niceness=False)
    wait_while_given(planner, native_id)
    assert not planner.is_alive()


def test_a_busy_neighbour_on_the_core_is_read_from_the_waits_and_its_leaving_too():
    """NeighbourWaits (what lets a straggler's process probe again as soon as its neighbour
    leaves): busy beside a busy process pinned to the same core, about half of this thread's
    runnable time is spent waiting for the CPU; with the neighbour gone, little is, however
    much else the machine runs on its other cores."""
    load = busy_cores(most=1.0)
    if load > 1.0:
        pytest.skip(f"needs a core nothing else wants: other work keeps {load:.1f} of the machine's cores busy")
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    waits = NeighbourWaits()
    os.sched_setaffinity(0, {core})
    neighbour = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                                  "while True: pass"])
    try:
        time.sleep(0.2)  # the neighbour pinned and busy
        waits.share(set())
        busy(0.3)
        beside = waits.share(set())
        neighbour.kill()
        neighbour.wait()
        time.sleep(0.05)
        waits.share(set())
        busy(0.3)
        alone = waits.share(set())
    finally:
        neighbour.kill()
        neighbour.wait()
        os.sched_setaffinity(0, before)
    assert beside > 0.3, beside
    assert alone < beside / 2, (alone, beside)
    assert NeighbourWaits().share(set()) == 0.0  # the first mark measures nothing


def test_the_planner_runs_on_any_core_the_process_may_use_though_its_training_is_pinned():
    """run_on_spare_time: a user's process pinned to one core (a straggler's, shared with a
    busy neighbour) does not confine its planner thread there, which then waited for a few
    per cent of it while the other cores idled."""
    cores = machine_cores()
    assert cores and all(isinstance(c, int) and c >= 0 for c in cores)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    seen = {}
    try:
        def planner():
            run_on_spare_time()
            seen["cores"] = os.sched_getaffinity(0)
            seen["niceness"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        t = threading.Thread(target=planner)
        t.start()
        t.join()
        assert os.sched_getaffinity(0) == {min(before)}  # the training's thread stays pinned
    finally:
        os.sched_setaffinity(0, before)
    assert seen["cores"] == cores & set(range(os.cpu_count() or 1)), seen
    assert seen["niceness"] >= 10, seen
