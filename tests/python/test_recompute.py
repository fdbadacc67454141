"""Activation recomputation: a stage that recomputes keeps only its inputs between its forward
and its backward and runs its forward again before the backward. Every model of the zoo
trains with recomputation in every stage exactly like eager (float64): BatchNorm's running
statistics are updated once, in-place writes to a stage's inputs are replayed from the
inputs as they were, and dropout masks are drawn again from the same seeded generators, so a
model with dropout trains exactly like conveyor without recomputation."""
import copy

import pytest
import torch

import conveyor
from conftest import split_batch
from conveyor import zoo

TOLERANCE = 1e-9


def train_both(case, stages: int, schedule: str, recompute, steps: int = 2):
    """(conveyor.Module over case.model, the eager copy) after `steps` steps on the case's
    batch: 2 microbatches, one replica a stage, SGD."""
    ref = copy.deepcopy(case.model)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=stages, replicas=1,
                            microbatches=2, schedule=schedule, recompute=recompute, replan="off", seed=7)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    batch = next(t for t in [*case.args, *case.kwargs.values()] if isinstance(t, torch.Tensor)).shape[0]
    losses, want = [], []
    threads = torch.get_num_threads()
    for _ in range(steps):
        losses.append(model.train_step(*case.args, **case.kwargs).item())
        ref_opt.zero_grad(set_to_none=True)
        torch.set_num_threads(model._threads_per_device())  # as a stage replica runs
        try:
            total = 0  # summed in the loss's own dtype (transformers' losses are float32), as the pipeline does
            for a, k in split_batch(case.args, case.kwargs, 2, batch):
                part = case.loss(ref(*a, **k)) / 2
                part.backward()
                total = total + part.detach()
        finally:
            torch.set_num_threads(threads)
        want.append(total.item())
        ref_opt.step()
    return model, ref, losses, want


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module, what: str):
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        if not p.is_floating_point():
            assert torch.equal(p, q), f"{what}: {n} differs"
            continue
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
        assert err <= TOLERANCE, f"{what}: {n} differs by {err:.2e}"


@pytest.mark.parametrize("name", [n for n in zoo.CASES if zoo.CASES[n]().deterministic])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_zoo_trains_like_eager_with_every_stage_recomputing(name, schedule):
    torch.manual_seed(0)
    case = zoo.CASES[name]()
    model, ref, losses, want = train_both(case, stages=3, schedule=schedule, recompute=True)
    assert losses == pytest.approx(want, rel=TOLERANCE, abs=0)
    assert_same_state(case.model, ref, f"{name} {schedule}")  # weights and running statistics alike


@pytest.mark.parametrize("name", [n for n in zoo.CASES if not zoo.CASES[n]().deterministic])
def test_dropout_draws_the_same_masks_when_recomputed(name):
    """With dropout the masks are conveyor's (seeded per stage, microbatch and step), not
    eager's: recomputing must draw them again identically, so the run equals conveyor's own
    without recomputation, bit for bit."""
    runs = []
    for recompute in (False, True):
        torch.manual_seed(0)
        case = zoo.CASES[name]()
        model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=2, replicas=1,
                                microbatches=2, schedule="1f1b", recompute=recompute, replan="off", seed=7)
        losses = [model.train_step(*case.args, **case.kwargs).item() for _ in range(3)]
        runs.append((losses, case.model))
    (plain, a), (recomputed, b) = runs
    assert plain == recomputed
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n


def test_recomputing_some_stages_and_bad_flags():
    torch.manual_seed(0)
    case = zoo.gpt2()
    _, ref, losses, want = train_both(case, stages=3, schedule="1f1b", recompute=[True, False, True])
    assert losses == pytest.approx(want, rel=TOLERANCE, abs=0)
    assert_same_state(case.model, ref, "gpt2, stages 0 and 2 recomputing")
    with pytest.raises(conveyor.ConveyorValueError, match="recompute has 2 flags but the pipeline has 3 stages"):
        conveyor.Module(zoo.mlp().model, stages=3, recompute=[True, False])(*zoo.mlp().args)
    with pytest.raises(conveyor.ConveyorValueError, match="expected True"):
        conveyor.Module(zoo.mlp().model, recompute="yes")
