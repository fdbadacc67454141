"""Two processes against one process running the same plan, in one run, for two layouts.

GPT-2 (float32, random init), 1F1B over 8 microbatches:
- pipeline: 2 stages of one replica; across processes one rank in each (the activations
  and gradients of every microbatch cross over UCX: shared memory, or loopback tcp with
  CONVEYOR_UCX_SHM=0);
- data parallel: 1 stage of 2 replicas; across processes one replica in each (every step
  sums the whole model's gradients across the two processes).
The one-process run holds both workers on two threads; across processes each process has
half the machine's cores. The two alternate in rounds (one process, then two, `--rounds`
times: this machine is noisy); prints each one's median over the rounds (of each round's
median step) with the spread, and the ratio of the medians (two processes / one; above 1:
faster).

On a GPU machine, `--device cuda`: each process runs on its own GPU where there are two (on
the one GPU otherwise), the one-process run on the first; `--transport nccl` sends the
activations and gradients GPU to GPU over NCCL and sums the data-parallel gradients in an
NCCL group (needs a GPU per process: NCCL refuses two members on one GPU), `ucx` (the
default) through host memory.

    ./run bench multiproc [--rounds 3] [--iters 10] [--layers 8] [--hidden 256] [--batch 16] [--seq 64]
                          [--device cpu|cuda] [--transport ucx|nccl]
"""
import argparse
import os
import statistics
import sys
import time
import warnings

import torch

from conveyor import _C

import gpt2_case
from job import run_job

warnings.filterwarnings("ignore")


# stages, replicas per rank, and across two processes the process of each rank's replicas
LAYOUTS = {"pipeline": (2, [1, 1], [[0], [1]]), "data parallel": (1, [2], [[0, 1]])}


def time_steps(args, layout, extra, device="cpu") -> float:
    """Median seconds per step (after one warm-up step) of the layout's 1F1B pipeline."""
    _, wrapped, graph, inputs = gpt2_case.captured(args, device=device)
    stage_count, replicas, _ = LAYOUTS[layout]
    stages = graph.random_partition(stage_count, seed=0, keep_node_order=True)
    step = _C.PipelineStep(graph.executor, stages, "1f1b", args.microbatches, 1, replicas, **extra)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    times = []
    for k in range(args.iters + 1):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step.run(inputs)
        if device != "cpu":
            torch.cuda.synchronize(device)
        if k:
            times.append(time.perf_counter() - start)
        optimizer.step()
    return statistics.median(times)


def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = _C.ProcessGroup(rank, world, "127.0.0.1", int(os.environ["MASTER_PORT"]), job="bench-multiproc",
                            timeout_s=300)
    device = f"cuda:{rank % torch.cuda.device_count()}" if args.device == "cuda" else "cpu"
    for layout in LAYOUTS:
        t = time_steps(args, layout, dict(processes=group, replica_process=LAYOUTS[layout][2],
                                          transport=args.transport), device)
        if rank == 0:
            print(f"RESULT {layout}: {t}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    gpt2_case.add_arguments(ap, hidden=256, seq=64, batch=16)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--transport", choices=["ucx", "nccl"], default="ucx")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of one process and two")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus == 0:
        sys.exit("multiproc: --device cuda needs a CUDA GPU, and this machine has none visible")
    if args.transport == "nccl" and (args.device != "cuda" or gpus < 2):
        sys.exit(f"multiproc: --transport nccl needs --device cuda and a GPU per process (2); this machine has "
                 f"{gpus} visible, and NCCL refuses two members on one GPU")
    cores = os.cpu_count() or 2
    one, two = {layout: [] for layout in LAYOUTS}, {layout: [] for layout in LAYOUTS}
    for _ in range(max(1, args.rounds)):
        for layout in LAYOUTS:
            one[layout].append(time_steps(args, layout, {}, "cuda:0" if args.device == "cuda" else "cpu"))
        outputs = run_job([sys.executable, __file__, "--worker", *sys.argv[1:]], 900, "multiproc")
        for line in outputs[0].splitlines():
            if line.startswith("RESULT"):
                two[line[len("RESULT "):].split(":")[0]].append(float(line.split(":")[1]))
    samples = args.batch
    where = (f"{cores} cores" if args.device == "cpu" else
             f"{torch.cuda.get_device_name(0)}, {min(gpus, 2)} GPU{'s' if gpus > 1 else ''} for 2 processes")
    tcp = os.environ.get("CONVEYOR_UCX_SHM") == "0" or "UCX_TLS" in os.environ
    over = "NCCL, GPU to GPU" if args.transport == "nccl" else ("UCX over loopback" if tcp else "UCX, shared memory")
    print(f"GPT-2 {args.layers} layers x {args.hidden}, batch {args.batch} x {args.seq}, 1F1B, "
          f"{args.microbatches} microbatches, {where}; {args.rounds} alternating rounds of {args.iters} steps, "
          "median over the rounds (min-max)")
    for layout in LAYOUTS:
        print(f"{layout}:")
        labels = ("1 process (2 workers):", f"2 processes ({over}):")
        width = max(map(len, labels))
        for label, ts in zip(labels, (one[layout], two[layout])):
            t = statistics.median(ts)
            print(f"  {label:<{width}} {t * 1e3:9.2f} ms/step ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})  "
                  f"{samples / t:8.1f} samples/s")
        ratios = [a / b for a, b in zip(one[layout], two[layout])]
        print(f"  ratio (2 processes / 1 process throughput): "
              f"{statistics.median(one[layout]) / statistics.median(two[layout]):.3f}x "
              f"(per round: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
