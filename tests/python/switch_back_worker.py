"""One process of two: an MLP whose gradients fill several 4 MiB buckets trains with its one
stage replicated across both processes, then on two stages (each process then releases the
parameters of the stage it does not run), then on the first plan again; process 0 writes
the losses and the gathered state. For test_replan.py: coming back, every process must cut
the same gradient buckets, whatever it released meanwhile.

    RANK=r WORLD_SIZE=2 ... python switch_back_worker.py OUT
"""
import sys

import torch

import conveyor
from replan_worker import plan_with

LAYERS, WIDTH, BATCH, STEPS_PER_PLAN = 6, 384, 16, 2


def data(layers: int = LAYERS, width: int = WIDTH, batch: int = BATCH):
    """A Tanh MLP of `layers` square layers and a batch of inputs and targets, in float64 (seed 0)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
    return net.double(), torch.randn(batch, width, dtype=torch.float64), torch.randn(batch, width, dtype=torch.float64)


def main(out: str) -> None:
    net, x, y = data()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model = conveyor.Module(net, opt, loss_fn=torch.nn.MSELoss(), stages=1, replicas=2, microbatches=2, replan="off")
    losses = []
    for k in range(3):
        if k == 1:
            first = model.plan
            parts = model.capture.graph.random_partition(2, seed=0, keep_node_order=True)
            model.switch_plan(plan_with(model, parts, [1, 1], "1f1b", 2))
        elif k == 2:
            model.switch_plan(first)
        losses += [model.train_step(x, target=y).item() for _ in range(STEPS_PER_PLAN)]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.rank == 0:
        torch.save({"losses": losses, "state": state, "replans": model.replans}, out)


if __name__ == "__main__":
    main(sys.argv[1])
