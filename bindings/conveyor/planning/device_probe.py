"""Probing a device's speed apart from the model (docs/planner.md, "Telling a device from
its operators"): how fast the device runs matrix products for a while, on the device the
model runs on, in C++ without the interpreter lock (which another thread may hold).

The live profile measures a device only through the stages it runs, and a stage's times
cannot tell a slow device from operators the profile priced low. So at the end of each
running plan's first window every process probes its device (a census: the devices compared
with each other, apart from their operators), and at the end of every later window a process
whose device the plan leaves idle probes it again (a straggler the plan left out is seen to
go away). The Replanner turns the rates into speeds (partitioner/replan.h). A census costs
each process 0.15 s per plan; an idle process has no stage to run (docs/planner.md has the
figures). One process's devices are one device shared, so its census probes nothing: every
device gets the same rate (replanning.py).
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


# The probes of one reading, of which the fastest counts: a census's figure stands for the whole
# plan, and one probe on this machine's shared cores dipped to half its rate now and then
# (back-to-back probes of an idle core spread 15-37%). Other work on the core only slows a
# probe, so the fastest is the nearest to the device's share of it: a device reads slow only
# where all three dipped (the median needed two), and a straggler's steady share reads alike.
# A later reading (a device under a speed ceiling, or left idle) is scaled by the census's, so
# it is read alike: one probe against the census's fastest of three read a timm ViT's
# straggler at x0.29 where its censuses read x0.44-0.51, and the switch taken on it measured
# slower and was undone.
PROBES = 3
READING_S = PROBE_S * PROBES  # a reading's wall time


class DeviceProbe:
    """The probes of one process's device (`device`: where its stages' tensors live)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def rate(self) -> float:
        """Matrix products per second on the device: the fastest of PROBES probes of PROBE_S
        of wall time each."""
        return max(_C.matrix_product_rate(str(self.device), PROBE_S, side_for(self.device)) for _ in range(PROBES))
