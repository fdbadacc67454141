"""Gradients with respect to a pipelined model's inputs: an input that requires a gradient
gets the whole batch's, exactly as eager PyTorch gives it (float64), whether it has a batch
dimension (each share's gradient in its place) or not (every share's summed), with
microbatches and replicas, through `model(x).backward()` and `train_step` alike; a module
before conveyor.Module trains through it, in one process and across two. Packed
microbatches, which are the caller's own, refuse such an input."""
import copy
import warnings

import pytest
import torch

import conveyor
from conftest import launch_script
from conveyor import _C

TOLERANCE = 1e-9


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


class Scaled(torch.nn.Module):
    """x (batched) scaled by a mask every sample shares (not batched), then two layers."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x, mask, y):
        return torch.nn.functional.cross_entropy(self.second(torch.tanh(self.first(x * mask))), y)


def relative(a, b) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def both(seed=0):
    """The model and an eager copy, an upstream layer and its copy, and a batch of 7."""
    torch.manual_seed(seed)
    net, upstream = Scaled(), torch.nn.Linear(8, 8)
    x, mask, y = torch.randn(7, 8), torch.rand(8), torch.randint(0, 3, (7,))
    return net, copy.deepcopy(net), upstream, copy.deepcopy(upstream), x, mask, y


@pytest.mark.parametrize("replicas, microbatches", [(1, 1), (1, 2), (2, 3)])
def test_inputs_and_a_module_before_get_eager_s_gradients(replicas, microbatches):
    torch.set_default_dtype(torch.float64)
    try:
        net, ref, upstream, upstream_ref, x, mask, y = both()
        model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), stages=2, replicas=replicas,
                                microbatches=microbatches, replan="off")
        x1, m1 = x.clone().requires_grad_(), mask.clone().requires_grad_()
        (model(upstream(x1), m1, y) * 3).backward()  # an incoming gradient of 3 scales them too
        x2, m2 = x.clone().requires_grad_(), mask.clone().requires_grad_()
        (ref(upstream_ref(x2), m2, y) * 3).backward()
        assert relative(x1.grad, x2.grad) <= TOLERANCE
        assert relative(m1.grad, m2.grad) <= TOLERANCE
        for p, q in zip([*upstream.parameters(), *net.parameters()], [*upstream_ref.parameters(), *ref.parameters()]):
            assert relative(p.grad, q.grad) <= TOLERANCE
    finally:
        torch.set_default_dtype(torch.float32)


def test_train_step_trains_a_module_before_through_the_inputs():
    torch.set_default_dtype(torch.float64)
    try:
        net, ref, upstream, upstream_ref, x, mask, y = both()
        opt = torch.optim.SGD([*net.parameters(), *upstream.parameters()], lr=0.05)
        ref_opt = torch.optim.SGD([*ref.parameters(), *upstream_ref.parameters()], lr=0.05)
        model = conveyor.Module(net, opt, stages=2, microbatches=2, replan="off")
        for _ in range(2):
            model.train_step(upstream(x), mask, y)
            ref_opt.zero_grad()
            ref(upstream_ref(x), mask, y).backward()
            ref_opt.step()
        for p, q in zip(upstream.parameters(), upstream_ref.parameters()):
            assert relative(p, q) <= TOLERANCE
    finally:
        torch.set_default_dtype(torch.float32)


def test_packed_microbatches_refuse_an_input_that_requires_a_gradient():
    net, _, upstream, _, x, mask, y = both()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), stages=2, replan="off")
    calls = [((upstream(x[:4]), mask, y[:4]), {}), ((upstream(x[4:]), mask, y[4:]), {})]
    with pytest.raises(conveyor.ConveyorValueError, match="an input of the packed microbatches requires a gradient"):
        model.train_step(conveyor.Microbatches(calls))


def train_across_processes() -> None:
    """Run under `conveyor launch -n 2` (this file as a script): the two stages in two
    processes, each process's shares' input gradients summed over both."""
    warnings.simplefilter("ignore")
    torch.set_default_dtype(torch.float64)
    net, ref, upstream, upstream_ref, x, mask, y = both()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), stages=2, microbatches=2, replan="off")
    x1, m1 = x.clone().requires_grad_(), mask.clone().requires_grad_()
    model(upstream(x1), m1, y).backward()
    x2, m2 = x.clone().requires_grad_(), mask.clone().requires_grad_()
    ref(upstream_ref(x2), m2, y).backward()
    errors = [relative(x1.grad, x2.grad), relative(m1.grad, m2.grad), relative(upstream.weight.grad, upstream_ref.weight.grad)]
    assert max(errors) <= TOLERANCE, errors
    print(f"process {model.rank}: the inputs' gradients equal eager's", flush=True)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_inputs_get_eager_s_gradients_across_processes():
    code, out = launch_script(__file__)
    assert code == 0, out[-4000:]
    assert out.count("the inputs' gradients equal eager's") == 2, out[-4000:]


if __name__ == "__main__":
    train_across_processes()
