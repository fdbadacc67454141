"""A training script that saves and resumes, for tests/python/test_checkpoint.py: steps
`--first` to `--first + --steps - 1` of one fixed batch stream, loading a checkpoint first
and saving one after, on whatever plan `--stages`/`--replicas` give, alone or under
`conveyor launch`. Process 0 writes the losses and the gathered model state.

    conveyor launch -n 2 -- python checkpoint_worker.py --steps 4 --save ck --out a.pt
    conveyor launch -n 3 -- python checkpoint_worker.py --first 4 --steps 4 --load ck --out b.pt
"""
import argparse
import os

import torch

import conveyor


class Deep(torch.nn.Module):
    """Six layers (cuts anywhere), a loss that is a mean over the samples: any split into
    microbatches and replicas gives the whole batch's gradients."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x, y):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return (x - y).pow(2).mean()


def batch(step: int):
    draws = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 16, generator=draws, dtype=torch.float64), \
        torch.randn(12, 16, generator=draws, dtype=torch.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=None)
    ap.add_argument("--load", default=None)
    ap.add_argument("--save", default=None)
    ap.add_argument("--meta", action="store_true", help="build the model on the meta device")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout after every layer")
    ap.add_argument("--die-while-saving", action="store_true",
                    help="process 1 exits once its part is written, before the save completes")
    ap.add_argument("--background", action="store_true",
                    help="save in the background, train 2 more steps meanwhile, then wait for the save")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.device("meta") if args.meta else torch.device("cpu"):
        net = Deep(args.dropout).double()
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        schedule = None
    else:
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model = conveyor.Module(net, optimizer, stages=args.stages, replicas=args.replicas,
                            microbatches=args.microbatches, replan="off", timeout=120)
    if args.load:
        extra = model.load_checkpoint(args.load)
        assert extra.get("next_step", 0) == args.first, extra
        if schedule is not None:
            schedule.load_state_dict(extra["lr_schedule"])
    losses = []
    for step in range(args.first, args.first + args.steps):
        losses.append(model.train_step(*batch(step)).item())
        if schedule is not None:
            schedule.step()
    if args.save:
        if args.die_while_saving and model.rank == 1:
            from conveyor import checkpoint_save
            writes = checkpoint_save.exchange

            def exit_after_writing(group, value, what):  # the fifth exchange follows this process's writes
                exit_after_writing.calls += 1
                if exit_after_writing.calls == 5:
                    os._exit(3)
                return writes(group, value, what)
            exit_after_writing.calls = 0
            checkpoint_save.exchange = exit_after_writing
        extra = {"next_step": args.first + args.steps}
        if schedule is not None:
            extra["lr_schedule"] = schedule.state_dict()
        saving = model.save_checkpoint(args.save, extra=extra, background=args.background)
        if args.background:  # the steps after change the tensors; the checkpoint keeps the call's
            for step in range(args.first + args.steps, args.first + args.steps + 2):
                model.train_step(*batch(step))
            saving.wait()
    if args.meta:  # no process holds it whole: the state as a checkpoint writes it
        model.save_checkpoint(args.out + ".state")
        state = None
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.rank == 0:
        torch.save({"losses": losses, "state": state, "world": model.world_size,
                    "stages": len(model.plan.stage_nodes) if model.plan else 0,
                    "replicas": model.plan.replicas if model.plan else []}, args.out)


if __name__ == "__main__":
    main()
