"""One process of two: an MLP replicated across both processes (data parallel), no straggler,
and process 1's first reading of its device's probe is half its rate, as where other work
passed through its core while the census probed it. Trains until re-planning has heard
DECISIONS decisions (at most STEPS steps); process 0 prints each decision's speeds, ceilings
and reason, and the switches, as `MISREAD {json}`. For test_straggler.py.

    RANK=r WORLD_SIZE=2 ... python misread_probe_worker.py

Each process is pinned to core RANK (of the cores it may use) with one thread.
"""
import json
import os

import torch

import conveyor
from conveyor.planning.device_probe import DeviceProbe

WIDTH = 768  # steps of about 0.1 s here
DECISIONS, STEPS = 6, 80


def misread_first_reading() -> None:
    """This process's first probe reading (its census) at half the rate its device ran at."""
    real, readings = DeviceProbe.rate, []

    def rate(self) -> float:
        readings.append(real(self))
        return readings[-1] / 2 if len(readings) == 1 else readings[-1]
    DeviceProbe.rate = rate


def main() -> None:
    rank = int(os.environ["RANK"])
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    if rank == 1:
        misread_first_reading()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())])
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
    model = conveyor.Module(net, opt, loss_fn=torch.nn.MSELoss(), stages=1, replicas=2, microbatches=1, replan="auto")
    decisions, last = [], None
    for _ in range(STEPS):
        model.train_step(x, target=y)
        decision = model.profile_report().replan
        if decision is not None and decision is not last:
            last = decision
            decisions.append({"speed": decision["factors"]["speed"], "ceiling": decision["speed_ceiling"],
                              "probe_rate": decision["probe_rate"], "confirmations": decision["confirmations"],
                              "reason": decision["reason"]})
        if len(decisions) >= DECISIONS:
            break
    if rank == 0:
        print("MISREAD " + json.dumps({"decisions": decisions, "report": str(model.profile_report()),
                                       "switches": [{k: s[k] for k in ("step", "old", "new", "reason")}
                                                    for s in model.replans]}), flush=True)


if __name__ == "__main__":
    main()
