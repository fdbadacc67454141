"""A pipeline written by hand with 1F1B's schedule: three stages on three processes, four
microbatches; each process runs its microbatches' forwards and backwards interleaved, as
1F1B does (stage s runs 2 - s forwards ahead, then one backward per forward, then the rest),
so a stage holds at most 3 - s microbatches' activations. The communication of each
microbatch is made inside `with dist.microbatch(k):`, and `dist.backward(microbatch=k)`
replays that microbatch's alone; the last stage, whose graph is connected, calls
loss.backward() on each microbatch's loss.

    ./run conveyor launch -n 3 -- python examples/distributed/one_f_one_b.py
    ./run python examples/distributed/one_f_one_b.py        (one process, the whole batch)
"""
import torch
import torch.nn as nn

from common import arguments, regression_batches, save, split, train_alone

WIDTH, BATCH, MICROBATCHES, STAGES = 8, 16, 4, 3


def stages():
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(STAGES - 1)] + [nn.Linear(WIDTH, 1)]


def one_f_one_b(stage: int):
    """This stage's order of work: ("F", k) and ("B", k), 1F1B's."""
    ahead = min(STAGES - 1 - stage, MICROBATCHES)
    order = [("F", k) for k in range(ahead)]
    for k in range(MICROBATCHES - ahead):
        order += [("F", ahead + k), ("B", k)]
    return order + [("B", k) for k in range(MICROBATCHES - ahead, MICROBATCHES)]


def main():
    args = arguments()
    model = stages()
    for m in model:
        m.to(args.device)
    batches = regression_batches(args.device, BATCH, WIDTH)
    named = {f"stage{s}": m for s, m in enumerate(model)}
    losses = []
    if not split():
        whole = nn.Sequential(*model)
        return train_alone(args.out, named, batches, lambda x, y: nn.functional.mse_loss(whole(x), y))

    import conveyor.distributed as dist
    if dist.world_size() != STAGES:
        raise SystemExit(f"this example runs on {STAGES} processes: conveyor launch -n {STAGES}")
    me = dist.rank()
    optimizer = torch.optim.SGD(model[me].parameters(), lr=0.1)
    for x, y in batches:
        optimizer.zero_grad()
        xs, ys = x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)
        held, total = {}, 0.0  # the last stage's microbatch losses, until their backward
        for work, k in one_f_one_b(me):
            if work == "F":
                with dist.microbatch(k):
                    h = model[me](xs[k] if me == 0 else dist.recv(src=me - 1))
                    if me < STAGES - 1:
                        dist.send(h, dst=me + 1)
                    else:  # the batch's mean, as microbatch means weighed by their share
                        held[k] = nn.functional.mse_loss(h, ys[k]) * (len(ys[k]) / BATCH)
            elif me < STAGES - 1:
                dist.backward(microbatch=k)
            else:
                loss = held.pop(k)
                loss.backward()
                total += loss.item()
        optimizer.step()
        if me == STAGES - 1:
            losses.append(total)
    save(args.out, {f"stage{me}": model[me]}, losses, me)


if __name__ == "__main__":
    main()
