"""Forward+backward step time: conveyor's C++ executor vs eager PyTorch, same model, same run.

Prints, per model, the median step time of each and the throughput ratio
(eager time / executor time: above 1.0 means the executor is faster). Steps alternate
between the two so machine noise hits both alike.

    ./run bench executor_overhead [--iters 20] [--models bert,resnet18]
"""
import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import conveyor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))  # the test models
import zoo  # noqa: E402

warnings.filterwarnings("ignore")


def make(name):
    torch.manual_seed(0)
    if name == "bert":
        return zoo.bert(batch=8, seq=128, dtype=torch.float32, layers=4, hidden=256, dropout=0.1)
    if name == "resnet18":
        return zoo.resnet18(batch=8, dtype=torch.float32, image=64)
    if name == "gpt2":
        return zoo.gpt2(batch=8, seq=128, dtype=torch.float32, layers=4, hidden=256, dropout=0.1)
    raise SystemExit(f"unknown model {name}")


def timed_step(fn, case, model):
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    loss = case.loss(fn(*case.args, **case.kwargs))
    loss.backward()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", default="bert,resnet18")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, float32, fwd+bwd per step")
    print(f"{'model':<10} {'nodes':>6} {'eager ms':>10} {'conveyor ms':>12} {'throughput ratio':>17}")
    for name in args.models.split(","):
        case = make(name)
        model = case.model
        model.train()
        graph = conveyor.capture(model, case.args, case.kwargs)
        eager, conv = [], []
        for i in range(args.warmup + args.iters):
            e = timed_step(model, case, model)
            c = timed_step(graph, case, model)
            if i >= args.warmup:
                eager.append(e)
                conv.append(c)
        me, mc = statistics.median(eager), statistics.median(conv)
        print(f"{name:<10} {graph.num_nodes:>6} {me * 1e3:>10.2f} {mc * 1e3:>12.2f} {me / mc:>16.3f}x")


if __name__ == "__main__":
    main()
