"""The processes of one job, found from the usual environment: RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT (set by `conveyor launch`, torchrun or by hand; under mpirun or srun the
rank and size come from their own variables; under torchrun, whose store holds
MASTER_PORT, process 0 listens on a free port it hands out through that store). With
WORLD_SIZE above 1, `conveyor.Module` runs its pipeline across the processes: process 0
plans (unless the stages are fixed) and every process runs its share of the pipeline
ranks. Every wait between processes has a timeout: CONVEYOR_TIMEOUT seconds (default 300),
or Module(timeout=).

    world()            (rank, world_size, host, port), or None in a single process
    process_group()    this process's member of the job (made once per process)
    launch_settings()  what `conveyor launch` asks of every process
    default_timeout()  CONVEYOR_TIMEOUT, checked

The one module that holds the job's process state: both conveyor.Module's pipeline and the
communication of models split by hand (communication.py) join the job through it.
"""
from __future__ import annotations

import atexit
import datetime
import socket
import sys

from .. import _C, environment
from ..arguments import seconds
from ..errors import ConveyorValueError

__all__ = ["world", "process_group", "default_timeout", "launch_settings", "this_process_file"]

# The job's process state: this process's member of the job (process_group()), and the
# world it joined as.
_group = None
_group_key = None


# Where other launchers put the rank and the world size, when RANK and WORLD_SIZE are unset.
_LAUNCHERS = [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # mpirun (Open MPI)
              ("PMI_RANK", "PMI_SIZE"),                          # mpirun (MPICH, Intel MPI)
              ("SLURM_PROCID", "SLURM_NTASKS")]                  # srun


def world():
    """(rank, world_size, master_addr, master_port) from the environment, or None when this
    process runs alone (no WORLD_SIZE, or WORLD_SIZE=1). RANK and WORLD_SIZE come from
    `conveyor launch` or torchrun, or else from mpirun or srun's own variables; MASTER_ADDR
    (default 127.0.0.1) and MASTER_PORT (default 29500) name where process 0 listens."""
    size = environment.variable("WORLD_SIZE")
    if size is None:
        for rank_var, size_var in _LAUNCHERS:
            if environment.is_set(rank_var) and environment.is_set(size_var):
                size = environment.variable(size_var)
                environment.set_default("RANK", environment.variable(rank_var))
                break
    if size is None or size.strip() == "1":
        return None

    def number(name, text):
        try:
            return int(text)
        except (TypeError, ValueError):
            raise ConveyorValueError(f"{name}={text!r} is not a number; the launcher sets RANK, WORLD_SIZE, "
                                     "MASTER_ADDR and MASTER_PORT (see `conveyor launch --help`)") from None

    n = number("WORLD_SIZE", size)
    if not environment.is_set("RANK"):
        raise ConveyorValueError(f"WORLD_SIZE={n} but no RANK: start the processes with `conveyor launch -n {n} -- ...` "
                                 "or set RANK (0 to WORLD_SIZE - 1) for each")
    rank = number("RANK", environment.variable("RANK"))
    if n < 1 or not 0 <= rank < n:
        raise ConveyorValueError(f"RANK={rank} with WORLD_SIZE={n}: RANK must be 0 to {n - 1}")
    host = environment.variable("MASTER_ADDR", "127.0.0.1")
    port = number("MASTER_PORT", environment.variable("MASTER_PORT", "29500"))
    return rank, n, host, port


def launch_settings() -> dict:
    """What `conveyor launch` (or its job config) asks of every process: `schedule`, `plan` (a
    file; absent for "auto"), `transport`, `trace` (the job's file), `replan` and
    `replan_horizon`, where set."""
    out = {}
    replan = environment.variable("CONVEYOR_REPLAN")
    if replan:
        if replan not in ("auto", "off"):
            raise ConveyorValueError(f"CONVEYOR_REPLAN={replan!r}: expected auto or off")
        out["replan"] = replan
    horizon = environment.variable("CONVEYOR_REPLAN_HORIZON")
    if horizon:
        if not horizon.isdigit() or int(horizon) < 1:
            raise ConveyorValueError(f"CONVEYOR_REPLAN_HORIZON={horizon!r}: expected a whole number of steps, at least 1")
        out["replan_horizon"] = int(horizon)
    schedule = environment.variable("CONVEYOR_SCHEDULE")
    if schedule:
        out["schedule"] = schedule
    plan = environment.variable("CONVEYOR_PLAN")
    if plan and plan != "auto":
        out["plan"] = plan
    transport = environment.variable("CONVEYOR_TRANSPORT")
    if transport:
        if transport not in ("ucx", "nccl"):
            raise ConveyorValueError(f"CONVEYOR_TRANSPORT={transport!r}: expected ucx or nccl")
        out["transport"] = transport
    trace = environment.variable("CONVEYOR_TRACE")
    if trace:
        out["trace"] = trace
    return out


def this_process_file(path):
    """Under a launcher, this process's own file for `path`: <stem>.rank<R><suffix> (every
    process writing one file would leave none whole); alone, `path` itself."""
    found = world()
    if found is None:
        return path
    text = str(path)
    stem, dot, ext = text.rpartition(".")
    return f"{stem}.rank{found[0]}.{ext}" if dot and "/" not in ext else f"{text}.rank{found[0]}"


def default_timeout() -> float:
    text = environment.variable("CONVEYOR_TIMEOUT", "300")
    try:
        value = float(text)
    except ValueError:
        raise ConveyorValueError(f"CONVEYOR_TIMEOUT={text!r} is not a number of seconds") from None
    return seconds(value, "CONVEYOR_TIMEOUT")


def process_group(job: str, timeout_s: float):
    """This process's member of the job, joined on first use: the rendezvous at
    MASTER_ADDR:MASTER_PORT, then UCX between every two processes. `job` is a fingerprint
    of the model and plan every process must share."""
    global _group, _group_key
    found = world()
    if found is None:
        return None
    if _group is not None:
        if _group_key != found:
            raise ConveyorValueError(f"this process already joined the job {_group_key}; the environment now says "
                                     f"{found}: one process belongs to one job")
        return _group
    rank, n, host, port = found
    port = _rendezvous_port(rank, host, port, timeout_s)
    _group = _C.ProcessGroup(rank, n, host, port, job=job, timeout_s=timeout_s)
    _group_key = found
    _leave_in_step()
    return _group


def _rendezvous_port(rank: int, host: str, port: int, timeout_s: float) -> int:
    """Where process 0 listens for the others. Under torchrun (TORCHELASTIC_RUN_ID set),
    MASTER_PORT is its agent's TCPStore, taken: process 0 listens on a free port of
    MASTER_ADDR's interface instead and hands it out through that store (a key per restart,
    so an elastic restart does not read the last one's)."""
    if not environment.is_set("TORCHELASTIC_RUN_ID"):
        return port
    from torch.distributed import TCPStore  # only under torchrun: a torch built without distributed still runs alone
    where = f"torchrun's store at {host}:{port}"
    try:
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)
    except Exception as e:  # noqa: BLE001  (torch raises several kinds)
        raise ConveyorValueError(f"process {rank} cannot reach {where} (MASTER_ADDR, MASTER_PORT): {e}") from None
    key = f"conveyor/rendezvous/{environment.variable('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)
            free = probe.getsockname()[1]
        store.set(key, str(free))
        return free
    try:
        return int(store.get(key))
    except Exception as e:  # noqa: BLE001
        raise ConveyorValueError(f"process {rank} waited {timeout_s:g} s for process 0's rendezvous port in {where}: "
                                 f"{e} (does process 0 reach conveyor too?)") from None


def _leave_in_step():
    """At exit the process leaves the job in step with the others (so none goes while another
    still waits for what it sent); after an uncaught exception it gives up at once instead,
    so the others learn of it within seconds rather than at their timeout."""
    previous = sys.excepthook

    def give_up(kind, value, tb):
        if _group is not None:
            _group.abort(f"process {_group.rank} failed: {kind.__name__}: {value}")
        previous(kind, value, tb)

    sys.excepthook = give_up
    atexit.register(lambda: _group.close() if _group is not None else None)

