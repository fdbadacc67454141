import os
import random
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Re-planning's windows of WINDOW steps whatever the steps' time (the default sizes them to
# 2 s of steps): the tests of what re-planning decides count windows in steps, and the
# processes they start inherit this. test_replan.py's window test sets its own.
os.environ.setdefault("CONVEYOR_REPLAN_WINDOW_S", "0")


def max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max(|b|, tiny): how far `a` is from the reference `b`."""
    a, b = a.detach().double(), b.detach().double()
    scale = max(b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() / scale


def split_batch(args: tuple, kwargs: dict, m: int, batch: int) -> list:
    """(args, kwargs) of each of `m` microbatches: tensors with `batch` rows are split along
    dim 0 as the runtime splits them (tensor_split), everything else is passed whole."""
    def parts(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return list(x.tensor_split(m))
        return [x] * m
    a = [parts(x) for x in args]
    k = {n: parts(x) for n, x in kwargs.items()}
    return [(tuple(p[i] for p in a), {n: v[i] for n, v in k.items()}) for i in range(m)]


@pytest.fixture
def rel_err():
    return max_relative_error


def ephemeral_range_start() -> int:
    """The first port of the kernel's ephemeral range, which outgoing connections draw from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def busy_cores(most: float, wait_s: float = 60.0) -> float:
    """How many of the machine's cores other work keeps busy (from /proc/stat over a second),
    waiting up to `wait_s` for it to fall to `most`. The load average lags a minute: a test
    that ran processes of its own just before read as load for the next, which then skipped."""
    def jiffies() -> tuple[int, int]:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)  # idle and waiting for I/O
        return sum(cpu) - idle, sum(cpu)

    cores = os.cpu_count() or 1
    deadline = time.monotonic() + wait_s
    while True:
        try:
            busy0, total0 = jiffies()
            time.sleep(1.0)
            busy1, total1 = jiffies()
        except (OSError, ValueError, IndexError):
            return os.getloadavg()[0]
        busy = cores * (busy1 - busy0) / max(1, total1 - total0)
        if busy <= most or time.monotonic() > deadline:
            return busy


def free_port() -> int:
    """A TCP port free on loopback now (for a test job's rendezvous), below the kernel's
    ephemeral range: a port from that range (bind to 0) was taken again, by a connection of
    another process, in the seconds before the job's process 0 listened on it."""
    ephemeral_from = ephemeral_range_start()
    low = 10000 if ephemeral_from > 12000 else 1024
    for port in random.Random().sample(range(low, max(low + 1, ephemeral_from)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything tried was taken: any free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_script(script, processes: int = 2, timeout_s: int = 120) -> tuple[int, str]:
    """Runs `python script` under `conveyor launch -n processes` (the job's wait timeout
    `timeout_s`) from a clean environment; its exit code and its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    tool = Path(os.environ.get("CONVEYOR_BUILD_DIR", Path(__file__).resolve().parents[2] / "build")) / "tools" / "conveyor"
    r = subprocess.run([str(tool), "launch", "-n", str(processes), "--timeout", str(timeout_s), "--", sys.executable,
                        str(script)], env=env, capture_output=True, text=True, timeout=timeout_s + 180)
    return r.returncode, r.stdout + r.stderr
