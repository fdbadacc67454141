"""One process of a multi-process pipeline test (tests/python/test_multiproc.py), or the
single-process reference run of the same plan when WORLD_SIZE is unset.

Trains a zoo model for a few SGD steps with fixed stages; the pipeline's ranks are spread
over the processes in contiguous blocks (each rank's replicas with it), or with
--placement replicas replica-major: replica 0 of every rank first, then replica 1, ... so a
rank's replicas land on different processes (data parallelism across processes). Process 0 (or the single process) writes the
losses and the full model state (gathered from every process) to --out.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python multiproc_worker.py --case mlp --stages 2 --out result.pt
"""
import argparse
import faulthandler
import json
import os
import signal
import time

import torch

import conveyor
import zoo
from conveyor import _C
from conveyor.loss_wrapper import loss_wrapper


def on_device(case, device: str):
    """The zoo case with its model and inputs on `device`."""
    if device == "cpu":
        return case
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    case.model.to(device)
    case.args = tuple(move(a) for a in case.args)
    case.kwargs = {k: move(v) for k, v in case.kwargs.items()}
    return case


def placement(replicas: list, world: int, how: str) -> list:
    """Per rank, per replica: its process. blocks: rank r's replicas on process r * world // ranks;
    replicas: the workers replica-major (replica 0 of every rank, then replica 1, ...), spread
    evenly over the processes."""
    ranks = len(replicas)
    if how == "blocks":
        return [[r * world // ranks] * replicas[r] for r in range(ranks)]
    order = [(r, i) for i in range(max(replicas)) for r in range(ranks) if i < replicas[r]]
    out = [[0] * replicas[r] for r in range(ranks)]
    for w, (r, i) in enumerate(order):
        out[r][i] = w * world // len(order)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="mlp")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--replicas", default="1", help="replicas per rank: one count for every rank, or one per rank (2,1)")
    ap.add_argument("--placement", default="blocks", choices=["blocks", "replicas"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-at-step", type=int, default=-1, help="this process kills itself during that step")
    ap.add_argument("--end-after", type=int, default=-1,
                    help="this process's script ends after that many steps, while the others go on")
    ap.add_argument("--signal", default="KILL", choices=["KILL", "STOP", "INT"],
                    help="what --die-at-step sends: SIGKILL, SIGSTOP (a hung process) or SIGINT (Ctrl-C)")
    ap.add_argument("--signal-delay", type=float, default=0.0, help="seconds after half the step that it comes")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--job", default="", help="the job fingerprint announced (default: the case's name)")
    ap.add_argument("--version", default="", help="the conveyor version announced (default: this build's)")
    ap.add_argument("--dropout", type=float, default=None, help="the zoo case's dropout probability (transformers)")
    ap.add_argument("--trace", default="", help="writes the last step's trace to TRACE.rankN.pftrace")
    ap.add_argument("--device", default="cpu", help="where the model and its inputs live (cuda: every process on its GPU)")
    ap.add_argument("--transport", default="ucx", choices=["ucx", "nccl"], help="how pipeline messages cross processes")
    ap.add_argument("--gpu-per-process", action="store_true", help="cuda: process r on GPU r (NCCL needs one each)")
    args = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that finds it hung asks where
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started with SIGINT ignored
    if args.device == "cuda" and args.gpu_per_process:
        args.device = f"cuda:{int(os.environ.get('RANK', '0')) % torch.cuda.device_count()}"
    if args.device.startswith("cuda"):
        # cuDNN's BatchNorm backward sums with atomics unless asked not to: resnet18's bn1.bias
        # differed by 1.7e-12 between two runs of the same plan on an H100.
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.use_deterministic_algorithms(True, warn_only=True)

    case_options = {} if args.dropout is None else {"dropout": args.dropout}
    torch.manual_seed(0)
    case = on_device(zoo.CASES[args.case](batch=args.batch, **case_options), args.device)
    model = loss_wrapper(case.model, case.loss, case.args, case.kwargs)
    graph = conveyor.capture(model, case.args, case.kwargs)
    # Capture ran the model once: start again from the seed so every process (and the
    # reference) holds the same initial state regardless of what capture did.
    torch.manual_seed(0)
    case = on_device(zoo.CASES[args.case](batch=args.batch, **case_options), args.device)
    model.model.load_state_dict(case.model.state_dict())
    inputs = graph.flatten_inputs(case.args, case.kwargs)
    stages = graph.random_partition(args.stages, seed=0, keep_node_order=True)
    ranks = args.stages // args.chunks
    counts = [int(c) for c in args.replicas.split(",")]
    replicas = counts * ranks if len(counts) == 1 else counts
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {}
    if world > 1:
        rank = int(os.environ["RANK"])
        group = _C.ProcessGroup(rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                int(os.environ["MASTER_PORT"]), job=args.job or args.case, timeout_s=args.timeout,
                                version=args.version)
        extra = dict(processes=group, replica_process=placement(replicas, world, args.placement),
                     step_timeout_s=args.timeout, transport=args.transport)
    else:
        rank = 0
    total = sum(p.numel() for p in model.parameters())
    step = _C.PipelineStep(graph.executor, stages, args.schedule, args.microbatches, args.chunks,
                           replicas, **extra)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    step_s = 0.0
    for k in range(args.steps):
        if k == args.end_after:
            return
        if k == args.die_at_step:
            # Dies in the middle of the step: a thread signals the process half a step in.
            import threading
            sig = getattr(signal, "SIG" + args.signal)
            threading.Timer(step_s / 2 + args.signal_delay, lambda: os.kill(os.getpid(), sig)).start()
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss, _, _ = step.run(inputs)
        step_s = time.perf_counter() - start
        losses.append(loss.item())
        optimizer.step()
    if args.trace:
        step.write_trace(f"{args.trace}.rank{rank}.pftrace")
        print("PROFILE", json.dumps(step.profile_report()), flush=True)
        spans = [(s["stream"], s["stage"], s["replica"], s["start_s"], s["end_s"]) for s in step.spans()]
        print("SPANS", json.dumps(spans), flush=True)
    if world > 1:
        # While it trains, a process holds only what its stages read.
        held = sum(p.numel() for p in model.parameters())
        print(f"HELD {held} OF {total}", flush=True)
        for name, b in model.named_buffers():  # what this process holds of each buffer it reads
            if b.numel():
                print(f"BUFFER {name} {b.double().sum().item()!r}", flush=True)
        step.gather_state()
    if rank == 0:
        torch.save({"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   args.out)


if __name__ == "__main__":
    main()
