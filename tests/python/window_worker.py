"""One process of two: a small MLP replicated across both processes with replan="auto" and
re-planning's windows sized in time (CONVEYOR_REPLAN_WINDOW_S, set by the test), trained
until three windows have ended (at most STEPS steps). Each process writes, per step, how many windows had ended by then, and its
losses, to OUT.rank<R>. For test_replan.py: windows longer than WINDOW steps end at the same
step in every process.

    RANK=r WORLD_SIZE=2 CONVEYOR_REPLAN_WINDOW_S=1 ... python window_worker.py OUT STEPS
"""
import json
import sys

import torch

import conveyor
from switch_back_worker import data


def main(out: str, steps: int) -> None:
    net, x, y = data(layers=2, width=32, batch=16)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = conveyor.Module(net, opt, loss_fn=torch.nn.MSELoss(), stages=1, replicas=2, microbatches=1, replan="auto")
    losses, windows = [], []
    while len(losses) < steps and (not windows or windows[-1] < 3):
        losses.append(model.train_step(x, target=y).item())
        windows.append(model.capture.replanning.windows)
    with open(f"{out}.rank{model.rank}", "w") as f:
        json.dump({"losses": losses, "windows": windows, "window_s": model.capture.replanning.window_s}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
