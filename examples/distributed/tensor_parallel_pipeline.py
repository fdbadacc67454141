"""A pipeline of two stages, each split across two processes (tensor parallel), on four
processes, running 1F1B over two microbatches; each stage's collectives run over its own
processes (conveyor.distributed.new_group), inside each microbatch's communication.

    stage 0, processes 0 and 1: each holds half of a column-parallel layer's outputs and the
        matching half of a row-parallel layer's inputs; reduce_scatter over the stage sums
        the two partial results and leaves each process half of the microbatch, which it
        sends to its partner in stage 1 (process p to process p + 2).
    stage 1, processes 2 and 3: allgather over the stage joins the two halves of the
        microbatch; each holds half of the classifier's outputs, joined with allgather
        again; each process's loss is its half's, and all of them add up to the model's.

Stage 0 runs one microbatch's forward ahead, then backward(microbatch=k) per forward (1F1B);
stage 1, whose graph is connected (its loss reads every collective's output), runs each
microbatch's forward, then its loss's plain loss.backward().

    ./run conveyor launch -n 4 -- python examples/distributed/tensor_parallel_pipeline.py
    ./run python examples/distributed/tensor_parallel_pipeline.py        (one process)
"""
import torch
import torch.nn as nn

from common import STEPS, arguments, save, split

IN, HIDDEN, MID, CLASSES, BATCH, MICROBATCHES = 6, 8, 6, 4, 8, 2


def main():
    args = arguments()
    first = [nn.Linear(IN, HIDDEN // 2) for _ in range(2)]                 # column-parallel, stage 0
    second = [nn.Linear(HIDDEN // 2, MID, bias=False) for _ in range(2)]   # row-parallel, stage 0
    classifier = [nn.Linear(MID, CLASSES // 2) for _ in range(2)]          # column-parallel, stage 1
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, IN, generator=data).to(args.device),
                torch.randint(CLASSES, (BATCH,), generator=data).to(args.device)) for _ in range(STEPS)]
    for m in first + second + classifier:
        m.to(args.device)
    named = {f"{kind}{p}": m[p] for kind, m in [("first", first), ("second", second), ("classifier", classifier)]
             for p in range(2)}
    losses = []
    if not split():
        optimizer = torch.optim.SGD(nn.ModuleList(named.values()).parameters(), lr=0.1)
        for x, labels in batches:
            optimizer.zero_grad()
            partial = [second[p](torch.relu(first[p](x))) for p in range(2)]
            z = torch.tanh(partial[0] + partial[1])
            logits = torch.cat([classifier[p](z) for p in range(2)], dim=1)
            loss = nn.functional.cross_entropy(logits, labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return save(args.out, named, losses)

    import conveyor.distributed as dist
    if dist.world_size() != 4:
        raise SystemExit("this example runs on 4 processes: conveyor launch -n 4")
    me = dist.rank()
    stage = dist.new_group([0, 1] if me < 2 else [2, 3])
    p = stage.rank  # this process's half
    held = {"first": first, "second": second} if me < 2 else {"classifier": classifier}
    held = {f"{kind}{p}": m[p] for kind, m in held.items()}
    optimizer = torch.optim.SGD(nn.ModuleList(held.values()).parameters(), lr=0.1)
    half = slice(p * BATCH // MICROBATCHES // 2, (p + 1) * BATCH // MICROBATCHES // 2)  # of a microbatch
    order = [("F", 0), ("F", 1), ("B", 0), ("B", 1)] if me < 2 else [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for x, labels in batches:
        optimizer.zero_grad()
        xs, targets, pending, total = x.chunk(MICROBATCHES), labels.chunk(MICROBATCHES), {}, 0.0
        for work, k in order:
            if me < 2 and work == "F":
                with dist.microbatch(k):
                    partial = second[p](torch.relu(first[p](xs[k])))
                    mine = dist.reduce_scatter(list(partial.chunk(2)), group=stage)  # the sum, my half
                    dist.send(mine, dst=me + 2)
            elif me < 2:
                dist.backward(microbatch=k)
            elif work == "F":
                z = torch.tanh(torch.cat(dist.allgather(dist.recv(src=me - 2), group=stage)))
                logits = torch.cat(dist.allgather(classifier[p](z), group=stage), dim=1)
                pending[k] = nn.functional.cross_entropy(logits[half], targets[k][half], reduction="sum") / BATCH
            else:
                loss = pending.pop(k)
                loss.backward()
                total += dist.allreduce(loss.detach(), group=stage).item()  # the model's loss, for the record
        optimizer.step()
        if me == 2:
            losses.append(total)
    save(args.out, held, losses, me)


if __name__ == "__main__":
    main()
