"""The executor on CUDA: the same exactness as on the CPU (needs a GPU; skipped without)."""
import copy

import pytest
import torch

import conveyor
from conveyor import zoo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")

CASES = ["mlp", "cnn_batchnorm", "resnet18", "gpt2", "t5", "unet3d", "inplace"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("num_stages", [1, 3])
def test_cuda_matches_eager(name, num_stages, rel_err):
    torch.manual_seed(0)
    case = zoo.CASES[name]()
    model = case.model.cuda()
    args = tuple(a.cuda() for a in case.args)
    kwargs = {k: v.cuda() for k, v in case.kwargs.items()}
    ref = copy.deepcopy(model)
    graph = conveyor.capture(model, args, kwargs)
    run = graph if num_stages == 1 else graph.split(num_stages, seed=1)
    loss = case.loss(run(*args, **kwargs))
    loss.backward()
    ref_loss = case.loss(ref(*args, **kwargs))
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= 1e-9
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is not None:
            # With a floor: a gradient that is zero in exact arithmetic (a convolution's bias
            # before BatchNorm) is rounding noise, whose order differs between cuDNN's kernels.
            err = (p.grad - q.grad).abs().max().item() / max(q.grad.abs().max().item(), 1e-6)
            assert err <= 1e-9, f"{n} differs by {err:.2e}"
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        assert rel_err(b, c) <= 1e-9, n
