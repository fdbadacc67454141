"""The in-process pipeline runtime on one CUDA GPU, in one run:

1. A 1-stage conveyor step against eager PyTorch forward+backward of the same model (the
   throughput ratio, eager time / conveyor time). Steps alternate so noise hits both.
2. The GPU as several virtual devices: S stages under 1F1B, every replica on its own
   compute, send and recv streams, against the 1-stage step (throughput ratio), and how many
   streams the device ran at once on average (busy stream-time / wall time, from the events).
3. Two replicas per stage with small gradient buckets: the share of the collective streams'
   reduction time that overlapped compute on the device, read from the events; with --trace,
   the Perfetto trace of that step.

    ./run bench pipeline_gpu [--iters 10] [--layers 8] [--hidden 512] [--batch 32] [--trace run.pftrace]
"""
import argparse
import os
import statistics
import time
import warnings

import torch

from conveyor import _C

import gpt2_case

warnings.filterwarnings("ignore")


def union_length(intervals):
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlap_with(span, intervals):
    """Length of `span` covered by the union of `intervals`."""
    a, b = span
    return union_length([(max(a, x), min(b, y)) for x, y in intervals if min(b, y) > max(a, x)])


def timed_once(call, wrapped):
    """Seconds of one `call()` from empty gradients, the device idle before and after."""
    for p in wrapped.parameters():
        p.grad = None
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def timed_steps(step, inputs, wrapped, args):
    times = [timed_once(lambda: step.run(inputs), wrapped) for _ in range(args.warmup + args.iters)]
    return statistics.median(times[args.warmup:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpt2_case.add_arguments(ap, hidden=512, seq=128, batch=32, warmup=3)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--trace", default="", help="write the replicated step's measured trace here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("pipeline_gpu: no CUDA GPU visible; nothing to measure")
        return
    case, wrapped, graph, inputs = gpt2_case.captured(args, vocab=2048, device="cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, float32; GPT-2 "
          f"{args.layers} layers x {args.hidden}, batch {args.batch} x {args.seq} tokens, {graph.num_nodes} nodes")

    # 1. One stage against eager.
    one = _C.PipelineStep(graph.executor, [list(range(graph.num_nodes))], "1f1b", 1)
    eager, conv = [], []
    for i in range(args.warmup + args.iters):
        e = timed_once(lambda: wrapped(*case.args, **case.kwargs).backward(), wrapped)
        c = timed_once(lambda: one.run(inputs), wrapped)
        if i >= args.warmup:
            eager.append(e)
            conv.append(c)
    me, mc = statistics.median(eager) * 1e3, statistics.median(conv) * 1e3
    print(f"1 stage            eager {me:8.2f} ms   conveyor {mc:8.2f} ms   throughput ratio {me / mc:.3f}x")

    # 2. Virtual devices on the one GPU.
    partition = graph.random_partition(args.stages, seed=0, keep_node_order=True)
    piped = _C.PipelineStep(graph.executor, partition, "1f1b", args.microbatches)
    mp = timed_steps(piped, inputs, wrapped, args) * 1e3
    compute = [(s["start_s"], s["end_s"]) for s in piped.spans() if s["stream"] == "compute"]
    busy = sum(b - a for a, b in compute)
    # The same microbatches on one stage and one stream: what the streams add or cost.
    flat = _C.PipelineStep(graph.executor, [list(range(graph.num_nodes))], "1f1b", args.microbatches)
    mf = timed_steps(flat, inputs, wrapped, args) * 1e3
    print(f"1 stage m={args.microbatches}        step {mf:8.2f} ms")
    print(f"{args.stages} stages 1f1b m={args.microbatches}   step {mp:8.2f} ms   vs 1 stage m={args.microbatches} "
          f"{mf / mp:.3f}x   streams busy at once on average {busy / union_length(compute):.2f}")

    # 3. Replicas: reductions on the collective streams while backward runs.
    stages = max(1, args.stages // 2)
    replicated = _C.PipelineStep(graph.executor, graph.random_partition(stages, seed=0, keep_node_order=True),
                                 "1f1b", args.microbatches // 2, 1, [2] * stages, bucket_bytes=1 << 20)
    mr = timed_steps(replicated, inputs, wrapped, args) * 1e3
    spans = replicated.spans()
    compute = [(s["start_s"], s["end_s"]) for s in spans if s["stream"] == "compute"]
    # Each reduction is listed once per replica; count it once.
    reductions = sorted({(s["stage"], s["start_s"], s["end_s"]) for s in spans if s["stream"] == "collective"})
    total = sum(e - s for _, s, e in reductions)
    covered = sum(overlap_with((s, e), compute) for _, s, e in reductions)
    buckets, early = replicated.last_reduction()
    print(f"{stages} stages x 2 replicas   step {mr:8.2f} ms   {early}/{buckets} buckets reduced during backward; "
          f"reduction time {total * 1e3:.2f} ms on the collective streams, {100 * covered / max(total, 1e-12):.0f}% "
          f"of it overlapping compute")
    if args.trace:
        replicated.write_trace(args.trace)
        print(f"measured trace: {args.trace}")


if __name__ == "__main__":
    main()
