"""GPT-2 from transformers (random weights, a small config), split by hand: the embeddings and
the first half of the blocks on process 0, the rest, the final norm and the language-model
head on process 1. GPT-2's head is tied to its token embedding (one weight), and that
weight lives on process 0: it crosses to process 1 with the hidden states, in one message,
and its gradient comes back with theirs, so the weight gets the sum of the head's and the
embedding's gradients, as in one process, with no copy of the weight to keep in step.

    ./run conveyor launch -n 2 -- python examples/distributed/gpt2_tied_embeddings.py
    ./run python examples/distributed/gpt2_tied_embeddings.py        (the model in one process)
"""
import warnings

import torch
import torch.nn.functional as F

from common import STEPS, arguments, save, split

VOCAB, WIDTH, HEADS, LAYERS, BATCH, LENGTH = 96, 32, 4, 4, 4, 12


def gpt2(device):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2LMHeadModel(config).to(device)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model.transformer


def first_half(t, ids):
    """Process 0's part: the embeddings, then the first half of the blocks."""
    h = t.wte(ids) + t.wpe(torch.arange(ids.shape[1], device=ids.device))
    for block in t.h[:LAYERS // 2]:
        h = block(h)
        h = h[0] if isinstance(h, tuple) else h
    return h


def second_half(t, h, head_weight, ids):
    """Process 1's part: the other blocks, the final norm, the head (the tied weight) and the
    next-token loss."""
    for block in t.h[LAYERS // 2:]:
        h = block(h)
        h = h[0] if isinstance(h, tuple) else h
    logits = t.ln_f(h) @ head_weight.t()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def parts(t, rank):
    """The modules each process holds, by the names the reference saves them under."""
    first = {"wte": t.wte, "wpe": t.wpe, **{f"h.{i}": t.h[i] for i in range(LAYERS // 2)}}
    second = {**{f"h.{i}": t.h[i] for i in range(LAYERS // 2, LAYERS)}, "ln_f": t.ln_f}
    return first if rank == 0 else second


def main():
    args = arguments()
    t = gpt2(args.device)
    data = torch.Generator().manual_seed(1)
    batches = [torch.randint(VOCAB, (BATCH, LENGTH), generator=data).to(args.device) for _ in range(STEPS)]
    losses = []
    if not split():
        optimizer = torch.optim.SGD(t.parameters(), lr=0.1)
        for ids in batches:
            optimizer.zero_grad()
            loss = second_half(t, first_half(t, ids), t.wte.weight, ids)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return save(args.out, {**parts(t, 0), **parts(t, 1)}, losses)

    import conveyor.distributed as dist
    if dist.world_size() != 2:
        raise SystemExit("this example runs on 2 processes: conveyor launch -n 2")
    me = dist.rank()
    mine = parts(t, me)
    optimizer = torch.optim.SGD(torch.nn.ModuleList(mine.values()).parameters(), lr=0.1)
    for ids in batches:
        optimizer.zero_grad()
        if me == 0:
            dist.send((first_half(t, ids), t.wte.weight), dst=1)  # the hidden states and the tied weight
            dist.backward()  # both gradients come back; wte.weight's adds to its embedding gradient
        else:
            h, head_weight = dist.recv(src=0)
            loss = second_half(t, h, head_weight, ids)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    save(args.out, mine, losses, me)


if __name__ == "__main__":
    main()
