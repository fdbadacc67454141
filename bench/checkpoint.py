"""Checkpoints against plain file writes of the same bytes, in one run: a job's
save_checkpoint and load_checkpoint (DCP format, each process its own part, checksummed,
renamed into place once complete) against each process writing, then reading back, exactly
the tensors it owns with plain `write`/`readinto` calls and an fsync (the least any
checkpoint must do). The two alternate in rounds; prints medians with their spread, the
ratio of throughputs (above 1: conveyor faster), and each process's peak memory during save
and load beyond what it held before (Linux's VmHWM, reset before each). Then a background
save: how long its call takes (the copy), and a training step while its thread writes
against one without.

    ./run bench checkpoint                          # GPT-2 of 0.2B parameters, 2 processes
    ./run bench checkpoint --layers 19 --hidden 2048 --vocab 32000 --processes 4 --meta --skip-background
                                                    # big_model.py's 1B model
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

from job import launch_workers, process_status

warnings.filterwarnings("ignore")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from what is resident now


def worker(args) -> None:
    import torch
    import transformers
    import conveyor

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                                     vocab_size=args.vocab, n_positions=args.seq, use_cache=False)
    with torch.device("meta") if args.meta else torch.device("cpu"):
        model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())  # before: a process then holds only its stages'
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    piped = conveyor.Module(model, optimizer, stages=args.processes, replicas=1, replan="off")  # each owns a part
    x = torch.randint(0, args.vocab, (4, args.seq), generator=torch.Generator().manual_seed(1))
    piped.train_step(input_ids=x, labels=x)  # the optimizer's state exists, the plan decides the owners
    folder = os.path.join(args.out, "ck")
    piped.save_checkpoint(folder)  # a first save names what each process owns
    mine = _owned(folder, piped.rank, model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in mine)
    plain = os.path.join(args.out, f"plain.{piped.rank}")
    rows = {"save": [], "plain write": [], "load": [], "plain read": [], "background call": [],
            "step while writing": [], "step": []}
    peaks = {"save": 0, "load": 0}
    for _ in range(args.rounds):
        before = process_status("VmRSS:")
        reset_peak()
        t0 = time.perf_counter()
        piped.save_checkpoint(folder)
        rows["save"].append(time.perf_counter() - t0)
        peaks["save"] = max(peaks["save"], process_status("VmHWM:") - before)
        t0 = time.perf_counter()
        with open(plain, "wb") as f:
            for t in mine:
                f.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        rows["plain write"].append(time.perf_counter() - t0)
        before = process_status("VmRSS:")
        reset_peak()
        t0 = time.perf_counter()
        piped.load_checkpoint(folder)
        rows["load"].append(time.perf_counter() - t0)
        peaks["load"] = max(peaks["load"], process_status("VmHWM:") - before)
        t0 = time.perf_counter()
        with open(plain, "rb") as f:
            for t in mine:
                f.readinto(memoryview(t.detach().view(-1).view(torch.uint8).numpy()))
        rows["plain read"].append(time.perf_counter() - t0)
        if args.skip_background:
            continue
        t0 = time.perf_counter()  # in the background: the call copies, a thread writes
        saving = piped.save_checkpoint(folder, background=True)
        rows["background call"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        piped.train_step(input_ids=x, labels=x)
        rows["step while writing"].append(time.perf_counter() - t0)
        saving.wait()
        t0 = time.perf_counter()
        piped.train_step(input_ids=x, labels=x)
        rows["step"].append(time.perf_counter() - t0)
    largest = max(t.numel() * t.element_size() for t in mine)
    with open(os.path.join(args.out, f"rank{piped.rank}.json"), "w") as f:
        json.dump(dict(rank=piped.rank, rows=rows, peaks=peaks, owned=nbytes, largest=largest,
                       params=params), f)


def _owned(folder: str, rank: int, model, optimizer) -> list:
    """The tensors process `rank` wrote to the checkpoint: its file's items in DCP's index
    (`model.<name>`, `optim.<name>.<key>`), found in the model and its optimizer."""
    import torch.distributed.checkpoint as dcp
    metadata = dcp.FileSystemReader(folder).read_metadata()
    params = dict(model.named_parameters())
    state = {**params, **dict(model.named_buffers())}
    out = []
    for item, where in metadata.storage_data.items():
        if where.relative_path != f"__{rank}_0.distcp":
            continue
        key = item.fqn
        if key.startswith("model."):
            out.append(state[key[len("model."):]].detach())
        elif key.startswith("optim."):
            name, _, field = key[len("optim."):].rpartition(".")
            value = optimizer.state[params[name]][field]
            if value.dim() > 0:
                out.append(value)
    return out


def rows_of(job: dict, what: str) -> str:
    return f"{min(job[what]):.2f}-{max(job[what]):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--meta", action="store_true", help="build the model on the meta device")
    ap.add_argument("--skip-background", action="store_true",
                    help="no background save (it holds one more copy of each process's part)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    out = args.out or tempfile.mkdtemp(prefix="checkpoint_bench.")
    launch_workers(__file__, args, out)
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.processes)]
    mib = 1 << 20
    print(f"GPT-2 of {ranks[0]['params'] / 1e9:.3f}B parameters, AdamW, {args.processes} processes, "
          f"{args.rounds} rounds alternating")
    for what, plain in (("save", "plain write"), ("load", "plain read")):
        ours = [max(r["rows"][what][k] for r in ranks) for k in range(args.rounds)]  # the job's: its slowest process
        if what == "save":
            ours_save = ours
        theirs = [max(r["rows"][plain][k] for r in ranks) for k in range(args.rounds)]
        total = sum(r["owned"] for r in ranks)
        mo, mt = statistics.median(ours), statistics.median(theirs)
        print(f"{what:5s}: {mo:.2f} s ({min(ours):.2f}-{max(ours):.2f}), {total / mib / mo:.0f} MiB/s; {plain}: "
              f"{mt:.2f} s ({min(theirs):.2f}-{max(theirs):.2f}), {total / mib / mt:.0f} MiB/s; ratio {mt / mo:.2f}")
    job = {what: [max(r["rows"][what][k] for r in ranks) for k in range(args.rounds)]
           for what in ("background call", "step while writing", "step") if not args.skip_background}
    med = {what: statistics.median(v) for what, v in job.items()}
    if not args.skip_background:
        print(f"background save: the call returns in {med['background call']:.2f} s "
              f"(the copy; {rows_of(job, 'background call')}), "
              f"against {statistics.median(ours_save):.2f} s in the caller's time; the step during the write "
              f"{med['step while writing']:.2f} s ({rows_of(job, 'step while writing')}) against {med['step']:.2f} s "
              f"({rows_of(job, 'step')}) without")
    print("process  owns (MiB)  largest tensor  save peak beyond held  load peak beyond held")
    for r in ranks:
        print(f"{r['rank']:7d}  {r['owned'] / mib:10.1f}  {r['largest'] / mib:14.1f}  {r['peaks']['save'] / mib:21.1f}"
              f"  {r['peaks']['load'] / mib:21.1f}")
    shutil.rmtree(os.path.join(out, "ck"), ignore_errors=True)


if __name__ == "__main__":
    main()
