"""A training script as users write it, for tests/python/test_launch.py: conveyor.Module
with its automatic plan, the same script alone or under `conveyor launch`. Process 0 (or the
single process) writes the losses, the gathered model state and the plan it ran.

    conveyor launch -n 2 -- python launch_worker.py --out result.pt
    python launch_worker.py --plan result.plan.json --out reference.pt
"""
import argparse
import json
import os
import signal

import torch

import conveyor
import zoo


class NeedsFourSamples(torch.nn.Module):
    """Refuses fewer than four samples at once (a Python check on the batch size): capture
    records the bound and every plan must keep each replica's share at four or more."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])

    def forward(self, x, y):
        if x.shape[0] < 4:
            raise ValueError("at least four samples")
        return (self.body(x) - y).pow(2).mean()


class BranchesOnLength(torch.nn.Module):
    """Takes a different path for long sequences (a Python branch on the length): torch.export
    keeps the length symbolic on the captured side of the branch only (11 and more), so the
    other side needs a capture of its own."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.short, self.long = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids):
        h = self.embed(ids)
        h = torch.tanh(self.long(h) if ids.shape[1] > 10 else self.short(h))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def branches(batch=8):
    return zoo.ZooCase("branches", BranchesOnLength().double(), (torch.randint(0, 32, (batch, 12)),), {})


def bounded(batch=8):
    return zoo.ZooCase("bounded", NeedsFourSamples().double(), (torch.randn(batch, 16, dtype=torch.float64),
                                                       torch.randn(batch, 16, dtype=torch.float64)), {})


CASES = dict(zoo.CASES, bounded=bounded, branches=branches)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="gpt2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--stages", type=int, default=None, help="fixed cuts instead of planning")
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=None)
    ap.add_argument("--schedule", default="auto")
    ap.add_argument("--lengths", default=None,
                    help="token models: one step per sequence length (padded batches, attention masks)")
    ap.add_argument("--stop-at-step", type=int, default=-1,
                    help="process 1 stops itself (SIGSTOP: hung, not dead) before that step")
    ap.add_argument("--packed", action="store_true",
                    help="with --lengths: each step packs --microbatches microbatches of those lengths "
                         "(conveyor.Microbatches), of batch / microbatches rows, one more on every other")
    ap.add_argument("--cluster", default=None, help="a cluster file to plan for")
    ap.add_argument("--images", default=None, help="image sizes HxW, one step each (a vision case)")
    ap.add_argument("--momentum", type=float, default=0.0, help="SGD's (its state moves with a switch)")
    ap.add_argument("--evaluate-every", type=int, default=0,
                    help="after every that many steps: model.eval() and a call under no_grad (pipelined, "
                         "forwards only), then model.train()")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    sizes = [tuple(int(x) for x in hw.split("x")) for hw in args.images.split(",")] if args.images else []
    case = CASES[args.case](batch=args.batch, **({"image": sizes[0][0]} if sizes else {}))
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.1, momentum=args.momentum)
    model = conveyor.Module(case.model, optimizer, loss_fn=case.loss, plan=args.plan, stages=args.stages,
                            replicas=args.replicas, microbatches=args.microbatches, schedule=args.schedule,
                            cluster=args.cluster)
    if args.lengths and args.packed:
        draws = torch.Generator().manual_seed(1)
        m, lengths = args.microbatches, [int(n) for n in args.lengths.split(",")]
        batches = [((conveyor.Microbatches([zoo.padded_tokens(args.batch // m + j % 2, n, 96, draws)
                                            for j, n in enumerate(lengths[s:s + m])]),), {})
                   for s in range(0, len(lengths), m)]
    elif sizes:  # random images and labels of each size
        draws = torch.Generator().manual_seed(1)
        dtype = case.args[0].dtype
        batches = [((torch.randn(args.batch, 3, h, w, generator=draws, dtype=dtype),
                     torch.randint(0, 10, (args.batch,), generator=draws)), {}) for h, w in sizes]
    elif args.lengths and args.case == "branches":  # token ids only, of each length
        draws = torch.Generator().manual_seed(1)
        batches = [((torch.randint(0, 32, (args.batch, int(n)), generator=draws),), {})
                   for n in args.lengths.split(",")]
    elif args.lengths:
        draws = torch.Generator().manual_seed(1)
        batches = [((), zoo.padded_tokens(args.batch, int(n), 96, draws)) for n in args.lengths.split(",")]
    else:
        batches = [(case.args, case.kwargs)] * args.steps
    losses, evaluations, held = [], [], []
    for step, (a, k) in enumerate(batches):
        if step == args.stop_at_step and model.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        losses.append(model.train_step(*a, **k).item())
        plan = model.plan  # the training capture's (an evaluation runs the eval mode's)
        if args.evaluate_every and (step + 1) % args.evaluate_every == 0:
            model.eval()
            with torch.no_grad():
                evaluations.append(model(*a, **k).item())
            # What this process holds of the model while it evaluates: its stages' part.
            held.append(sum(p.numel() for p in case.model.parameters()))
            model.train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # every process takes part
    whole = sum(p.numel() for p in case.model.parameters())
    if model.rank != 0:  # what state_dict() gathered here: the whole model as well
        torch.save({"state": state, "held": held, "whole": whole}, f"{args.out}.rank{model.rank}")
    if model.rank == 0:
        torch.save({"losses": losses, "evaluations": evaluations, "held": held, "whole": whole,
                    "state": state, "world": model.world_size,
                    "replans": [r["reason"] for r in model.replans], "captures": model.capture_count}, args.out)
        if plan is not None:  # planned (node lists have no plan)
            with open(args.out + ".plan.json", "w") as f:
                json.dump(plan.document, f)
            print(plan.table if plan.table else plan.document)


if __name__ == "__main__":
    main()
