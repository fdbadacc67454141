"""conveyor's own work leaves the user's random streams where they were.

Capturing, profiling, planning and building a pipeline run the model and make tensors, which
draws from torch's global generators; the user's data pipeline draws from them too (a
masked-LM collator's masks, a sampler's order). Run inside `users_rng_kept`, that work
leaves them as it found them, so a script draws the same numbers with conveyor as without.
"""
from __future__ import annotations

import contextlib
import itertools

import torch


@contextlib.contextmanager
def users_rng_kept(model: torch.nn.Module):
    """Within: draws from torch's CPU generator and those of the CUDA devices `model`'s
    tensors are on; on leaving, each generator's state as it was."""
    devices = sorted({t.device.index or 0 for t in itertools.chain(model.parameters(), model.buffers()) if t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        yield
