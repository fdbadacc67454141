"""One process of a two-process job whose only stage has a replica in each (data parallel
across the processes), one process slowed by a CPU hog on its core: trains until re-planning
has evaluated its first window and prints, from process 0, what that window concluded (the
corrections, and the waiting told from moving) as `WINDOW {json}`. With REPLAN=off it trains
a few steps without re-planning instead and prints, from each process, its own live profile's
gradient sum across processes, moving told from waiting by the group itself, as
`PROFILE {json}`. With LEAVES=1 (the straggler process 0, behind nine hogs, and rated that
slow in the cluster) it trains the model pipelined, its stages free; two windows after a plan
leaves the straggler's device idle, process 0 stops its hogs; both train a fixed number of
steps, and process 0 prints the switches as `LEFT {json}`. With STRAGGLER=-1 (none) it trains
GPT-NeoX pipelined over the two processes, whose stages the profile prices unevenly,
for five windows, and process 0 prints each window's corrections and the switches as
`EVEN {json}`. For test_straggler.py.

    RANK=r WORLD_SIZE=2 ... STRAGGLER=1 [REPLAN=off | LEAVES=1] python straggler_worker.py

Each process is pinned to core RANK (of the cores it may use) with one thread, as a user
pins one process per device; the straggler's hogs are pinned to the same core and killed at the
end. Two hogs leave it a third of its core: with one (half a core) the straggler measured
only 1.0-1.6 times slower when it was process 1, whose core here is the less busy one.
"""
import json
import os
import subprocess
import sys

import torch

import conveyor
from auto_switch_worker import two_node_cluster
from conveyor.planning.window_decisions import WINDOW, idle_devices

WIDTH = 768  # steps of about 0.1 s here: a window spans many of the scheduler's time slices
HOGS = 3
HOGS_LEAVING = 9  # about a tenth of its core: the plan leaves the straggler's device idle
LEAVING_STEPS = 100  # both processes: a re-plan leaving the straggler idle (by step 17, if the first
# plan does not, or later: one left it at step 34), the hogs stopped two windows later, the probe's
# next window, its confirmation and the decision's way back; and room for a way back undone
# once (a plan found in the window the hogs stopped in, which saw them only in part, read
# slower by the window judging it and undone: at 60 steps, 2 runs of 5 ended there) and the
# return after it, which asks twice the gain
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nprint(flush=True)\nwhile True:\n    pass\n"


def main() -> None:
    rank, straggler = int(os.environ["RANK"]), int(os.environ["STRAGGLER"])
    replan = os.environ.get("REPLAN", "auto")
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    leaves = os.environ.get("LEAVES") == "1"
    hogs = []
    if rank == straggler:
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(core)], stdout=subprocess.PIPE)
                for _ in range(HOGS_LEAVING if leaves else HOGS)]
        for hog in hogs:
            hog.stdout.readline()  # on its core, spinning
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())])
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
        if leaves:
            leave_idle(net, opt, x, y, rank, hogs)
            return
        if straggler < 0:
            even_devices(rank)
            return
        model = conveyor.Module(net, opt, loss_fn=torch.nn.MSELoss(), stages=1, replicas=2, microbatches=1,
                                replan=replan)
        if replan == "off":
            for _ in range(2 * WINDOW):
                model.train_step(x, target=y)
            report = model.profile_report()
            (stage,) = report.stages
            print("PROFILE " + json.dumps({"across_s": stage["across_s"], "waiting_s": stage["waiting_s"],
                                           "report": str(report)}), flush=True)
            return
        # The first window's decision is sent at the second window's boundary, or the third's
        # when the planner, yielding the core to the training, has not finished by then, and
        # applied a step later.
        for step in range(3 + 3 * WINDOW):
            model.train_step(x, target=y)
            if step >= 2 * WINDOW and model.profile_report().replan is not None:
                break
        report = model.profile_report()
        if rank == 0:
            decision = report.replan
            print("WINDOW " + json.dumps({"factors": decision["factors"], "waiting": decision["waiting"],
                                          "planning_s": decision["planning_s"], "waited_s": decision["waited_s"],
                                          "layout": model.capture.layout[4], "report": str(report)}), flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def leave_idle(net, opt, x, y, rank: int, hogs: list) -> None:
    """LEAVES=1: process 0, behind its hogs, rated as slow as they make it, so that the plan
    leaves its device idle (the first, or the first re-plan); its hogs stop once two windows'
    probes measured it idle, and the plan takes it back."""
    cluster = two_node_cluster((1 / (HOGS_LEAVING + 1), 1.0), "straggler")
    model = conveyor.Module(net, opt, loss_fn=torch.nn.MSELoss(), replicas=1, cluster=cluster, replan="auto")
    idle_since = stopped_at = None
    for step in range(LEAVING_STEPS):
        model.train_step(x, target=y)
        if idle_since is None and 0 in idle_devices(model.plan.document):
            idle_since = step
        if hogs and idle_since is not None and step >= idle_since + 2 * WINDOW + 1:
            for hog in hogs:
                hog.kill()
                hog.wait()
            hogs.clear()
            stopped_at = step
    if rank == 0:
        told = ("step", "old", "new", "arithmetic", "measured_step_s")
        print("LEFT " + json.dumps({"switches": [{k: s[k] for k in told} for s in model.replans],
                                    "idle_since": idle_since, "stopped_at": stopped_at,
                                    "idle": idle_devices(model.plan.document), "report": str(model.profile_report())}),
              flush=True)

def even_devices(rank: int) -> None:
    """STRAGGLER=-1: no straggler, transformers' GPT-NeoX (its 50k vocabulary) pipelined
    under zb-v over the two processes, its stages priced unevenly by the profile. Process 0
    prints every evaluated window's corrections and probes, and the switches."""
    import transformers
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                        intermediate_size=1024, max_position_embeddings=128)
    net = transformers.GPTNeoXForCausalLM(config)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    x = torch.randint(0, config.vocab_size, (8, 64))
    model = conveyor.Module(net, opt, replicas=1, microbatches=4, schedule="zb-v", replan="auto")
    windows, last, idle_at = [], None, []
    for step in range(1 + 5 * WINDOW):
        model.train_step(x, labels=x)
        if idle_devices(model.plan.document):
            idle_at.append(step)
        decision = model.profile_report().replan
        if rank == 0 and decision is not None and decision is not last:
            last = decision
            windows.append({"factors": decision["factors"], "probe_rate": decision["probe_rate"],
                            "census_owed": decision["census_owed"]})
    if rank == 0:
        print("EVEN " + json.dumps({"windows": windows, "stages": len(model.plan.document["stages"]),
                                    "idle_at": idle_at, "report": str(model.profile_report()),
                                    "switches": [{k: s[k] for k in ("step", "old", "new")} for s in model.replans]}),
              flush=True)


if __name__ == "__main__":
    main()
