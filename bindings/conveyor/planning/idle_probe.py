"""Measuring a device that no stage runs on (docs/planner.md, "Re-planning"): the live profile
measures a device only through the stages it runs, so a straggler the plan left idle would
keep the slow speed it last measured for good. While the running plan leaves this process's
device idle, each re-planning window measures how fast the device runs matrix products for
a while (on the device the model runs on, in C++ without the interpreter lock, which another
thread may hold); the first probe after it went idle is the reference, and each later one
says how many times faster the device now runs (partitioner/replan.h: its speed is then the
one it had when it went idle times that). The process has no stage to run, so probing costs
the training little (docs/planner.md, "A device left idle", has the figures).
"""
from __future__ import annotations

import torch

from .. import _C

# A probe's length in wall time: many of the scheduler's time slices, so that a core shared
# with other processes shows as the share it gets (a probe of fixed work, 3 ms at full speed,
# ran whole in the burst a waking process gets beside nine hogs: it read them as absent),
# and a small part of a window's steps.
PROBE_S = 0.05


def side_for(device: torch.device) -> int:
    """The matrices' side: a product that runs at the device's speed (a CPU core's, a GPU's)."""
    return 2048 if device.type == "cuda" else 128


class IdleProbe:
    """The probes of one process's device (`device`: where its stages' tensors live)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.reference = 0.0  # products per second at the first probe after the device went idle

    def speed_change(self, idle: bool) -> float:
        """While `idle`: this probe's rate over the first one's (1.0 at the first); 0.0 when a
        stage runs here (the probes start over when the device next goes idle)."""
        if not idle:
            self.reference = 0.0
            return 0.0
        rate = _C.matrix_product_rate(str(self.device), PROBE_S, side_for(self.device))
        if self.reference == 0.0:
            self.reference = rate
            return 1.0
        return rate / self.reference
