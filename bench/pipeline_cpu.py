"""The in-process pipeline runtime on this machine's CPU, in one run:

1. A 1-stage conveyor step (capture, C++ executor, runner threads, one microbatch) against
   eager PyTorch forward+backward of the same model: the throughput ratio (eager time /
   conveyor time; the aim is at least 0.95x). Steps alternate so machine noise hits both.
2. For each schedule asked for (default 1F1B and ZB-V): a plan on 4 device groups made by
   the planner from the measured profile, on a cluster that describes this machine
   honestly (4 virtual devices sharing its cores; `--devices`), run for real: the measured step time
   against the simulator's prediction for the same plan (the aim is within 15%). The
   schedules' runs alternate, step by step, so machine noise hits each alike.

    ./run bench pipeline_cpu [--iters 10] [--layers 8] [--hidden 256] [--batch 16]
                             [--schedules 1f1b,zb-v] [--devices 4]
"""
import argparse
import os
import statistics
import time
import warnings

import torch

import conveyor
from conveyor import _C

import gpt2_case

warnings.filterwarnings("ignore")


def median_ms(times):
    return statistics.median(times) * 1e3


def one_stage_vs_eager(args, case, wrapped, graph, inputs):
    step = _C.PipelineStep(graph.executor, [list(range(graph.num_nodes))], "1f1b", 1)
    eager, conv = [], []
    for i in range(args.warmup + args.iters):
        for p in wrapped.parameters():
            p.grad = None
        t = time.perf_counter()
        wrapped(*case.args, **case.kwargs).backward()
        e = time.perf_counter() - t
        for p in wrapped.parameters():
            p.grad = None
        t = time.perf_counter()
        step.run(inputs)
        c = time.perf_counter() - t
        if i >= args.warmup:
            eager.append(e)
            conv.append(c)
    me, mc = median_ms(eager), median_ms(conv)
    print(f"1 stage   eager {me:8.1f} ms   conveyor {mc:8.1f} ms   throughput ratio {me / mc:.3f}x (aim >= 0.95x)")


def planned_vs_simulated(args, case, wrapped, graph, inputs):
    devices, m = args.devices, args.microbatches
    schedules = args.schedules.split(",")
    cores = torch.get_num_threads()
    threads = max(1, cores // devices)
    # A virtual device gets `threads` of the cores; with more devices than cores they share,
    # and each runs at cores / devices of a core's speed when all are busy.
    speed = min(1.0, cores / (devices * threads))
    cluster = (f'name = "this machine"\n[[node]]\ndevices = {devices}\nmemory = "8 GiB"\nspeed = {speed}\n'
               f'[link.intra_node]\nbandwidth = "20 GB/s"\nlatency = "20 us"\n')
    micro = args.batch // m
    small = {k: v[:micro] for k, v in case.kwargs.items()}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # profile at the threads each stage will have
    try:
        prof = conveyor.profile(graph, (), small, cache=False, repeats=5)
    finally:
        torch.set_num_threads(saved)
    plans, steps, times = {}, {}, {}
    for schedule in schedules:
        # Four device groups: one stage each, or two for the schedules that fold the model.
        ranks = dict(ranks=devices, chunks=2) if schedule in ("interleaved", "zb-v") else dict(ranks=devices)
        plan = conveyor.plan(graph, prof, cluster, batch=args.batch, microbatches=m, schedules=[schedule],
                             max_replicas=1, **ranks)
        print(plan)
        plans[schedule] = plan
        chunks = plan.chunks
        steps[schedule] = _C.PipelineStep(graph.executor, plan.stage_nodes, plan.schedule, plan.microbatches,
                                          chunks, plan.replicas[:len(plan.stage_nodes) // chunks], 0, threads,
                                          plan=plan.handle)
        times[schedule] = []
    for i in range(args.warmup + args.iters):
        for schedule in schedules:
            for p in wrapped.parameters():
                p.grad = None
            _, seconds, _ = steps[schedule].run(inputs)
            if i >= args.warmup:
                times[schedule].append(seconds)
    for schedule in schedules:
        plan, step = plans[schedule], steps[schedule]
        measured, predicted = median_ms(times[schedule]), plan.predicted_step_s * 1e3
        spread = f"{min(times[schedule]) * 1e3:.1f}-{max(times[schedule]) * 1e3:.1f}"
        print(f"{len(plan.stage_nodes)} stages {plan.schedule} {plan.microbatches} microbatches, {threads} thread(s) "
              f"per stage: measured {measured:.1f} ms ({spread})   simulated {predicted:.1f} ms   "
              f"measured/simulated {measured / predicted:.3f} (aim within 15%)")
        print(step.profile_report()["table"])
        if args.trace:
            path = args.trace.replace(".", f".{schedule}.", 1) if len(schedules) > 1 else args.trace
            step.write_trace(path)
            print(f"measured trace: {path}")
    if len(schedules) > 1:
        first = median_ms(times[schedules[0]])
        for schedule in schedules[1:]:
            print(f"{schedule} against {schedules[0]}: {first / median_ms(times[schedule]):.3f}x throughput (medians)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpt2_case.add_arguments(ap, hidden=256, seq=128, batch=16, warmup=2)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--trace", default="", help="write the planned runs' measured traces here (one per schedule)")
    ap.add_argument("--devices", type=int, default=4, help="virtual devices (device groups) the plans use")
    ap.add_argument("--schedules", default="1f1b,zb-v", help="schedules to plan, run and compare with the simulator")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    case, wrapped, graph, inputs = gpt2_case.captured(args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, float32; "
          f"GPT-2 {args.layers} layers x {args.hidden}, batch {args.batch} x {args.seq} tokens, "
          f"{graph.num_nodes} nodes")
    one_stage_vs_eager(args, case, wrapped, graph, inputs)
    planned_vs_simulated(args, case, wrapped, graph, inputs)


if __name__ == "__main__":
    main()
