"""conveyor demo: wrap a GPT-2 (transformers, random init) with one line,
`conveyor.Module(model, optimizer)`, which captures, profiles and plans it on this machine
(the CPU split into virtual devices); check the first pipelined step against eager PyTorch
accumulating gradients over the same microbatches; train it on a generated corpus and watch
the loss fall, and the loss on held-out text with it (evaluated pipelined: model.eval() and
torch.no_grad(), the forwards alone through the same stages); write a Perfetto trace of a
measured step; print the live profile (measured against predicted, per stage).

    ./run demo [--steps 200] [--devices 4]

The same script runs across processes under the launcher (each process runs its share of
the pipeline; process 0 prints):

    ./run conveyor launch -n 2 -- python examples/demo.py --steps 50
"""
import argparse
import copy
import os
import random
import sys
import time
import warnings

import torch
import transformers

import conveyor

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()

SUBJECTS = ["the pipeline", "a stage", "every replica", "the planner", "one microbatch", "the scheduler"]
VERBS = ["sends", "receives", "computes", "overlaps", "splits", "balances", "measures"]
OBJECTS = ["activations", "gradients", "the loss", "its inputs", "the next batch", "a profile"]
ENDINGS = ["quickly.", "in order.", "on its own stream.", "without waiting.", "exactly."]


def make_corpus(sentences: int, seed: int) -> str:
    """A small synthetic language with real structure (grammar + agreement) to learn."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
                    for _ in range(sentences))


def gpt2(vocab: int, seq: int) -> torch.nn.Module:
    """A GPT-2 of 4 layers and width 128, its embeddings tied, with random weights (nothing is
    downloaded); called with labels, it returns its loss."""
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=4, n_head=4, n_positions=max(128, seq),
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel(config)


def batches(ids: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        yield torch.stack([ids[s:s + seq] for s in starts])


def evaluate(piped, x: torch.Tensor) -> float:
    """The loss on `x` in eval mode under no_grad: pipelined, no backward, nothing gathered."""
    piped.eval()
    with torch.no_grad():
        loss = piped(input_ids=x, labels=x).item()
    piped.train()
    return loss


def say(*args, **kwargs):
    """Prints once per job: in process 0 (the only one when run alone)."""
    found = conveyor.distributed.world()
    if found is None or found[0] == 0:
        print(*args, **kwargs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--devices", type=int, default=None,
                    help="virtual CPU devices to plan on (default: this machine's cores, 2 to 4)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    torch.manual_seed(0)

    text = make_corpus(4000, seed=1)
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    say(f"corpus: {len(text):,} characters, vocabulary of {len(vocab)}")

    model = gpt2(vocab=len(vocab), seq=args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: GPT-2 ({model.config.n_layer} layers, width {model.config.n_embd}, tied embeddings), "
          f"{n_params / 1e6:.2f}M parameters, random init")

    gen = torch.Generator().manual_seed(2)
    held_out = len(ids) // 10  # the corpus's last tenth: text the model never trains on
    data = batches(ids[:-held_out], args.batch, args.seq, gen)
    test = next(batches(ids[-held_out:], args.batch, args.seq, gen))
    os.makedirs(args.out, exist_ok=True)
    world = conveyor.distributed.world()
    trace_path = os.path.join(args.out, "demo_run.pftrace" if world is None else f"demo_run.rank{world[0]}.pftrace")

    # One line: the model is captured, profiled and planned on this machine at the first call.
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    piped = conveyor.Module(model, opt, devices=args.devices, trace=trace_path)

    x = next(data)
    t0 = time.perf_counter()
    loss = piped(input_ids=x, labels=x)
    where = (f"{piped.job.devices} virtual CPU devices" if world is None
             else f"{piped.world_size} processes, one device each")
    say(f"captured, profiled and planned in {time.perf_counter() - t0:.1f}s "
        f"(the first step included); the plan on {where}:\n")
    say(piped.plan)

    # Step 1 against eager PyTorch accumulating gradients over the same microbatches (in one
    # process: across processes each holds only its stages' gradients).
    loss.backward()
    if world is None:
        m = piped.microbatches
        ref_loss = 0.0
        for part in x.tensor_split(m):
            share = part.shape[0] / x.shape[0]
            part_loss = ref(input_ids=part, labels=part).loss
            (part_loss * share).backward()
            ref_loss += part_loss.item() * share
        worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                    for p, q in zip(model.parameters(), ref.parameters()))
        say(f"step-1 check vs eager with {m} accumulated microbatches: loss {loss.item():.6f} vs {ref_loss:.6f}, "
            f"worst relative gradient difference {worst:.1e}")
    del ref
    piped.clip_grad_norm_(1.0)  # the whole model's norm, across processes too
    opt.step()
    opt.zero_grad(set_to_none=True)
    first_test = evaluate(piped, test)

    first_loss = loss.item()
    window, start = [], time.perf_counter()
    say(f"\ntraining {args.steps} steps, pipelined (batch {args.batch} x {args.seq} tokens)")
    for step in range(2, args.steps + 1):
        x = next(data)
        loss = piped(input_ids=x, labels=x)
        loss.backward()
        piped.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(loss.item())
        if (step % 10 == 0 or step == args.steps) and piped.rank == 0:
            elapsed = time.perf_counter() - start
            done = int(30 * step / args.steps)
            bar = "#" * done + "." * (30 - done)
            sys.stdout.write(f"\r[{bar}] step {step:>4}  loss {sum(window) / len(window):.3f}  "
                             f"{(step - 1) * args.batch / elapsed:7.1f} samples/s")
            sys.stdout.flush()
            window = []
    final = loss.item()
    say(f"\nloss {first_loss:.3f} -> {final:.3f} ({'down' if final < first_loss else 'NOT down'})")
    # Every step's measured actions reached the pipeline's partitioner actor: how the running
    # plan compares with the planner's prediction.
    say(piped.profile_report())
    say(f"trace of a measured step: {trace_path} (open at ui.perfetto.dev; check with "
          f"./run conveyor trace check {trace_path})")

    piped.state_dict()  # across processes: every process's copy of the model becomes whole
    graph = piped.capture.graph
    path = os.path.join(args.out, "demo_gpt2.cvg")
    if piped.rank == 0:
        graph.save(path)
    say(f"saved the trained graph to {path}; inspect it with: ./run conveyor inspect {path}")
    final_test = evaluate(piped, test)
    say(f"held-out loss {first_test:.3f} -> {final_test:.3f} (evaluated pipelined: eval mode's own capture, "
        "its forwards alone through the same stages)")
    if final >= first_loss:
        sys.exit("the loss did not go down")


if __name__ == "__main__":
    main()
