"""A fine-tuning script's start, for tests/python/test_pretrained.py: a GPT-2 made from a
transformers folder's config.json (with other random weights), wrapped, its weights read
from the folder with load_pretrained before the first call, one step's loss, then
save_pretrained to another folder. Alone or under `conveyor launch`:

    conveyor launch -n 2 -- python pretrained_worker.py --load gpt2 --save export --out r.pt

Process 0 writes the first loss; every process writes the names it read from the folder
(`<out>.reads<R>.json`). The model is built on the meta device, as a fine-tuning job of a
model too large for one process builds it: each process makes only the tensors its stages
read, filled from the folder.
"""
import argparse
import json

import safetensors
import torch

import conveyor

VOCAB = 96


def tiny_config(**changes):
    """GPT-2 with 2 layers of width 32, no dropout (so conveyor's loss equals eager's)."""
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.GPT2Config(**dict(dict(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                               bos_token_id=0, eos_token_id=0), **changes))


def batch():
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(7))


def next_token_loss(output, ids):
    """Cross entropy of each next token in the logits' own dtype (transformers' built-in loss
    runs in float32, too coarse to compare float64 runs closely)."""
    return torch.nn.functional.cross_entropy(output.logits[:, :-1].transpose(1, 2), ids[:, 1:])


class RecordedReads:
    """safetensors.safe_open, noting each tensor read whole."""
    names: list = []

    def __init__(self, *args, **kwargs):
        self.file = _safe_open(*args, **kwargs)

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def get_tensor(self, name):
        RecordedReads.names.append(name)
        return self.file.get_tensor(name)

    def __getattr__(self, name):
        return getattr(self.file, name)


_safe_open = safetensors.safe_open


def main():
    import transformers
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    safetensors.safe_open = RecordedReads
    with torch.device("meta"):
        net = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(args.load)).double()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), stages=2, loss_fn=next_token_loss,
                            replan="off", timeout=60)
    model.load_pretrained(args.load)
    ids = batch()
    loss = model(input_ids=ids, target=ids).item()
    model.save_pretrained(args.save)
    with open(f"{args.out}.reads{model.rank}.json", "w") as f:
        json.dump(RecordedReads.names, f)
    if model.rank == 0:
        torch.save({"loss": loss, "world": model.world_size, "stages": len(model.plan.stage_nodes)}, args.out)


if __name__ == "__main__":
    main()
