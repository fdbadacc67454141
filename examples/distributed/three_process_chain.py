"""Seed 001's figure 4 in a chain of three processes: process 0 sends two tensors to process 1
(figure 4); process 1 sends to process 2 twice with a receive from process 0 between the
sends; process 2 holds the loss. ChainerMN needs delegate variables and pseudo_connect
here; conveyor.distributed.backward() replays each process's communication in reverse.

    ./run conveyor launch -n 3 -- python examples/distributed/three_process_chain.py
    ./run python examples/distributed/three_process_chain.py        (one process)
"""
import torch
import torch.nn as nn

from common import STEPS, arguments, save, split

WIDTH, BATCH = 8, 4


def main():
    args = arguments()
    f0 = nn.Linear(WIDTH, 2 * WIDTH)                                  # process 0
    g1, g2 = nn.Linear(WIDTH, WIDTH), nn.Linear(2 * WIDTH, WIDTH)     # process 1
    h2 = nn.Linear(WIDTH, WIDTH)                                      # process 2
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(BATCH, WIDTH, generator=data).to(args.device) for _ in range(STEPS)]
    named = {"f0": f0, "g1": g1, "g2": g2, "h2": h2}
    for m in named.values():
        m.to(args.device)
    losses = []
    if not split():
        optimizer = torch.optim.SGD(nn.ModuleList(named.values()).parameters(), lr=0.1)
        for x in batches:
            optimizer.zero_grad()
            z1, z2 = f0(x).chunk(2, dim=1)
            c, d = torch.tanh(g1(z1)), g2(torch.cat([z1, z2], dim=1))
            loss = ((h2(c) + d) ** 2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return save(args.out, named, losses)

    import conveyor.distributed as dist
    me = dist.rank()
    held = [{"f0": f0}, {"g1": g1, "g2": g2}, {"h2": h2}][me]
    optimizer = torch.optim.SGD(nn.ModuleList(held.values()).parameters(), lr=0.1)
    for x in batches:
        optimizer.zero_grad()
        if me == 0:
            z1, z2 = f0(x).chunk(2, dim=1)
            dist.send(z1, dst=1)
            dist.send(z2, dst=1)            # figure 4: two sends, no loss on this process
            dist.backward()
        elif me == 1:
            a = dist.recv(src=0)
            dist.send(torch.tanh(g1(a)), dst=2)
            b = dist.recv(src=0)            # a receive between the two sends
            dist.send(g2(torch.cat([a, b], dim=1)), dst=2)
            dist.backward()
        else:
            c, d = dist.recv(src=1), dist.recv(src=1)
            loss = ((h2(c) + d) ** 2).mean()
            dist.backward(loss)
            losses.append(loss.item())
        optimizer.step()
    save(args.out, held, losses, me)


if __name__ == "__main__":
    main()
