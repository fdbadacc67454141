"""A V-shaped pipeline written by hand: four stages on two processes, process 0 holding the
first and the last (stages 0 and 3), process 1 the middle two, as zero-bubble V schedules
place them; four microbatches. Process 0 runs microbatch k's first stage two ahead of its
last, and process 1 one forward ahead of its backwards (1F1B):

    process 0:  F0(0) F0(1) | F3B3B0(0) F0(2) | F3B3B0(1) F0(3) | F3B3B0(2) | F3B3B0(3)
    process 1:  F(0) F(1) B(0) F(2) B(1) F(3) B(2) B(3)

Each microbatch's communication is made inside `with dist.microbatch(k):` and replayed by
`dist.backward(..., microbatch=k)` alone. A backward of everything sent so far would wait
for microbatch k + 1's gradient, which needs the forward this process runs next: a deadlock.

    ./run conveyor launch -n 2 -- python examples/distributed/v_schedule.py
    ./run python examples/distributed/v_schedule.py        (one process, the whole batch)
"""
import torch
import torch.nn as nn

from common import arguments, regression_batches, save, split, train_alone

WIDTH, BATCH, MICROBATCHES = 8, 16, 4


def main():
    args = arguments()
    model = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)] + [nn.Linear(WIDTH, 1)]
    for m in model:
        m.to(args.device)
    batches = regression_batches(args.device, BATCH, WIDTH)
    losses = []
    if not split():
        whole = nn.Sequential(*model)
        return train_alone(args.out, {f"stage{s}": m for s, m in enumerate(model)}, batches,
                           lambda x, y: nn.functional.mse_loss(whole(x), y))

    import conveyor.distributed as dist
    if dist.world_size() != 2:
        raise SystemExit("this example runs on 2 processes: conveyor launch -n 2")
    me = dist.rank()
    mine = {f"stage{s}": model[s] for s in ([0, 3] if me == 0 else [1, 2])}
    optimizer = torch.optim.SGD(nn.ModuleList(mine.values()).parameters(), lr=0.1)
    for x, y in batches:
        optimizer.zero_grad()
        xs, ys = x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)
        total = 0.0
        if me == 0:
            def first(k):
                with dist.microbatch(k):
                    dist.send(model[0](xs[k]), dst=1)

            first(0)
            first(1)
            for k in range(MICROBATCHES):
                with dist.microbatch(k):  # the batch's mean, as microbatch means weighed by their share
                    loss = nn.functional.mse_loss(model[3](dist.recv(src=1)), ys[k]) * (len(ys[k]) / BATCH)
                dist.backward(loss, microbatch=k)  # stage 3's backward, then stage 0's
                total += loss.item()
                if k + 2 < MICROBATCHES:
                    first(k + 2)
            losses.append(total)
        else:
            def forward(k):
                with dist.microbatch(k):
                    dist.send(model[2](model[1](dist.recv(src=0))), dst=0)

            forward(0)
            for k in range(MICROBATCHES):
                if k + 1 < MICROBATCHES:
                    forward(k + 1)
                dist.backward(microbatch=k)
        optimizer.step()
    save(args.out, mine, losses, me)


if __name__ == "__main__":
    main()
