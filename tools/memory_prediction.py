#!/usr/bin/env python3
"""Measured against predicted peak memory per device, over the configurations that
docs/planner.md reports: each trains a zoo model for 3 steps in one process with
conveyor.Module (replan off) and prints `profile_report().memory`'s measured/predicted for
every device. Each configuration runs in its own process with an empty profile cache, so
every run profiles again and may cut the model elsewhere, as a new user's first run does:

    ./run python tools/memory_prediction.py --runs 3
    ./run python tools/memory_prediction.py --only llama      # configurations naming llama

A device's measured peak is what its replica's threads allocated through torch's CPU
allocator (runtime/memory_meter.h) plus the parameters it holds; in one process a value
that crosses virtual devices is one tensor, charged to the device that made it."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# (model, optimizer, schedule, stages, microbatches)
CONFIGURATIONS = [
    ("gpt2", "adam", "1f1b", 3, 8),
    ("gpt2", "sgd", "zb-v", 4, 8),
    ("gpt2", "sgd", "zb-v", 4, 4),
    ("gpt2", "sgd", "zb-v", 4, 16),
    ("gpt2", "sgd", "zb-h1", 2, 8),
    ("resnet18", "sgd", "1f1b", 2, 4),
    ("llama", "sgd", "1f1b", 3, 8),
    ("llama", "sgd", "zb-v", 4, 8),
    ("gpt2", "sgd", "dualpipev", 4, 8),
    ("gpt2", "adam", "zb-v", 4, 4),
]

ONE = """
import json, sys
sys.path.insert(0, {tests!r})
from test_memory import trained
model = trained({name!r}, {optimizer!r}, stages={stages}, microbatches={microbatches}, schedule={schedule!r})
print("RESULT", json.dumps([r["measured_bytes"] / r["predicted_bytes"] for r in model.profile_report().memory]))
"""


def measure(config: tuple) -> list[float]:
    name, optimizer, schedule, stages, microbatches = config
    here = os.path.dirname(os.path.abspath(__file__))
    code = ONE.format(tests=os.path.join(here, "..", "tests", "python"), name=name, optimizer=optimizer,
                      stages=stages, microbatches=microbatches, schedule=schedule)
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CONVEYOR_CACHE_DIR": cache},
                             capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{config} failed:\n{out.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1, help="runs of every configuration (each profiles again)")
    ap.add_argument("--only", default="", help="only configurations whose description contains this")
    args = ap.parse_args()
    every = []
    for config in CONFIGURATIONS:
        label = "{} {} {}, {} stages, {} microbatches".format(*config)
        if args.only not in label:
            continue
        runs = [measure(config) for _ in range(args.runs)]
        every += [r for run in runs for r in run]
        per_device = [" / ".join(f"{run[d]:.3f}" for run in runs) for d in range(len(runs[0]))]
        print(f"{label:40s} " + " | ".join(per_device), flush=True)
    if every:
        inside = sum(0.9 <= r <= 1.1 for r in every)
        print(f"measured/predicted {min(every):.3f} to {max(every):.3f}; {inside} of {len(every)} within 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
