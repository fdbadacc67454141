"""A model that branches and joins across three processes with conveyor.distributed.Sequential
(ChainerMN's MultiNodeChainList with several rank_in/rank_out): a stem on process 0 feeds
two branches, on processes 1 and 2; their outputs join on process 0, and the head on
process 1 reads the join. Each output crosses once to each process that reads it.

    ./run conveyor launch -n 3 -- python examples/distributed/branching.py
    ./run python examples/distributed/branching.py        (the same model in one process)
"""
import torch
import torch.nn as nn

from common import arguments, regression_batches, save, split, train_alone

WIDTH, BATCH = 8, 4


class Join(nn.Module):
    """Reads both branches: a linear map of their elementwise product."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, left, right):
        return self.mix(left * right)


def main():
    args = arguments()
    stem = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh())
    left, right = nn.Linear(2 * WIDTH, WIDTH), nn.Sequential(nn.Linear(2 * WIDTH, WIDTH), nn.Sigmoid())
    join, head = Join(), nn.Linear(WIDTH, 1)
    named = {"stem": stem, "left": left, "right": right, "join": join, "head": head}
    for m in named.values():
        m.to(args.device)
    batches = regression_batches(args.device, BATCH, WIDTH)
    losses = []
    if not split():
        def loss_of(x, y):
            h = stem(x)
            return ((head(join(left(h), right(h))) - y) ** 2).mean()
        return train_alone(args.out, named, batches, loss_of)

    import conveyor.distributed as dist
    model = dist.Sequential([(stem, 0), (left, 1, [0]), (right, 2, [0]), (join, 0, [1, 2]), (head, 1)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    me = dist.rank()
    for x, y in batches:
        optimizer.zero_grad()
        out = model(x if me == 0 else None)  # the input, where the stem runs
        if out is not None:                  # the head's process holds the loss
            loss = ((out - y) ** 2).mean()
            dist.backward(loss)
            losses.append(loss.item())
        else:
            dist.backward()
        optimizer.step()
    held = {name: m for name, m in named.items() if any(m is mine for mine in model.local)}
    save(args.out, held, losses, me)


if __name__ == "__main__":
    main()
