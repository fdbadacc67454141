"""The checks a `conveyor.Module`'s arguments pass before any work: every misuse is a
ConveyorValueError naming the argument and what to give instead, raised in the constructor,
never a torch error from deep inside the first step, nor a silent acceptance."""
from __future__ import annotations

import math
import os
import warnings
from numbers import Real
from pathlib import Path

import torch

from . import _C
from .errors import ConveyorValueError

# The range of every timeout (seconds), as common/timeouts.h holds it for C++: at most a week.
LEAST_SECONDS, MOST_SECONDS = 0.001, 604800.0

# The schedules' names and what each places on a rank are scheduler/schedule.h's; "auto" is
# the Module's own: the planner chooses.
SCHEDULES = ("auto", *_C.schedule_names())
# Schedules that put two stages on each device group (pipeline rank).
TWO_STAGES_PER_RANK = tuple(name for name in _C.schedule_names() if _C.chunks_of(name) == 2)


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def seconds(value, what: str) -> float:
    """A timeout: a real number of seconds from 1 ms to a week."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)) or \
            not LEAST_SECONDS <= float(value) <= MOST_SECONDS:
        raise ConveyorValueError(f"{what}={value!r}: expected a number of seconds from {LEAST_SECONDS} to "
                                 f"{MOST_SECONDS:.0f} (a week)")
    return float(value)


def check_model(model, optimizer) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ConveyorValueError(f"conveyor.Module takes a torch.nn.Module, not {type(model).__name__} "
                                 f"{getattr(model, '__name__', '')!s}; wrap a function in an nn.Module whose forward "
                                 "calls it")
    params = list(model.parameters())
    if not params:
        raise ConveyorValueError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train "
                                 "(run it without conveyor)")
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConveyorValueError(f"optimizer: expected a torch.optim.Optimizer (or None), not {type(optimizer).__name__}")
    mine = {id(p) for p in params}
    if not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
        raise ConveyorValueError("the optimizer holds none of the model's parameters; make it from "
                                 "model.parameters() of the model given to conveyor.Module")


def check_cluster(cluster) -> dict | None:
    """A cluster is TOML text or the path of a TOML file; a path that names nothing is an
    error here, not TOML text that fails to parse. Parsed now, errors naming the file and
    line; returns what _C.read_cluster says of it (nodes, devices)."""
    if cluster is None:
        return None
    if not isinstance(cluster, (str, os.PathLike)):
        raise ConveyorValueError(f"cluster={cluster!r}: expected the path of a cluster file or its TOML text")
    text = str(cluster)
    if "\n" in text or "=" in text:
        return _C.read_cluster(text, "cluster=")  # TOML text
    if not Path(text).is_file():
        raise ConveyorValueError(f"cluster={text!r}: no such file (give a cluster TOML file, docs/formats.md, or its text)")
    return _C.read_cluster_file(text)  # read in C++, as every text file: its size limit, its encoding checked


def warn_of_another_machine(cluster, summary: dict | None, devices: int, launched: bool) -> None:
    """A cluster file that describes more devices than the job runs on plans for that
    machine, not this one: said once, naming both."""
    if summary is None or summary["devices"] <= devices:
        return
    here = f"{devices} processes" if launched else f"{devices} virtual devices of this process's CPU"
    name = cluster if "\n" not in str(cluster) else "cluster="
    warnings.warn(f"conveyor: {name} describes {summary['devices']} devices on {summary['nodes']} nodes, but this "
                  f"job runs on {here}: the plan uses {devices} of the file's devices and predicts for that "
                  "machine, not this one. Give a cluster file of this machine (docs/formats.md), or leave cluster= "
                  "out to plan for the devices the job has", stacklevel=4)


def check_output_path(path, what: str) -> None:
    """A file conveyor will write: its folder must exist now, not after the step ran."""
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConveyorValueError(f"{what}={path!r}: expected a file path")
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ConveyorValueError(f"{what}={str(path)!r}: the folder {folder} does not exist (make it first)")
    if Path(path).is_dir():
        raise ConveyorValueError(f"{what}={str(path)!r} is a folder; name a file in it")


# "none", "selective", "full", as common/recomputation.h names them.
RECOMPUTATIONS = tuple(_C.recomputation_names())


def _recomputation(value) -> bool:
    return isinstance(value, bool) or (isinstance(value, str) and value in RECOMPUTATIONS)


def recomputation(value) -> str:
    """A stage's activation recomputation by its name ("none", "selective", "full"): True
    is "full" and False or None "none" (flags, and plans written before selective
    recomputation)."""
    if value is True:
        return "full"
    if value is False or value is None:
        return "none"
    return value


def check_module_arguments(model, optimizer, *, stages, replicas, microbatches, schedule, devices, cluster, trace,
                           loss_fn, plan, transport, replan, replan_horizon, recompute) -> None:
    check_model(model, optimizer)
    if replan not in ("auto", "off"):
        raise ConveyorValueError(f"replan={replan!r}: expected 'auto' (re-plan from live profiles) or 'off'")
    if not _whole(replan_horizon, 1):
        raise ConveyorValueError(f"replan_horizon={replan_horizon!r}: expected a whole number of steps, at least 1")
    if transport not in ("ucx", "nccl"):
        raise ConveyorValueError(f"transport={transport!r}: expected 'ucx' (host memory) or 'nccl' (GPU memory, "
                                 "one GPU per process)")
    if schedule not in SCHEDULES:
        raise ConveyorValueError(f"unknown schedule {schedule!r} (expected {', '.join(SCHEDULES[:-1])} or {SCHEDULES[-1]})")
    if replicas is not None and not _whole(replicas, 1) and not (
            isinstance(replicas, list) and replicas and all(_whole(r, 1) for r in replicas)):
        raise ConveyorValueError(f"replicas={replicas!r}: every stage needs at least one replica "
                                 "(an int for all stages, or a list with one count per stage)")
    if recompute is not None and not _recomputation(recompute) and not (
            isinstance(recompute, list) and all(_recomputation(r) for r in recompute)):
        raise ConveyorValueError(f"recompute={recompute!r}: expected True or 'full' (every stage keeps only its "
                                 "inputs), 'selective' (every stage runs its cheap operators again), False or "
                                 "'none', or a list with one of those per stage")
    if microbatches is not None and not _whole(microbatches, 1):
        raise ConveyorValueError(f"microbatches={microbatches!r}: expected a whole number, at least 1 (or None: planned)")
    if devices is not None:
        if not _whole(devices, 1):
            raise ConveyorValueError(f"devices={devices!r}: expected a whole number of devices, at least 1")
        ranks = stages // 2 if schedule in TWO_STAGES_PER_RANK and _whole(stages, 1) else stages
        if _whole(ranks, 1) and ranks > devices:
            raise ConveyorValueError(f"stages={stages} needs {ranks} devices (each pipeline rank runs on its own), but "
                                     f"devices={devices}; give more devices or fewer stages")
    if loss_fn is not None and not callable(loss_fn):
        raise ConveyorValueError(f"loss_fn={loss_fn!r}: expected a function of (output, *inputs) returning the loss")
    check_output_path(trace, "trace")
    if plan is not None and plan != "auto":
        if not isinstance(plan, (str, os.PathLike)) or not Path(plan).is_file():
            raise ConveyorValueError(f"plan={plan!r}: no such file (give a plan written by `conveyor plan --out` or "
                                     "Plan.save, or 'auto')")
