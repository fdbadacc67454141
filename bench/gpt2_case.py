"""The model the pipeline benchmarks share: a GPT-2 (transformers, random init, float32,
no dropout) sized from the command line, wrapped to return its loss and captured."""
import argparse
import sys
from pathlib import Path

import torch

import conveyor
from conveyor.loss_wrapper import loss_wrapper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))  # the test models
import zoo  # noqa: E402


def add_arguments(ap: argparse.ArgumentParser, *, hidden: int, seq: int, batch: int, warmup: int | None = None) -> None:
    """--iters, --layers, --hidden, --seq, --batch, --microbatches (and --warmup if given)."""
    ap.add_argument("--iters", type=int, default=10)
    if warmup is not None:
        ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--microbatches", type=int, default=8)


def captured(args, *, vocab: int = 512, device: str = "cpu"):
    """(zoo case, loss-returning wrapper, captured graph, flattened inputs), seeded."""
    torch.manual_seed(0)
    case = zoo.gpt2(batch=args.batch, seq=args.seq, dtype=torch.float32, layers=args.layers, hidden=args.hidden,
                    vocab=vocab, dropout=0.0)
    if device != "cpu":
        case.model.to(device)
        case.kwargs = {k: v.to(device) for k, v in case.kwargs.items()}
    wrapped = loss_wrapper(case.model, case.loss, case.args, case.kwargs)
    graph = conveyor.capture(wrapped, case.args, case.kwargs)
    return case, wrapped, graph, graph.flatten_inputs(case.args, case.kwargs)
