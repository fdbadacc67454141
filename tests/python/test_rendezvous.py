"""The rendezvous admits only processes that hold the job's secret: an impostor (wrong
secret) neither joins nor aborts a forming job and learns nothing from its refusal; a late
process cannot take a rank; and nothing of a job listens beyond the address it names."""
import os
import random
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from conveyor import _C

UCX_PROBLEM = _C.ucx_status()
pytestmark = pytest.mark.skipif(bool(UCX_PROBLEM), reason=f"UCX cannot start here: {UCX_PROBLEM}")

SECRET = "a3f1c2d4e5b60718293a4b5c6d7e8f90"
JOB = "fingerprint-of-the-model-1234"

# Joins as RANK of WORLD_SIZE with the secret and job given, prints "joined", keeps the group
# until the file RELEASE exists (when one is named; at most 120 s), checks it still sums across
# the job, prints "done".
JOINER = """
import os, sys, time, torch
from conveyor import _C
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
try:
    g = _C.ProcessGroup(rank, world, "127.0.0.1", int(os.environ["MASTER_PORT"]), os.environ["JOB"],
                        float(os.environ.get("TIMEOUT", "30")), "", os.environ["SECRET"])
except Exception as e:
    print(f"{type(e).__name__}: {e}", flush=True)
    sys.exit(3)
print("joined", flush=True)
release, deadline = os.environ.get("RELEASE"), time.monotonic() + 120
while release and not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.1)
t = torch.ones(1)
g.allreduce(t)
print(f"done {int(t.item())}", flush=True)
g.close()
"""


def start(rank: int, world: int, port: int, secret: str = SECRET, release: Path | None = None, timeout: float = 30):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port), JOB=JOB, SECRET=secret,
               RELEASE=str(release or ""), TIMEOUT=str(timeout), UCX_NET_DEVICES="lo", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", JOINER], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(p, timeout=60) -> str:
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        return p.communicate()[0] + "\n[killed: timed out]"


def wait_for_line(p, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if text in line:
            return
        if not line and p.poll() is not None:
            raise AssertionError(f"process ended before printing {text!r}")
    raise AssertionError(f"no {text!r} within {timeout} s")


# Joins a job nobody else joins, and gets Ctrl-C's SIGINT a second in.
INTERRUPTED_JOINER = """
import os, signal, threading, time
from conveyor import _C
signal.signal(signal.SIGINT, signal.default_int_handler)
threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
start = time.monotonic()
try:
    _C.ProcessGroup(int(os.environ["RANK"]), 2, "127.0.0.1", int(os.environ["MASTER_PORT"]), "job", 60.0, "", "s")
except KeyboardInterrupt:
    print(f"KeyboardInterrupt {time.monotonic() - start - 1:.1f} s after the signal", flush=True)
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_stops_a_process_waiting_at_the_rendezvous(rank):
    """Process 0 waiting for the others to join, or another waiting for process 0 to
    listen, stops at Ctrl-C within a second, not at the rendezvous's timeout (60 s here)."""
    env = dict(os.environ, RANK=str(rank), MASTER_PORT=str(free_port()), UCX_NET_DEVICES="lo")
    text = subprocess.run([sys.executable, "-c", INTERRUPTED_JOINER], env=env, capture_output=True, text=True,
                          timeout=50).stdout
    after = re.search(r"KeyboardInterrupt ([\d.]+) s after the signal", text)
    assert after and float(after[1]) < 1.5, text


def test_an_impostor_neither_joins_nor_aborts_a_forming_job():
    port = free_port()
    first = start(0, 2, port)
    time.sleep(1.0)
    impostor = start(1, 2, port, secret="not-the-secret-of-this-job")
    text = finish(impostor)
    assert impostor.returncode == 3, text
    assert "refused this process: its job secret differs" in text, text
    assert SECRET not in text and JOB not in text  # the refusal reveals nothing of the job
    assert first.poll() is None, "the impostor stopped the forming job: " + finish(first)
    second = start(1, 2, port)
    for p in (first, second):
        text = finish(p)
        assert p.returncode == 0 and "done 2" in text, text


def test_a_late_process_cannot_take_a_rank_and_the_job_goes_on(tmp_path):
    port, release = free_port(), tmp_path / "release"
    job = [start(r, 2, port, release=release) for r in range(2)]
    for p in job:
        wait_for_line(p, "joined")
    late = start(1, 2, port)
    text = finish(late)
    assert late.returncode == 3 and "already has all its 2 processes" in text, text
    late_impostor = start(1, 2, port, secret="not-the-secret-of-this-job")
    text = finish(late_impostor)
    assert late_impostor.returncode == 3 and "job secret differs" in text, text
    release.touch()  # the job held its group, however slowly the late ones started
    for p in job:
        text = finish(p)
        assert p.returncode == 0 and "done 2" in text, text


def test_a_process_0_without_the_secret_is_not_trusted():
    port = free_port()
    fake = start(0, 2, port, secret="not-the-secret-of-this-job", timeout=10)
    real = start(1, 2, port, timeout=10)
    text = finish(real)
    assert real.returncode == 3 and "job secret differs" in text, text
    fake.kill()
    finish(fake)


def listening_sockets(pid: int) -> list[str]:
    """The local addresses of the TCP sockets `pid` listens on (from /proc)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # the process is gone
        return []
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address = fields[1].split(":")[0]
            if width == 8:
                found.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
            else:
                found.append("::1" if address == "0" * 24 + "01000000" else
                             "::" if address == "0" * 32 else address)
    return found


LISTENER = """
import os, time, torch, json
from conveyor import _C
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
g = _C.ProcessGroup(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), "listen-test", 30.0)
os.write(1, f"joined {os.getpid()}\\n".encode())  # one write: under the launcher both share a pipe
time.sleep(float(os.environ["HOLD"]))
t = torch.ones(1)
g.allreduce(t)
g.close()
"""


@pytest.mark.parametrize("launched", [True, False], ids=["conveyor launch", "by hand"])
def test_nothing_of_the_job_listens_beyond_its_address(launched, tmp_path):
    env = dict(os.environ, HOLD="10", OMP_NUM_THREADS="1")
    env.pop("UCX_NET_DEVICES", None)  # by hand: nothing narrows UCX but conveyor itself
    script = tmp_path / "listener.py"
    script.write_text(LISTENER)
    tool = Path(os.environ.get("CONVEYOR_BUILD_DIR", "build")) / "tools" / "conveyor"
    if launched:
        procs = [subprocess.Popen([str(tool), "launch", "-n", "2", "--", sys.executable, str(script)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    else:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r), WORLD_SIZE="2",
                                                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    pids = []
    try:
        seen = []
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline:
            for p in procs:
                line = p.stdout.readline()
                seen.append(line)
                if line.startswith("joined"):
                    pids.append(int(line.split()[1]))
        assert len(pids) == 2, "the job did not form: " + "".join(seen)[-2000:]
        listening = {pid: listening_sockets(pid) for pid in pids}
        addresses = {a for found in listening.values() for a in found}
        assert addresses, f"no listening socket found (the rendezvous listens on process 0): {listening}"
        assert addresses <= {"127.0.0.1", "::1"}, f"the job listens on {listening}, beyond 127.0.0.1"
    finally:
        for p in procs:
            finish(p)


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def listening(port: int, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens at port {port} within {within} s")


def test_nothing_grows_before_authentication_and_the_job_still_forms(tmp_path):
    """Unauthenticated peers on the rendezvous port (a header announcing 4 GiB, CAF's old
    32-byte BASP header, 100 connections of random bytes, 100 that each hold a join frame
    just under the limit) leave process 0's resident memory within 50 MB of where it was,
    and the job forms and trains."""
    port, release = free_port(), tmp_path / "release"
    first = start(0, 2, port, release=release, timeout=120)
    listening(port)
    time.sleep(0.5)
    before = resident_bytes(first.pid)
    rng = random.Random(0)
    peers = []
    try:
        announce = socket.create_connection(("127.0.0.1", port))
        announce.sendall(struct.pack(">I", 0xFFFFFFFF) + b"x" * 65536)  # 4 GiB announced, refused at its header
        peers.append(announce)
        basp = socket.create_connection(("127.0.0.1", port))
        basp.sendall(struct.pack(">IIQ", 0, 0xFFFFFFFF, 0) + bytes(16))
        peers.append(basp)
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(rng.randbytes(4096))
            peers.append(s)
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(struct.pack(">I", 65536) + rng.randbytes(65535))  # one byte short: held until its time is up
            peers.append(s)
    except OSError:
        pass  # process 0 closing a connection under the writes is what it may do
    time.sleep(2.0)
    grown = resident_bytes(first.pid) - before
    print(f"process 0: {before / 1e6:.1f} MB resident before, {grown / 1e6:+.1f} MB after {len(peers)} unproven peers")
    assert grown < 50e6, f"process 0 grew by {grown / 1e6:.1f} MB before any peer proved the job's secret"
    second = start(1, 2, port, release=release)
    wait_for_line(second, "joined")
    release.touch()
    for p in (first, second):
        text = finish(p)
        assert p.returncode == 0 and "done 2" in text, text
    for s in peers:
        s.close()
