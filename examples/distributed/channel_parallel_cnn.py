"""A channel-parallel CNN (seed 001): each process holds a slice of both convolutions' output
channels. The first layer's slices are joined with allgather (each second-layer slice reads
every channel; backward: reduce-scatter), the second's are gathered at process 0, which
holds the classifier and the loss.

    ./run conveyor launch -n 2 -- python examples/distributed/channel_parallel_cnn.py   (or -n 3)
    CONVEYOR_EXAMPLE_WORLD=2 ./run python examples/distributed/channel_parallel_cnn.py   (one process, 2 slices)
"""
import os

import torch
import torch.nn as nn

from common import STEPS, arguments, save, split

CHANNELS, CLASSES, BATCH = 12, 10, 8


def slices(world: int):
    """Both layers cut into `world` slices of output channels, the same on every process."""
    first = [nn.Conv2d(3, CHANNELS // world, 3, padding=1) for _ in range(world)]
    second = [nn.Conv2d(CHANNELS, CHANNELS // world, 3, padding=1) for _ in range(world)]
    return first, second


def head(h, classifier, labels):
    return nn.functional.cross_entropy(classifier(torch.relu(h).mean(dim=(2, 3))), labels)


def main():
    args = arguments()
    world = int(os.environ.get("CONVEYOR_EXAMPLE_WORLD", os.environ.get("WORLD_SIZE", "1")))
    first, second = slices(world)
    classifier = nn.Linear(CHANNELS, CLASSES).to(args.device)
    for m in first + second:
        m.to(args.device)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, 3, 8, 8, generator=data).to(args.device),
                torch.randint(CLASSES, (BATCH,), generator=data).to(args.device)) for _ in range(STEPS)]
    modules = {f"first{p}": first[p] for p in range(world)} | {f"second{p}": second[p] for p in range(world)}
    losses = []
    if not split():
        everything = nn.ModuleList([*first, *second, classifier])
        optimizer = torch.optim.SGD(everything.parameters(), lr=0.1)
        for x, labels in batches:
            optimizer.zero_grad()
            h = torch.cat([torch.relu(f(x)) for f in first], dim=1)
            loss = head(torch.cat([s(h) for s in second], dim=1), classifier, labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return save(args.out, modules | {"classifier": classifier}, losses)

    import conveyor.distributed as dist
    me = dist.rank()
    mine = nn.ModuleList([first[me], second[me]] + ([classifier] if me == 0 else []))
    optimizer = torch.optim.SGD(mine.parameters(), lr=0.1)
    for x, labels in batches:
        optimizer.zero_grad()
        h = torch.cat(dist.allgather(torch.relu(first[me](x))), dim=1)
        parts = dist.gather(second[me](h), root=0)
        if me == 0:
            loss = head(torch.cat(parts, dim=1), classifier, labels)
            dist.backward(loss)
            losses.append(loss.item())
        else:
            dist.backward()
        optimizer.step()
    held = {f"first{me}": first[me], f"second{me}": second[me]} | ({"classifier": classifier} if me == 0 else {})
    save(args.out, held, losses, me)


if __name__ == "__main__":
    main()
