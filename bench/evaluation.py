"""Pipelined evaluation against eager evaluation of the same model, in one run.

GPT-2 (float32, random init, no dropout) in eval mode under torch.no_grad():
- eager: the whole model on the calling thread (what evaluation cost before it was
  pipelined, and what a user without conveyor runs);
- conveyor: conveyor.Module's eval-mode capture, its forwards alone through the plan's
  stages (`--stages`, `--microbatches` fixed; each stage on its own thread, the machine's
  cores shared out);
and, for scale, conveyor's training step (forwards and backwards) on the same batch.
The contenders alternate in rounds (eager, conveyor, step, eager, ...: this machine is
noisy); prints each one's median over the rounds (of each round's median call) with the
spread, and the ratio eager / conveyor (above 1: conveyor's evaluation is faster). On a GPU
machine `--device cuda` runs both on the GPU (conveyor's stages each on their own streams).

    ./run bench evaluation [--rounds 5] [--iters 10] [--layers 8] [--hidden 256] [--batch 16] [--seq 64]
                           [--stages 2] [--microbatches 8] [--device cpu|cuda]
"""
import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import conveyor

import gpt2_case
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))  # the test models
import zoo  # noqa: E402

warnings.filterwarnings("ignore")


def median_call(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    gpt2_case.add_arguments(ap, hidden=256, seq=64, batch=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    case = zoo.gpt2(batch=args.batch, seq=args.seq, dtype=torch.float32, layers=args.layers, hidden=args.hidden,
                    vocab=512, dropout=0.0)
    case.model.to(args.device)
    case.kwargs = {k: v.to(args.device) for k, v in case.kwargs.items()}
    eager = copy.deepcopy(case.model).eval()
    done = (lambda: torch.cuda.synchronize(args.device)) if args.device != "cpu" else (lambda: None)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.0), stages=args.stages,
                            microbatches=args.microbatches, replan="off")

    def evaluate_eager():
        with torch.no_grad():
            loss = case.loss(eager(*case.args, **case.kwargs))
        done()  # conveyor's calls return after the device finished; eager's must wait too
        return loss

    def evaluate_conveyor():
        model.eval()
        with torch.no_grad():
            return model(*case.args, **case.kwargs)

    def train_step():
        model.train()
        return model.train_step(*case.args, **case.kwargs)

    train_step()  # both captures built and warm before timing
    plan = model.plan.document  # the training capture's
    got, want = evaluate_conveyor().item(), evaluate_eager().item()
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq} tokens on {args.device}; "
          f"conveyor: {args.stages} stages, {args.microbatches} microbatches, {torch.get_num_threads()} threads; "
          f"the training plan: {plan['schedule']}, replicas {[s['replicas'] for s in plan['stages']]}, "
          f"recompute {[s.get('recompute', 'none') for s in plan['stages']]}, "
          f"predicted step {plan['predicted_step_s'] * 1e3:.1f} ms")
    print(f"loss: conveyor {got:.6f}, eager {want:.6f} (relative difference {abs(got - want) / abs(want):.1e})")
    contenders = {"eager evaluation": evaluate_eager, "conveyor evaluation": evaluate_conveyor,
                  "conveyor training step": train_step}
    rounds = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            fn()  # the mode switch (a capture change) out of the timing
            rounds[name].append(median_call(fn, args.iters))
    for name, times in rounds.items():
        print(f"{name:24s} median {statistics.median(times) * 1e3:8.2f} ms  "
              f"(rounds {min(times) * 1e3:.2f} - {max(times) * 1e3:.2f})")
    eager_ms = statistics.median(rounds["eager evaluation"])
    conv_ms = statistics.median(rounds["conveyor evaluation"])
    step_ms = statistics.median(rounds["conveyor training step"])
    print(f"eager / conveyor evaluation: {eager_ms / conv_ms:.3f}x; conveyor evaluation / its training step: "
          f"{conv_ms / step_ms:.3f}")


if __name__ == "__main__":
    main()
