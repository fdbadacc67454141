"""One process of two: an MLP in float64 replicated across both processes on a cluster that
rates process 1's device six times faster than it is, so the plan gives it most samples,
with replan="auto". It trains until the Replanner has switched to shares that match the
measured speeds, then forces a two-stage plan with switch_plan at a step where a decision
is on its way, and trains two more windows on it. Each process writes its losses, its log
of switches and, from process 0, the gathered state to OUT.rank<R>. For test_replan.py:
re-planning's messages between processes, and the switches they decide, keep training
exact and the processes in step.

    RANK=r WORLD_SIZE=2 ... python auto_switch_worker.py OUT
"""
import sys

import torch

import conveyor
from conveyor.planning.window_decisions import WINDOW
from replan_worker import plan_with
from switch_back_worker import data as mlp_data

LAYERS, WIDTH, BATCH = 4, 256, 512
MOST_STEPS = 2 + 8 * WINDOW  # the switch comes at the second or third window; far more means it failed


def two_node_cluster(speeds: tuple, name: str) -> str:
    """A cluster of two one-device nodes rated `speeds`, joined by 10 GB/s links."""
    return (f'name = "{name}"\n' + "".join(f'[[node]]\ndevices = 1\nmemory = "8 GiB"\nspeed = {v}\n' for v in speeds) +
            '[link.intra_node]\nbandwidth = "10 GB/s"\nlatency = "5 us"\n'
            '[link.inter_node]\nbandwidth = "10 GB/s"\nlatency = "5 us"\n')


def wrong_speeds_cluster(claimed: float = 3.0) -> str:
    """Two devices, the second said to be `claimed` times faster than it is: the plan gives it
    most of the work, and measurement shows it."""
    return two_node_cluster((1.0, claimed), "wrong-speeds")


def data():
    return mlp_data(LAYERS, WIDTH, BATCH)


def main(out: str) -> None:
    net, x, y = data()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model = conveyor.Module(net, opt, loss_fn=torch.nn.MSELoss(), cluster=wrong_speeds_cluster(6.0), stages=1,
                            replicas=2, microbatches=2, replan="auto")
    losses, windows = [], []  # windows: the windows ended by each call's end
    while not model.replans and len(losses) < MOST_STEPS:
        losses.append(model.train_step(x, target=y).item())
        windows.append(model.capture.replanning.windows)
    replanning = model.capture.replanning
    while replanning.on_its_way is None and len(losses) < 2 * MOST_STEPS:  # a window's decision on its way
        losses.append(model.train_step(x, target=y).item())
    forced_while_on_its_way = replanning.on_its_way is not None
    model.switch_plan(plan_with(model, model.capture.graph.random_partition(2, seed=1, keep_node_order=True),
                                [1, 1], "1f1b", 2))
    for _ in range(2 * WINDOW + 2):
        losses.append(model.train_step(x, target=y).item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # every process takes part
    torch.save({"losses": losses, "windows": windows, "replans": model.replans,
                "forced_while_on_its_way": forced_while_on_its_way,
                "state": state if model.rank == 0 else None}, f"{out}.rank{model.rank}")


if __name__ == "__main__":
    main(sys.argv[1])
