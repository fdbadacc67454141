"""Two processes against one process running the same plan, in one run, for two layouts.

GPT-2 (float32, random init), 1F1B over 8 microbatches:
- pipeline: 2 stages of one replica; across processes one rank in each (the activations
  and gradients of every microbatch cross over UCX on loopback);
- data parallel: 1 stage of 2 replicas; across processes one replica in each (every step
  sums the whole model's gradients across the two processes).
The one-process run holds both workers on two threads; across processes each process has
half the machine's cores. Prints the throughputs and the ratio (two processes / one; above
1: faster).

    ./run bench multiproc [--iters 10] [--layers 8] [--hidden 256] [--batch 16] [--seq 64]
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings

import torch

from conveyor import _C

import gpt2_case

warnings.filterwarnings("ignore")


# stages, replicas per rank, and across two processes the process of each rank's replicas
LAYOUTS = {"pipeline": (2, [1, 1], [[0], [1]]), "data parallel": (1, [2], [[0, 1]])}


def time_steps(args, layout, extra) -> float:
    """Median seconds per step (after one warm-up step) of the layout's 1F1B pipeline."""
    _, wrapped, graph, inputs = gpt2_case.captured(args)
    stage_count, replicas, _ = LAYOUTS[layout]
    stages = graph.random_partition(stage_count, seed=0, keep_node_order=True)
    step = _C.PipelineStep(graph.executor, stages, "1f1b", args.microbatches, 1, replicas, **extra)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    times = []
    for k in range(args.iters + 1):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step.run(inputs)
        if k:
            times.append(time.perf_counter() - start)
        optimizer.step()
    return statistics.median(times)


def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = _C.ProcessGroup(rank, world, "127.0.0.1", int(os.environ["MASTER_PORT"]), job="bench-multiproc",
                            timeout_s=300)
    for layout in LAYOUTS:
        t = time_steps(args, layout, dict(processes=group, replica_process=LAYOUTS[layout][2]))
        if rank == 0:
            print(f"RESULT {layout}: {t}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    gpt2_case.add_arguments(ap, hidden=256, seq=64, batch=16)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cores = os.cpu_count() or 2
    one = {layout: time_steps(args, layout, {}) for layout in LAYOUTS}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       UCX_NET_DEVICES="lo", OMP_NUM_THREADS=str(max(1, cores // 2)))
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        sys.exit("a worker failed:\n" + "\n".join(o[-2000:] for o in outputs))
    two = {line[len("RESULT "):].split(":")[0]: float(line.split(":")[1])
           for line in outputs[0].splitlines() if line.startswith("RESULT")}
    samples = args.batch
    print(f"GPT-2 {args.layers} layers x {args.hidden}, batch {args.batch} x {args.seq}, 1F1B, "
          f"{args.microbatches} microbatches, {cores} cores; median of {args.iters} steps")
    for layout in LAYOUTS:
        print(f"{layout}:")
        print(f"  1 process  (2 worker threads):   {one[layout] * 1e3:9.2f} ms/step  {samples / one[layout]:8.1f} samples/s")
        print(f"  2 processes (UCX over loopback): {two[layout] * 1e3:9.2f} ms/step  {samples / two[layout]:8.1f} samples/s")
        print(f"  ratio (2 processes / 1 process throughput): {one[layout] / two[layout]:.3f}x")


if __name__ == "__main__":
    main()
