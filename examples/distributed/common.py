"""What the split-by-hand examples share: three SGD steps, the device (`--device cuda` puts
the model and its data on each process's current CUDA device), and where their results go
(the same script alone writes reference.pt; under `conveyor launch` each process writes
rank<R>.pt with the parameters it holds), so tests/python/test_communication.py can check
that the split trains exactly like the model in one process."""
import argparse
import os
from pathlib import Path

import torch

STEPS = 3


def arguments():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/distributed", help="folder for reference.pt or rank<R>.pt")
    ap.add_argument("--device", default="cpu", help="where the model and its data live: cpu, or cuda (every "
                    "process on its current CUDA device; tensors cross in device memory)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.device = torch.device(args.device)
    if args.device.type == "cuda":
        torch.backends.cudnn.deterministic = True  # the split and the whole run the same kernels alike
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    return args


def split() -> bool:
    """True under a launcher (WORLD_SIZE above 1): run split; else run the whole model here."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def save(out, modules: dict, losses: list, rank: int | None = None) -> None:
    """The named parameters of `modules` (name -> nn.Module) and the losses this process saw."""
    state = {f"{name}.{p}": t.detach().cpu().clone() for name, m in modules.items() for p, t in m.named_parameters()}
    name = "reference.pt" if rank is None else f"rank{rank}.pt"
    torch.save({"state": state, "losses": losses}, Path(out) / name)
    print(f"{name}: {len(state)} parameters, losses {[round(x, 6) for x in losses]}")


def regression_batches(device, batch: int, width: int) -> list:
    """STEPS batches of (inputs [batch, width], targets [batch, 1]), the same in every process."""
    data = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=data).to(device), torch.randn(batch, 1, generator=data).to(device))
            for _ in range(STEPS)]


def train_alone(out, modules: dict, batches: list, loss_of) -> None:
    """The reference: the model whose parts are `modules` (name -> nn.Module) trained in this
    one process, SGD on `loss_of(x, y)` per batch; saved as reference.pt."""
    optimizer = torch.optim.SGD(torch.nn.ModuleList(modules.values()).parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_of(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    save(out, modules, losses)
