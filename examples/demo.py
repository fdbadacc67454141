"""conveyor demo: capture a GPT-2 (random init) into conveyor's graph, cut it into pipeline
stages, check the first step against eager PyTorch, then train it on a generated corpus
through the staged C++ executor and watch the loss fall.

    ./run demo [--steps 200] [--stages 4]
"""
import argparse
import copy
import os
import random
import sys
import time
import warnings

import torch

import conveyor
from conveyor import zoo

warnings.filterwarnings("ignore")

SUBJECTS = ["the pipeline", "a stage", "every replica", "the planner", "one microbatch", "the scheduler"]
VERBS = ["sends", "receives", "computes", "overlaps", "splits", "balances", "measures"]
OBJECTS = ["activations", "gradients", "the loss", "its inputs", "the next batch", "a profile"]
ENDINGS = ["quickly.", "in order.", "on its own stream.", "without waiting.", "exactly."]


def make_corpus(sentences: int, seed: int) -> str:
    """A small synthetic language with real structure (grammar + agreement) to learn."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
                    for _ in range(sentences))


def batches(ids: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        yield torch.stack([ids[s:s + seq] for s in starts])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    torch.manual_seed(0)

    text = make_corpus(4000, seed=1)
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    print(f"corpus: {len(text):,} characters, vocabulary of {len(vocab)}")

    case = zoo.gpt2(batch=args.batch, seq=args.seq, dtype=torch.float32, layers=4, hidden=128,
                    vocab=len(vocab), dropout=0.1)
    model = case.model
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: GPT-2 ({model.config.n_layer} layers, width {model.config.n_embd}, tied embeddings), "
          f"{n_params / 1e6:.2f}M parameters, random init")

    gen = torch.Generator().manual_seed(2)
    data = batches(ids, args.batch, args.seq, gen)
    example = next(data)
    t0 = time.perf_counter()
    graph = conveyor.capture(model, (), {"input_ids": example, "labels": example})
    print(f"captured in {time.perf_counter() - t0:.1f}s: {graph}")

    # Dropout is active, so stages follow the capture order: random draws then happen in
    # the same order as in eager PyTorch and the staged run is exact.
    staged = graph.split(args.stages, seed=0, keep_node_order=True)
    doc = graph.document
    owner = {b["value"]: b for b in doc["bindings"]}
    print(f"\n{'stage':<6}{'nodes':>6}{'params':>10}{'inputs':>8}{'outputs':>9}  first .. last op")
    for i, stage in enumerate(staged.stages):
        params = set()
        for n in stage.nodes:
            for a in doc["nodes"][n]["args"]:
                if "value" in a and a["value"] in owner:
                    params.add(owner[a["value"]]["name"])
        numel = sum(graph.tensors[p].numel() for p in params if graph.tensors[p].requires_grad)
        first, last = doc["nodes"][stage.nodes[0]], doc["nodes"][stage.nodes[-1]]
        print(f"{i:<6}{len(stage.nodes):>6}{numel:>10,}{len(stage.inputs):>8}{len(stage.outputs):>9}  "
              f"{first['op'].removeprefix('aten::')} .. {last['op'].removeprefix('aten::')}")

    # Step 1 against eager PyTorch on a copy of the same weights and the same RNG state.
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    loss = staged(input_ids=example, labels=example).loss
    loss.backward()
    torch.manual_seed(7)
    ref_loss = ref(input_ids=example, labels=example).loss
    ref_loss.backward()
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                for p, q in zip(model.parameters(), ref.parameters()))
    print(f"\nstep-1 check vs eager: loss {loss.item():.6f} vs {ref_loss.item():.6f}, "
          f"worst relative gradient difference {worst:.1e}")
    del ref

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    opt.zero_grad()
    first_loss = None
    window, start = [], time.perf_counter()
    print(f"\ntraining {args.steps} steps through {len(staged)} stages (batch {args.batch} x {args.seq} tokens)")
    for step in range(1, args.steps + 1):
        x = next(data)
        loss = staged(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        first_loss = first_loss if first_loss is not None else loss.item()
        window.append(loss.item())
        if step % 10 == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            done = int(30 * step / args.steps)
            bar = "#" * done + "." * (30 - done)
            sys.stdout.write(f"\r[{bar}] step {step:>4}  loss {sum(window) / len(window):.3f}  "
                             f"{step * args.batch / elapsed:7.1f} samples/s")
            sys.stdout.flush()
            window = []
    final = loss.item()
    print(f"\nloss {first_loss:.3f} -> {final:.3f} ({'down' if final < first_loss else 'NOT down'})")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "demo_gpt2.cvg")
    graph.save(path)
    print(f"saved the trained graph to {path}; inspect it with: ./run conveyor inspect {path}")
    if final >= first_loss:
        sys.exit("the loss did not go down")


if __name__ == "__main__":
    main()
