import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max(|b|, tiny): how far `a` is from the reference `b`."""
    a, b = a.detach().double(), b.detach().double()
    scale = max(b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() / scale


@pytest.fixture
def rel_err():
    return max_relative_error
