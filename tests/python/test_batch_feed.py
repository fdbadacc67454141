"""Across processes, data and clipping as torchrun users write them (bindings/conveyor/
batch_feed.py, clipping.py): each process fed its share by a DistributedSampler trains as
one process on the shares concatenated; torch.nn.utils.clip_grad_norm_(model.parameters())
clips by the whole model's norm; a feed that does not fit its mode is refused at the first
step, naming the processes."""
import json
import sys

import pytest
import torch

from conveyor import _C
from test_launch import launch

TOLERANCE = 1e-9
needs_ucx = pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")

SCRIPT = r'''
import json, sys, torch
from torch.nn.utils import clip_grad_norm_  # bound before conveyor.Module exists, as many scripts do
import conveyor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
out, mode, clipping = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                          torch.nn.Linear(16, 2)).double()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
model = conveyor.Module(net, optimizer, loss_fn=torch.nn.functional.mse_loss, stages=2, replan="off",
                        batches="same" if mode == "same" else "shares")
draws = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(48, 8, generator=draws, dtype=torch.float64),
                     torch.randn(48, 2, generator=draws, dtype=torch.float64))
sampler = DistributedSampler(data, num_replicas=model.world_size, rank=model.rank, shuffle=False)
losses, norms = [], []
for x, y in DataLoader(data, batch_size=8, sampler=sampler):
    if mode == "ragged" and model.rank == 1:
        x = torch.cat([x, x[:, :1]], dim=1)  # another width than process 0's
    optimizer.zero_grad()
    loss = model(x, target=y)
    loss.backward()
    if clipping == "clip_grad_norm_":
        norms.append(float(clip_grad_norm_(model.parameters(), 0.5)))
    else:  # torch's two-part form
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, norm)
        norms.append(float(norm))
    optimizer.step()
    losses.append(loss.item())
state = {k: v.tolist() for k, v in model.state_dict().items()}
json.dump(dict(losses=losses, norms=norms, state=state, report=str(model.profile_report())),
          open(f"{out}/rank{model.rank}.json", "w"))
'''


def _eager():
    """One process over each step's shares concatenated in process order, torch's clipping."""
    from torch.utils.data import TensorDataset
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 2)).double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    draws = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=draws, dtype=torch.float64),
                         torch.randn(48, 2, generator=draws, dtype=torch.float64))
    shares = [list(range(48))[r::2] for r in (0, 1)]  # DistributedSampler's, unshuffled
    losses, norms = [], []
    for k in range(3):
        rows = [i for share in shares for i in share[8 * k:8 * k + 8]]
        x, y = data[rows]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, {k: v.tolist() for k, v in net.state_dict().items()}


def _run(tmp_path, mode, clipping="clip_grad_norm_"):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return launch("-n", 2, "--", sys.executable, script, tmp_path, mode, clipping)


@needs_ucx
@pytest.mark.parametrize("clipping", ["clip_grad_norm_", "get_total_norm"])
def test_each_process_fed_its_share_trains_as_one_process_on_the_shares_and_clips_by_the_whole_norm(clipping,
                                                                                                      tmp_path):
    code, out = _run(tmp_path, "shares", clipping)
    assert code == 0, out[-4000:]
    losses, norms, state = _eager()
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["losses"] == pytest.approx(losses, rel=TOLERANCE, abs=0)
        assert got["norms"] == pytest.approx(norms, rel=TOLERANCE, abs=0)
        assert max(norms) > 0.5  # the clipping acted
        other = 1 - r  # each process runs one of the two stages; its report says where the other one is
        assert f"{other}      {other}     1         runs in another process (its profile_report measures it)" \
            in got["report"], got["report"]
        for key, want in state.items():
            w = torch.tensor(want)
            err = (torch.tensor(got["state"][key]) - w).abs().max().item() / w.abs().max().item()
            assert err <= TOLERANCE, (key, err)


@needs_ucx
def test_shares_fed_to_the_default_same_batch_mode_are_refused_at_the_first_step(tmp_path):
    code, out = _run(tmp_path, "same")
    assert code != 0
    assert "processes [1] were fed another batch than process 0 (call 1; process 1: positional argument 0 has " \
           "other bytes)" in out, out[-3000:]
    assert "pass batches='shares'" in out
    assert not (tmp_path / "rank0.json").exists()


@needs_ucx
def test_shares_that_differ_beyond_their_first_dimension_are_refused_naming_them(tmp_path):
    code, out = _run(tmp_path, "ragged")
    assert code != 0
    assert "positional argument 0: the processes' shares differ beyond their first dimension (process 0: [8, 8], " \
           "process 1: [8, 9])" in out, out[-3000:]
