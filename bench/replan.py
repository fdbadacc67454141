"""Re-planning against a real straggler, in one run: two processes pinned to one core each,
CPU-bound hogs pinned to one process's core (one: that process runs at about half speed), a
deep MLP (float32; or `--model gpt2`: transformers' GPT-2, 8 blocks of 256, 16 sequences of
64 tokens; `--model bert`: transformers' BertForMaskedLM, 4 layers of 256, 15% of 16 x 64
tokens masked; or `--model resnet`: torchvision's ResNet-18 on 128 images of 32x32) trained by
conveyor.Module three ways, in alternating rounds:

- static: the plan made for two equal devices, replan="off";
- re-planned: the same start, replan="auto" (the partitioner measures the straggler and moves
  work off it while training);
- up front: replan="off", planned on a cluster file that gives the slow process's device
  the speed the straggler has (measured in this run: the hog's share of the core).

The straggler's setting: `--slow-process` 0 (the process that profiles and plans) or 1;
`--first-plan` pipelined (two stages, one replica each; the default with a straggler),
data-parallel (one stage, a replica per process) or free (what conveyor plans; the default
without); `--appear-at N`: the hog starts before step N rather than before the
first (a straggler appearing mid-run); `--vanish-at N`: the hog stops before step N (a
straggler going away: the plan should come back once the gain pays for the move); `--hogs N`:
N hogs beside it (about 1/(N+1) of its speed: 9 make a straggler the plan leaves idle, seen
to go away only by its probe).

Prints each contender's mean step (throughput: every evaluation window and move included)
over the whole run (after the warm-up steps, or from the hog's appearance on, to its
going) and over its second half (the steady state, once re-planning has acted), over
rounds (median and spread); the ratios of both (re-planned over static: the aim is 1.3x or
more; re-planned against up front: within 15%);
each switch with its predicted and measured gain, the decision's arithmetic and the
measured cost of moving (seconds per GB of optimizer state and parameters handed over).

    ./run bench replan [--rounds 2] [--steps 400] [--slow-process 1] [--first-plan pipelined]
                       [--appear-at 0] [--vanish-at 0] [--hogs 1]
                       [--model mlp|gpt2|bert|resnet] [--layers 16] [--hidden 512] [--batch 64] [--windows]
    ./run bench replan --scenario none [--rounds 5] [--first-plan pipelined]   (no straggler: what evaluating costs)
    ./run bench replan --device cuda --model gpt2 --steps 400   (both processes on one GPU: the hog slows the
                                                                 straggler's host, which launches its kernels;
                                                                 windows of 2 s at 35 ms steps: 400 steps for a switch)

Needs two cores and UCX; the hog and the processes are killed at the end whatever happens.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from job import run_job

HERE = os.path.abspath(__file__)
WARM_UP = 3  # steps left out of the mean: capture, profiling and planning run in the first


def hogs(n: int, core: int) -> list:
    """`n` hog processes on `core` (kill_all stops them)."""
    return [subprocess.Popen([sys.executable, HERE, "--hog", "--core", str(core)]) for _ in range(n)]


def kill_all(procs: list) -> None:
    for p in procs:
        p.kill()
        p.wait()


def hog(core: int) -> None:
    """A CPU-bound loop on `core` until killed."""
    os.sched_setaffinity(0, {core})
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2147483648


def worker(args) -> None:
    import torch
    import conveyor
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.model == "gpt2":  # transformers' GPT-2, random weights: the loss is the model's own
        import transformers
        config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=1000,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)
        net = transformers.GPT2LMHeadModel(config)
        x = torch.randint(0, 1000, (args.batch, 64), device=args.device)
        step_args, loss_fn = dict(labels=x), None
    elif args.model == "bert":  # transformers' BERT, masked LM: 15% of the tokens masked, the rest ignored (-100)
        import transformers
        config = transformers.BertConfig(vocab_size=8000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                         num_attention_heads=4, intermediate_size=4 * args.hidden,
                                         max_position_embeddings=64)
        net = transformers.BertForMaskedLM(config)
        tokens = torch.randint(5, 8000, (args.batch, 64), device=args.device)
        masked = torch.rand(args.batch, 64, device=args.device) < 0.15
        x = tokens.masked_fill(masked, 4)
        step_args, loss_fn = dict(labels=tokens.masked_fill(~masked, -100)), None
    elif args.model == "resnet":  # torchvision's ResNet-18 (its BatchNorm's statistics are per replica and microbatch)
        import torchvision
        net = torchvision.models.resnet18(num_classes=10)
        x = torch.randn(args.batch, 3, args.hidden, args.hidden, device=args.device)
        step_args, loss_fn = dict(target=torch.randint(0, 10, (args.batch,), device=args.device)), torch.nn.CrossEntropyLoss()
    else:
        layers = [m for _ in range(args.layers) for m in (torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh())]
        net = torch.nn.Sequential(*layers)
        x, y = torch.randn(args.batch, args.hidden, device=args.device), torch.randn(args.batch, args.hidden,
                                                                                   device=args.device)
        step_args, loss_fn = dict(target=y), torch.nn.MSELoss()
    if args.windows:  # every window's decision on process 0's stderr, at DEBUG (replanning_trace.window_line)
        import logging
        logging.getLogger("conveyor").setLevel(logging.DEBUG)
    net.to(args.device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    cluster = None
    if args.mode == "upfront":
        # The cluster conveyor.Module describes for two processes on this machine, but for
        # the slow process's speed: two one-device nodes joined by the same link.
        speeds = [1.0, 1.0]
        speeds[args.slow_process] = args.straggler_speed
        cluster = ('name = "straggler"\n'
                   + "".join(f'[[node]]\ndevices = 1\nmemory = "8 GiB"\nspeed = {v}\n' for v in speeds) +
                   '[link.intra_node]\nbandwidth = "10 GB/s"\nlatency = "5 us"\n'
                   '[link.inter_node]\nbandwidth = "10 GB/s"\nlatency = "5 us"\n')
    # The first plan asked, whose fixed parts a re-plan keeps (pipelined: one replica per
    # stage, the cuts free; data-parallel: one stage, a replica per process, the shares free);
    # "free": whatever conveyor plans (data parallel, here).
    layout = {"pipelined": dict(replicas=1), "data-parallel": dict(stages=1, replicas=2), "free": {}}[args.first_plan]
    model = conveyor.Module(net, opt, loss_fn=loss_fn, cluster=cluster, **layout,
                            replan="auto" if args.mode == "replanned" else "off")
    times, hogging = [], []
    hog_here = rank == args.slow_process and args.scenario == "straggler" and (args.appear_at or args.vanish_at)
    try:
        for step in range(args.steps):
            if hog_here and step == args.appear_at:
                hogging = hogs(args.hogs, rank)
            if hogging and step == args.vanish_at:
                kill_all(hogging)
                hogging = []
            t0 = time.perf_counter()
            model.train_step(x, **step_args)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        kill_all(hogging)
    if rank == 0:
        start, end = max(WARM_UP, args.appear_at), args.vanish_at or args.steps
        mean = statistics.fmean(times[start:end])  # every window and move
        steady = statistics.fmean(times[(start + end) // 2:end])
        after = statistics.fmean(times[args.vanish_at:]) if args.vanish_at else None  # the straggler gone
        report = model.profile_report()
        print("RESULT " + json.dumps({"steady_s": steady, "mean_s": mean, "after_s": after, "replans": model.replans,
                                      "times_s": times, "replan_cost": report.replan_cost, "plan": model.plan.table,
                                      "report": str(report)}), flush=True)


def run_contender(mode: str, args, straggler_speed: float) -> dict:
    cmd = [sys.executable, HERE, "--worker", "--mode", mode, "--scenario", args.scenario, "--steps", args.steps,
           "--slow-process", args.slow_process, "--first-plan", args.first_plan, "--appear-at", args.appear_at,
           "--vanish-at", args.vanish_at, "--hogs", args.hogs,
           "--layers", args.layers, "--model", args.model, "--device", args.device,
           "--hidden", args.hidden, "--batch", args.batch, "--straggler-speed", f"{straggler_speed:.3f}"]
    if args.windows and mode == "replanned":
        cmd.append("--windows")
    outs = run_job(cmd, 600, mode, OMP_NUM_THREADS="1", CONVEYOR_TIMEOUT="120")
    line = next(l for l in outs[0].splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    if args.windows and mode == "replanned":
        print("\n".join("  " + l for l in outs[0].splitlines() if l.startswith("conveyor: re-planning:")), flush=True)
    return result


def straggler_share(core: int, n: int) -> float:
    """The share of `core` a busy process gets beside `n` hogs: its CPU time over the wall
    time of a busy loop there, after a second of it unmeasured. (Timing short loops beside
    them read 0.75-0.97: a process that has just slept is let run ahead of the hogs for a
    while, and the first loops ran at nearly full speed; a training process that computes
    without a pause gets about 1/(n+1).)"""
    def busy_share(seconds: float) -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        x = 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(10_000):
                x += 1
        return (time.process_time() - c0) / (time.perf_counter() - t0)
    os.sched_setaffinity(0, {core})
    try:
        h = hogs(n, core)
        try:
            busy_share(1.0)
            return busy_share(2.0)
        finally:
            kill_all(h)
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def evaluation_cost(args) -> None:
    """No straggler: replan="off" and "auto" in alternating rounds, the mean step after
    warm-up (the evaluation windows' steps included), median over rounds with the spread."""
    modes = ["static", "replanned"]
    mean = {m: [] for m in modes}
    accounted = []  # per round: process 0's training-thread time at boundaries and planner CPU, of the steps' time
    for r in range(args.rounds):
        for mode in modes:
            result = run_contender(mode, args, 1.0)
            mean[mode].append(result["mean_s"])
            print(f"round {r + 1} {mode:10s} mean step {result['mean_s'] * 1e3:8.2f} ms"
                  + (f"; {len(result['replans'])} switches" if mode == "replanned" else ""), flush=True)
            print("  each step (ms): " + " ".join(f"{t * 1e3:.0f}" for t in result["times_s"]), flush=True)
            if mode == "replanned":
                c = result["replan_cost"]
                accounted.append((c["boundary_s"] + c["planner_cpu_s"]) / c["steps_wall_s"])
                print(f"  process 0's own re-planning: {c['boundary_s'] * 1e3:.0f} ms at window boundaries and "
                      f"{c['planner_cpu_s'] * 1e3:.0f} ms of planner CPU over {c['steps']} steps of "
                      f"{c['steps_wall_s']:.1f} s: {accounted[-1] * 100:.2f}%")
                for sw in result["replans"]:
                    measured = sw["measured_gain_s"]
                    print(f"  step {sw['step']}: {sw['old']} -> {sw['new']}; {sw['reason']}; predicted "
                          f"{sw['predicted_gain_s'] * 1e3:.2f} ms saved per step, measured "
                          + ("-" if measured is None else f"{measured * 1e3:.2f}"))
            if r == 0:
                print("  " + result["plan"].strip().replace("\n", "\n  "))
                if mode == "replanned":
                    print("  " + result["report"].strip().replace("\n", "\n  "))
    print(f"\nmean step after {WARM_UP} warm-up steps, median over {args.rounds} rounds (min - max):")
    for m in modes:
        print(f"  {m:10s} {statistics.median(mean[m]) * 1e3:8.2f} ms ({min(mean[m]) * 1e3:.2f} - {max(mean[m]) * 1e3:.2f})")
    cost = statistics.median(mean["replanned"]) / statistics.median(mean["static"]) - 1
    ratios = [a / b - 1 for a, b in zip(mean["replanned"], mean["static"])]
    print(f"replan=auto costs {cost * 100:+.1f}% of the mean step against off (per round: "
          + ", ".join(f"{x * 100:+.1f}%" for x in ratios) + "; aim: at most 2%)")
    print(f"what process 0 spent re-planning, of its steps' wall time (the boundaries' waits, figures, probes and "
          f"messages, plus the planner thread's CPU, at worst all taken from the training's core): median "
          f"{statistics.median(accounted) * 100:.2f}% ({min(accounted) * 100:.2f} - {max(accounted) * 100:.2f}%)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="default: 40 (gpt2, steps of 0.5-0.8 s), 400 (mlp, steps of 30-50 ms): re-planning's "
                         "windows after the first are at least 2 s of steps, and a switch takes three")
    ap.add_argument("--model", choices=["mlp", "gpt2", "bert", "resnet"], default="mlp",
                    help="gpt2: transformers' GPT-2 of --layers blocks of --hidden, --batch sequences of 64 tokens; "
                         "bert: transformers' BertForMaskedLM so, 15%% of the tokens masked; "
                         "resnet: torchvision's ResNet-18 on --batch images of --hidden x --hidden, 10 classes")
    ap.add_argument("--layers", type=int, default=None, help="default: 16 (mlp), 8 (gpt2), 4 (bert); resnet: unused")
    ap.add_argument("--hidden", type=int, default=None, help="default: 512 (mlp), 256 (gpt2, bert), 32 (resnet)")
    ap.add_argument("--batch", type=int, default=None, help="default: 64 (mlp), 16 (gpt2, bert), 128 (resnet)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: both processes train on the one GPU (over UCX), the hog slowing the straggler's host, "
                         "which launches its kernels")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--hog", action="store_true")
    ap.add_argument("--core", type=int, default=1, help="the hog's core (internal)")
    ap.add_argument("--slow-process", type=int, choices=[0, 1], default=1,
                    help="the process whose core the hog shares (0: the one that profiles and plans)")
    ap.add_argument("--first-plan", choices=["pipelined", "data-parallel", "free"], default=None,
                    help="default: pipelined with a straggler, free without")
    ap.add_argument("--appear-at", type=int, default=0, help="the step before which the hog starts")
    ap.add_argument("--vanish-at", type=int, default=0, help="the step before which the hog stops (0: never)")
    ap.add_argument("--hogs", type=int, default=1, help="hog processes beside the straggler")
    ap.add_argument("--windows", action="store_true",
                    help="print each re-planned run's window decisions (process 0's, the conveyor logger at DEBUG)")
    ap.add_argument("--mode", default="static")
    ap.add_argument("--straggler-speed", type=float, default=0.5)
    ap.add_argument("--scenario", choices=["straggler", "none"], default="straggler",
                    help="none: no hog, replan=auto against off, the mean step (what evaluating costs)")
    args = ap.parse_args()
    defaults = {"gpt2": dict(layers=8, hidden=256, batch=16, steps=40),
                "bert": dict(layers=4, hidden=256, batch=16, steps=80),
                "resnet": dict(layers=18, hidden=32, batch=128, steps=100),
                "mlp": dict(layers=16, hidden=512, batch=64, steps=400)}[args.model]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.hog:
        hog(args.core)
        return
    if args.worker:
        worker(args)
        return
    if (os.cpu_count() or 1) < 2:
        sys.exit("bench/replan needs two cores (one per process)")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("bench/replan: --device cuda needs a CUDA GPU, and this machine has none visible")
    if args.first_plan is None:
        args.first_plan = "pipelined" if args.scenario == "straggler" else "free"
    if args.scenario == "none":
        evaluation_cost(args)
        return
    if args.vanish_at and not args.appear_at + WARM_UP < args.vanish_at < args.steps:
        sys.exit(f"--vanish-at {args.vanish_at} must come after --appear-at's step and warm-up, before --steps")
    slow = args.slow_process
    speed = straggler_share(slow, args.hogs)
    print(f"straggler: process {slow} shares its core with {args.hogs} hog{'s' if args.hogs > 1 else ''}"
          + (f" from step {args.appear_at}" if args.appear_at else "")
          + (f" until step {args.vanish_at}" if args.vanish_at else "") + f", running at {speed:.2f} of its speed; "
          f"first plan {args.first_plan}")
    modes = ["static", "replanned", "upfront"]
    mean = {m: [] for m in modes}
    after = {m: [] for m in modes}
    steady = {m: [] for m in modes}
    replans = []
    whole_run = not (args.appear_at or args.vanish_at)  # else each slow worker runs its hog
    h = hogs(args.hogs, slow) if whole_run else []
    try:
        for r in range(args.rounds):
            for mode in modes:  # alternating: static, replanned, up front, static, ...
                result = run_contender(mode, args, speed)
                mean[mode].append(result["mean_s"])
                after[mode].append(result["after_s"])
                steady[mode].append(result["steady_s"])
                if mode == "replanned":
                    replans.append(result["replans"])
                print(f"round {r + 1} {mode:10s} mean step {result['mean_s'] * 1e3:8.2f} ms"
                      + (f", after the straggler left {result['after_s'] * 1e3:8.2f} ms" if args.vanish_at else "")
                      + f", over the second half {result['steady_s'] * 1e3:8.2f} ms", flush=True)
                print("  each step (ms): " + " ".join(f"{t * 1e3:.0f}" for t in result["times_s"]), flush=True)
                if r == 0:
                    print("  " + result["plan"].strip().replace("\n", "\n  "))
                    print("  " + result["report"].strip().replace("\n", "\n  "))
    finally:
        kill_all(h)

    def med(m):
        return statistics.median(mean[m])

    def steady_med(m):
        return statistics.median(steady[m])

    start, end = max(WARM_UP, args.appear_at), args.vanish_at or args.steps
    print(f"\nmean step (throughput), median over {args.rounds} rounds (min - max): from step {start} to {end} (the "
          f"whole run), and from step {(start + end) // 2} (its second half, the steady state)")
    for m in modes:
        print(f"  {m:10s} {med(m) * 1e3:8.2f} ms ({min(mean[m]) * 1e3:.2f} - {max(mean[m]) * 1e3:.2f}); "
              f"{steady_med(m) * 1e3:8.2f} ms ({min(steady[m]) * 1e3:.2f} - {max(steady[m]) * 1e3:.2f})")
    print(f"re-planned vs static: {med('static') / med('replanned'):.2f}x the throughput over the whole run, "
          f"{steady_med('static') / steady_med('replanned'):.2f}x in the steady state (aim: at least 1.3x; the "
          f"up-front plan: {med('static') / med('upfront'):.2f}x, {steady_med('static') / steady_med('upfront'):.2f}x)")
    print(f"re-planned vs up front: {med('replanned') / med('upfront'):.2f}x the up-front plan's mean step over the "
          f"whole run, {steady_med('replanned') / steady_med('upfront'):.2f}x in the steady state (aim: within 1.15)")
    if args.vanish_at:
        print(f"\nafter the straggler left (steps {args.vanish_at} to {args.steps}), mean step, median over rounds "
              "(min - max); the plan made for equal devices (static) is now the right one:")
        for m in modes:
            print(f"  {m:10s} {statistics.median(after[m]) * 1e3:8.2f} ms ({min(after[m]) * 1e3:.2f} - "
                  f"{max(after[m]) * 1e3:.2f})")
        ratio = statistics.median(after["replanned"]) / statistics.median(after["static"])
        print(f"re-planned vs static after it left: {ratio:.2f}x the static plan's mean step (the plan comes back: "
              "switch back below)")
    from conveyor.planning.replanning import moved_here  # here: a hog's process imports no torch
    for r, switches in enumerate(replans):
        for s in switches:
            gb = s["received_bytes"] / 1e9
            per_gb = f", {s['transfer_s'] / gb:.2f} s/GB" if gb > 0 else ""
            print(f"round {r + 1} switch at step {s['step']}: {s['old']} -> {s['new']}\n  {s['arithmetic']}\n"
                  f"  measured on process 0: moved in {s['move_s'] * 1e3:.1f} ms ({moved_here(s, True)}{per_gb}, "
                  f"rebuilding {s['rebuild_s'] * 1e3:.1f} ms); measured gain "
                  + (f"{s['measured_gain_s'] * 1e3:.2f} ms/step" if s["measured_gain_s"] is not None else "not measured"))
        if not switches:
            print(f"round {r + 1}: no switch")


if __name__ == "__main__":
    main()
