"""conveyor side by side with the peers, in one run: 2 processes on this machine, gloo (the
peers) and UCX (conveyor: shared memory between processes of one host) between them, on the CPU.

The same GPT (token and position embeddings, pre-norm transformer blocks, a final norm and
the vocabulary head; float32, no dropout), the same weights, the same batches, 1F1B over the
same microbatches. Contenders, each a training step with SGD:

  pipelining       torch.distributed.pipelining, Schedule1F1B, split by hand at the middle
                   block, one stage per process
  conveyor split   conveyor.Module with the same split (the captured nodes before the middle
                   block's first operator, and the rest), 1F1B
  by hand          conveyor.distributed: the same split, 1F1B written by hand (send/recv,
                   `with microbatch(k)` and backward(microbatch=k) on process 0, the
                   loss's backward on process 1), as examples/distributed/one_f_one_b.py
  pipelining ZB-V  torch.distributed.pipelining, ScheduleZBVZeroBubble: four stages split by
                   hand at the quarter blocks, process 0 holding the first and the last,
                   process 1 the middle two (not on gloo: see the note it prints)
  conveyor ZB-V    conveyor.Module with the same four stages (node lists), schedule "zb-v"
  conveyor 2 st.   conveyor.Module(stages=2): two stages cut where conveyor's profile balances
                   them, 1F1B (the planner picks nothing else)
  DDP              DistributedDataParallel, each process half of every batch
  conveyor DP      conveyor.Module(stages=1, replicas=2, microbatches=1): one replica per
                   process, each half of every batch, gradients summed across them
  conveyor plan    conveyor.Module with nothing fixed (it plans stages, replicas,
                   microbatches and schedule for the 2 processes), re-planning off

The machine is shared and noisy: the contenders alternate in rounds (each round runs each one
for --steps steps, rank 0 timing them), and the figures are medians over rounds with their
spread. Ratios are throughputs (above 1: conveyor faster).

    ./run bench peers [--rounds 5] [--steps 4] [--layers 8] [--hidden 256] [--seq 64]
                      [--batch 16] [--microbatches 8]
"""
import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from job import free_port, run_job

warnings.filterwarnings("ignore")

VOCAB = 512


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.attn = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Front(torch.nn.Module):
    """Embeddings and the first blocks: stage 0 of the hand split."""

    def __init__(self, hidden: int, seq: int, blocks: int):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, hidden)
        self.pos = torch.nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = torch.nn.Sequential(*[Block(hidden, 4) for _ in range(blocks)])

    def forward(self, tokens):
        return self.blocks(self.tok(tokens) + self.pos)


class Back(torch.nn.Module):
    """The last blocks, the final norm and the head: stage 1 of the hand split."""

    def __init__(self, hidden: int, blocks: int):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(hidden, 4) for _ in range(blocks)])
        self.ln = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, x):
        return self.head(self.ln(self.blocks(x)))


def gpt(args) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(Front(args.hidden, args.seq, args.layers // 2),
                               Back(args.hidden, args.layers - args.layers // 2))


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch_of(args):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


class Part(torch.nn.Module):
    """Some of the GPT's blocks, with the embeddings before them (the first part) or the norm
    and the head after them (the last): one stage of a hand split, sharing the GPT's weights."""

    def __init__(self, model: torch.nn.Sequential, first: int, end: int):
        super().__init__()
        front, back = model[0], model[1]
        blocks = list(front.blocks) + list(back.blocks)
        self.blocks = torch.nn.Sequential(*blocks[first:end])
        self.front = front if first == 0 else None
        self.back = back if end == len(blocks) else None

    def forward(self, x):
        if self.front is not None:
            x = self.front.tok(x) + self.front.pos
        x = self.blocks(x)
        return self.back.head(self.back.ln(x)) if self.back is not None else x


def same_split(module, tokens, target, parts: int = 2) -> list:
    """conveyor's node lists for the hand split into `parts` equal runs of blocks: each part
    starts at the first node that reads a parameter of its first block (the block's first
    norm)."""
    import conveyor
    from conveyor.loss_wrapper import loss_wrapper
    graph = conveyor.capture(loss_wrapper(module, loss_fn, (tokens,), {"target": target}), (tokens,),
                             {"target": target})
    doc = graph.document
    per_half = len(module[0].blocks)
    blocks = per_half + len(module[1].blocks)
    nodes = [n["id"] for n in doc["nodes"]]
    cuts = [0]
    for k in range(1, parts):
        b = k * blocks // parts
        prefix = f"model.0.blocks.{b}." if b < per_half else f"model.1.blocks.{b - per_half}."  # the wrapper's model
        values = {v["value"] for v in doc["bindings"] if v["name"].startswith(prefix)}
        cuts.append(next(i for i, n in enumerate(doc["nodes"]) if any(a.get("value") in values for a in n["args"])))
    cuts.append(len(nodes))
    return [nodes[a:b] for a, b in zip(cuts, cuts[1:])]


def contenders(args, rank: int, tokens, target):
    """name -> (step function, the process's share of the samples it trains)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble
    from torch.nn.parallel import DistributedDataParallel

    import conveyor
    out = {}
    # torch.distributed.pipelining, the hand split.
    part = gpt(args)[rank]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)

    def pipelining():
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=target, losses=[])
        opt.step()
    out["pipelining"] = pipelining

    def module_step(**fixed):
        model = gpt(args)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        wrapped = conveyor.Module(model, opt, loss_fn=loss_fn, replan="off", **fixed)
        return lambda: wrapped.train_step(tokens, target=target), wrapped

    out["by hand"] = one_f_one_b_by_hand(args, rank, tokens, target)
    out["conveyor split"], _ = module_step(stages=same_split(gpt(args), tokens, target), replicas=[1, 1],
                                           microbatches=args.microbatches, schedule="1f1b")
    # ZB-V: four quarters, process 0 the first and the last, process 1 the middle two.
    # pipelining's ZB-V sends between the two stages a process holds through the process
    # group (its first step connects every stage to its neighbours that way), and gloo cannot
    # send to its own rank ("Pair is not connected"): it runs only where the group can (NCCL).
    if dist.get_backend() != "gloo":
        mine_v = (0, 3) if rank == 0 else (1, 2)
        whole = gpt(args)
        parts_v = [Part(whole, k * args.layers // 4, (k + 1) * args.layers // 4) for k in mine_v]
        schedule_v = ScheduleZBVZeroBubble([PipelineStage(p, k, 4, torch.device("cpu")) for p, k in zip(parts_v, mine_v)],
                                           n_microbatches=args.microbatches, loss_fn=loss_fn)
        opt_v = torch.optim.SGD([q for p in parts_v for q in p.parameters()], lr=1e-3)

        def pipelining_v():
            opt_v.zero_grad(set_to_none=True)
            if rank == 0:
                schedule_v.step(tokens, target=target, losses=[])
            else:
                schedule_v.step()
            opt_v.step()
        out["pipelining ZB-V"] = pipelining_v
    out["conveyor ZB-V"], _ = module_step(stages=same_split(gpt(args), tokens, target, 4), replicas=[1, 1],
                                          microbatches=args.microbatches, schedule="zb-v")
    out["conveyor 2 st."], two = module_step(stages=2, replicas=1, microbatches=args.microbatches, schedule="1f1b")
    # DDP: each process half of every batch.
    model = gpt(args)
    ddp = DistributedDataParallel(model)
    ddp_opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    half = args.batch // 2
    mine = slice(rank * half, (rank + 1) * half)

    def data_parallel():
        ddp_opt.zero_grad(set_to_none=True)
        loss_fn(ddp(tokens[mine]), target[mine]).backward()
        ddp_opt.step()
    out["DDP"] = data_parallel
    out["conveyor DP"], _ = module_step(stages=1, replicas=2, microbatches=1, schedule="1f1b")
    out["conveyor plan"], planned = module_step()
    for step in out.values():  # built and warmed up, every process in the same order
        step()
        dist.barrier()
    layouts = {"conveyor 2 st.": two, "conveyor plan": planned}
    return out, layouts


def one_f_one_b_by_hand(args, rank: int, tokens, target):
    """A training step of the hand split with conveyor.distributed, in 1F1B's order written
    out: process 0 runs one forward ahead, then a backward per forward."""
    import conveyor.distributed as cd
    part = gpt(args)[rank]
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)
    m = args.microbatches
    inputs, targets = tokens.chunk(m), target.chunk(m)
    ahead = 1 if rank == 0 else 0
    order = [("F", k) for k in range(ahead)]
    for k in range(m - ahead):
        order += [("F", ahead + k), ("B", k)]
    order += [("B", k) for k in range(m - ahead, m)]

    def step():
        opt.zero_grad(set_to_none=True)
        losses = {}
        for work, k in order:
            if rank == 0 and work == "F":
                with cd.microbatch(k):
                    cd.send(part(inputs[k]), dst=1)
            elif rank == 0:
                cd.backward(microbatch=k)
            elif work == "F":
                losses[k] = loss_fn(part(cd.recv(src=0)), targets[k]) / m
            else:
                losses.pop(k).backward()
        opt.step()
    return step


def worker(args):
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=rank, world_size=2)
    tokens, target = batch_of(args)
    steps, layouts = contenders(args, rank, tokens, target)
    for r in range(args.rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))  # neither side always first
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[name]()
            dist.barrier()
            if rank == 0:
                print(f"RESULT {name}\t{(time.perf_counter() - start) / args.steps}", flush=True)
    if rank == 0:
        for name, module in layouts.items():
            plan = module.plan
            stages = len(plan.stage_nodes)
            print(f"LAYOUT {name}\t{stages} stage{'s' if stages > 1 else ''}, replicas {plan.replicas}, {plan.schedule}, "
                  f"{plan.microbatches} microbatches", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cores = os.cpu_count() or 2
    outputs = run_job([sys.executable, __file__, "--worker", "--gloo-port", free_port(), *sys.argv[1:]], 1800, "peers")
    times: dict[str, list[float]] = {}
    layouts = {}
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            name, t = line[len("RESULT "):].split("\t")
            times.setdefault(name, []).append(float(t))
        elif line.startswith("LAYOUT "):
            name, text = line[len("LAYOUT "):].split("\t")
            layouts[name] = text
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"GPT {args.layers} blocks x {args.hidden}, batch {args.batch} x {args.seq} tokens, vocabulary {VOCAB}, "
          f"float32, SGD; 2 processes on {cores} cores ({max(1, cores // 2)} threads each); median over "
          f"{args.rounds} alternating rounds of {args.steps} steps (min-max)")
    width = max(map(len, med))
    for name, ts in times.items():
        note = f"  [{layouts[name]}]" if name in layouts else ""
        print(f"  {name:<{width}} {med[name] * 1e3:9.2f} ms/step ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})  "
              f"{args.batch / med[name]:8.1f} samples/s{note}")
    best_peer = min((n for n in ("pipelining", "pipelining ZB-V", "DDP") if n in med), key=lambda n: med[n])
    print("ratios (throughput, conveyor / peer; above 1: conveyor faster):")
    for label, ours, theirs in (("same split and schedule vs pipelining", "conveyor split", "pipelining"),
                                ("1F1B by hand (conveyor.distributed) vs pipelining", "by hand", "pipelining"),
                                ("ZB-V, same four stages vs pipelining's ZB-V", "conveyor ZB-V", "pipelining ZB-V"),
                                ("stages=2 (conveyor's cut) vs pipelining's hand split", "conveyor 2 st.", "pipelining"),
                                ("data parallel vs DDP", "conveyor DP", "DDP"),
                                ("conveyor's plan vs pipelining", "conveyor plan", "pipelining"),
                                (f"conveyor's plan vs the best peer ({best_peer})", "conveyor plan", best_peer)):
        if theirs in med:
            print(f"  {label}: {med[theirs] / med[ours]:.3f}x")
    if "pipelining ZB-V" not in med:
        print("  (pipelining's ZB-V cannot run on gloo: it sends between the two stages of one process through the "
              "process group, and gloo cannot send to its own rank; conveyor's ZB-V against pipelining's 1F1B with "
              f"the hand split: {med['pipelining'] / med['conveyor ZB-V']:.3f}x)")


if __name__ == "__main__":
    main()
