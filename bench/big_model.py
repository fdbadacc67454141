"""A model no single process here could hold, trained across processes: a GPT-2 built on the
meta device in every process (float32, AdamW), captured without real tensors, profiled unit
by unit on process 0, each process making and initializing only what its stages read.

Prints, per process: its peak resident memory (VmHWM), what it holds at the end (parameters,
gradients and optimizer state of its stages) and the ratio of the two; the first call's time
(capture, profile, plan, build and the first step) and the steps after; the profiler's units,
how many it measured (the others are alike: measured once) and its peak memory; the losses.
The baseline is the model's whole training state, which one process would have to hold.

`--profile-only --device cuda`: one process profiles a model whose parameters alone exceed the
GPU's memory, unit by unit on it (the first thing a job does, on process 0, before any stage
is made), and prints the profile's peak device memory against the parameters' bytes.

    ./run bench big_model                      # 1.02B parameters on 4 processes (16.3 GB of training state)
    ./run bench big_model --layers 2 --hidden 256 --processes 2 --limit-mb 0.6   # small
    python3 bench/big_model.py --profile-only --device cuda --layers 52 --hidden 8192   # 42B: 156 GiB of parameters
`--limit-mb F`: each process's data segment (RLIMIT_DATA) may grow by at most F times the
whole model's training state beyond what it held once torch was imported.
"""
import argparse
import json
import os
import resource
import tempfile
import time
import warnings

from job import launch_workers, process_status

warnings.filterwarnings("ignore")


def config(args):
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                                   vocab_size=args.vocab, n_positions=args.seq, use_cache=False,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def worker(args) -> None:
    import torch
    import transformers
    import conveyor
    from conveyor.materialize import is_placeholder

    baseline = process_status("VmRSS:")  # torch, transformers and conveyor imported, nothing built
    torch.manual_seed(0)
    with torch.device("cpu" if args.eager else "meta"):
        model = transformers.GPT2LMHeadModel(config(args))
    params = sum(p.numel() for p in model.parameters())
    whole_state = params * 4 * 4  # float32 parameters, gradients and AdamW's two moments
    if args.limit_mb:
        limit = process_status("VmData:") + int(args.limit_mb * whole_state)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    piped = conveyor.Module(model, optimizer, microbatches=args.microbatches)
    # One batch, trained on again each step: the loss must fall.
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))] * \
        args.steps
    losses, times = [], []
    for x in batches:
        t0 = time.perf_counter()
        losses.append(piped.train_step(input_ids=x, labels=x).item())
        times.append(time.perf_counter() - t0)
    held = 0
    for p in model.parameters():
        if p.numel() > 0 and not is_placeholder(p):
            held += p.numel() * p.element_size()
            held += p.grad.numel() * p.grad.element_size() if p.grad is not None else 0
            held += sum(v.numel() * v.element_size() for v in optimizer.state.get(p, {}).values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)
    # What the stages hold (parameters, buffers, optimizer state) plus the most the last
    # step's compute held at once (activations, gradients, working memory), as torch's
    # allocator counted them: the "what its stages hold plus its activations".
    report = piped.profile_report()
    devices = report.memory
    stages_and_step = sum(d["held_bytes"] + d["step_peak_bytes"] for d in devices)
    maker = piped.capture.plan_maker
    out = dict(rank=piped.rank, params=params, whole_state=whole_state, peak=process_status("VmHWM:"), held=held,
               stages_and_step=stages_and_step, baseline=baseline, predicted_step=report.predicted_step_s,
               measured_step=report.measured_step_s, compute_ratios=[s["compute_ratio"] for s in report.stages if s["compute_ratio"] > 0],  # its own stages
               losses=losses, times=times, profile=maker.last_profile if maker is not None else {},
               stages=len(piped.plan.stage_nodes), replicas=piped.plan.replicas)
    with open(os.path.join(args.out, f"rank{piped.rank}.json"), "w") as f:
        json.dump(out, f)


def profile_only(args) -> None:
    """A meta-built model captured and profiled on `args.device` in this one process: what
    process 0 does first, here for a model larger than the device. Nothing is trained."""
    import torch
    import transformers
    import conveyor
    from conveyor.materialize import adopt_meta_model, exported_on_meta, restore_placeholders

    device = torch.device(args.device)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config(args))
    params = sum(p.numel() for p in model.parameters())
    gib = 1 << 30
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    print(f"GPT-2 built on the meta device: {params / 1e9:.2f}B parameters ({args.layers} layers, width "
          f"{args.hidden}), {params * 4 / gib:.1f} GiB in float32"
          + (f" on a device of {total / gib:.1f} GiB ({torch.cuda.get_device_name(device)})" if total else ""),
          flush=True)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    t0 = time.perf_counter()
    shapes = adopt_meta_model(model, None)
    on_meta = x.to("meta")
    with exported_on_meta(model, shapes=shapes) as own:  # as conveyor.Module captures a meta-built model
        graph = conveyor.capture(model, (on_meta,), dict(labels=on_meta), meta_runs_on=device)
    graph.rebind({name: own.get(id(t), t) for name, t in graph.tensors.items()})
    restore_placeholders(graph.tensors.values(), shapes)
    captured = time.perf_counter() - t0
    prof = conveyor.profile(graph, (x,), dict(labels=x), cache=False)
    took = time.perf_counter() - t0 - captured
    peak = prof["peak_device_bytes"] if device.type == "cuda" else prof["peak_rss_bytes"]
    nodes = prof["nodes"]
    print(f"captured in {captured:.1f} s; profiled in {took:.1f} s: {prof['units']} units, {prof['units_measured']} "
          f"measured (the rest alike); forward {sum(n['forward_s'] for n in nodes) * 1e3:.1f} ms and backward "
          f"{sum(n['backward_s'] for n in nodes) * 1e3:.1f} ms for a microbatch of {args.batch} x {args.seq}")
    print(f"the profile's peak {'device' if device.type == 'cuda' else 'resident'} memory {peak / gib:.2f} GiB against "
          f"the parameters' {params * 4 / gib:.1f} GiB: {peak / (params * 4):.3f}"
          + (f"; {peak / total:.3f} of the device" if total else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--limit-mb", type=float, default=0.0)
    ap.add_argument("--eager", action="store_true", help="build the model eagerly instead (small models: to compare)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-only", action="store_true", help="profile alone, in this process (above)")
    ap.add_argument("--device", default="cpu", help="with --profile-only: where to profile (cuda)")
    args = ap.parse_args()
    if args.profile_only:
        profile_only(args)
        return
    if args.worker:
        worker(args)
        return
    out = args.out or tempfile.mkdtemp(prefix="big_model.")
    # Each process's outbound UCX region (1 GiB by default, resident once touched) kept small:
    # what crosses between stages here is a few MiB a microbatch.
    t0 = time.perf_counter()
    launch_workers(__file__, args, out, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.processes)),
                   CONVEYOR_UCX_REGION_MB=os.environ.get("CONVEYOR_UCX_REGION_MB", "128"))
    wall = time.perf_counter() - t0
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.processes)]
    first = ranks[0]
    gib = 1 << 30
    print(f"GPT-2 {'built eagerly' if args.eager else 'built on the meta device'}, {first['params'] / 1e9:.3f}B parameters ({args.layers} layers, width {args.hidden}), float32, "
          f"AdamW: the whole training state is {first['whole_state'] / gib:.2f} GiB")
    print(f"plan: {first['stages']} stages, replicas {first['replicas']}, on {args.processes} processes; job "
          f"wall time {wall:.0f} s")
    prof = first["profile"]
    if prof:
        peak = prof.get("peak_rss_bytes")
        print(f"profile (process 0): {prof['units']} units, {prof['units_measured']} measured (the rest alike); "
              f"peak resident memory then {peak / gib:.2f} GiB" if peak else "")
    print(f"first call (capture, profile, plan, build, first step): {first['times'][0]:.1f} s; steps after: "
          + ", ".join(f"{t:.1f} s" for t in first["times"][1:]))
    print(f"step: predicted {first['predicted_step']:.2f} s, measured {first['measured_step']:.2f} s (ratio "
          f"{first['measured_step'] / max(first['predicted_step'], 1e-12):.2f}); measured over predicted compute of "
          "process 0's stages: " + ", ".join(f"{x:.2f}" for x in first["compute_ratios"]))
    print("losses: " + ", ".join(f"{x:.4f}" for x in first["losses"]))
    print("holds: parameters, gradients and AdamW state of its stages at the end; stages + step: what its stages\n"
          "hold plus the most its last step held at once (activations, gradients, working memory), as torch's\n"
          "allocator counted them; base: resident once torch, transformers and conveyor were imported")
    print("process  peak (VmHWM)     holds  stages + step      base  peak / holds  peak / (stages + step)")
    for r in ranks:
        print(f"{r['rank']:7d}  {r['peak'] / gib:8.2f} GiB  {r['held'] / gib:4.2f} GiB  {r['stages_and_step'] / gib:8.2f} GiB"
              f"  {r['baseline'] / gib:4.2f} GiB  {r['peak'] / max(r['held'], 1):12.2f}"
              f"  {r['peak'] / max(r['stages_and_step'], 1):22.2f}")
    largest = max(r["peak"] for r in ranks)
    print(f"largest peak {largest / gib:.2f} GiB against the whole training state {first['whole_state'] / gib:.2f} GiB: "
          f"{largest / first['whole_state']:.2f}")


if __name__ == "__main__":
    main()
