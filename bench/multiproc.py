"""A pipeline across two processes against the same plan in one process, in one run.

GPT-2 (float32, random init) cut into 2 stages, 1F1B over 8 microbatches. The one-process
run holds both ranks on two replica threads; the two-process run puts one rank in each
process (UCX over loopback between them; the activations and gradients of every
microbatch cross), each process with half the machine's cores. Prints both throughputs and
the ratio (two processes / one; above 1: faster).

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


def time_steps(args, extra) -> float:
    """Median seconds per step (after one warm-up step) of the 2-stage 1F1B pipeline."""
    _, wrapped, graph, inputs = gpt2_case.captured(args)
    stages = graph.random_partition(2, seed=0, keep_node_order=True)
    step = _C.PipelineStep(graph.executor, stages, "1f1b", args.microbatches, 1, [1, 1], **extra)
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
    t = time_steps(args, dict(processes=group, rank_process=[0, 1]))
    if rank == 0:
        print(f"RESULT {t}")


def main():
    ap = argparse.ArgumentParser()
    gpt2_case.add_arguments(ap, hidden=256, seq=64, batch=16)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cores = os.cpu_count() or 2
    one = time_steps(args, {})
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
    two = float(next(line.split()[1] for line in outputs[0].splitlines() if line.startswith("RESULT")))
    samples = args.batch
    print(f"GPT-2 {args.layers} layers x {args.hidden}, batch {args.batch} x {args.seq}, 2 stages 1F1B, "
          f"{args.microbatches} microbatches, {cores} cores; median of {args.iters} steps")
    print(f"1 process  (2 replica threads): {one * 1e3:9.2f} ms/step  {samples / one:8.1f} samples/s")
    print(f"2 processes (UCX over loopback): {two * 1e3:9.2f} ms/step  {samples / two:8.1f} samples/s")
    print(f"ratio (2 processes / 1 process throughput): {one / two:.3f}x")


if __name__ == "__main__":
    main()
