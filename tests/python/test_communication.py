"""conveyor.distributed's differentiable communication under `conveyor launch`: the
examples of seed 001 (an encoder-decoder split, a channel-parallel CNN with allgather, a
three-process chain with figure 4's shape), a Sequential that branches and joins across
three processes and two tensor-parallel pipeline stages on four (collectives over groups)
train 3 steps exactly like the same model in one process (float64,
relative error at most 1e-9) without any delegate variable; every collective's backward is
its pair; a call only some processes reach ends within the timeout naming the call and the
process."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port
from conveyor import _C

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "distributed"
TOOL = Path(os.environ.get("CONVEYOR_BUILD_DIR", ROOT / "build")) / "tools" / "conveyor"
TOLERANCE = 1e-9

pytestmark = pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")


def environment(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def launch(n: int, script: Path, *args, env=None, timeout=240):
    r = subprocess.run([str(TOOL), "launch", "-n", str(n), "--", sys.executable, str(script), *map(str, args)],
                       env=env or environment(), capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_session runs it)"))])
@pytest.mark.parametrize("example, processes", [
    ("seq2seq", 2), ("channel_parallel_cnn", 2), ("channel_parallel_cnn", 3), ("three_process_chain", 3),
    ("branching", 3), ("tensor_parallel_pipeline", 4), ("one_f_one_b", 3), ("v_schedule", 2),
    ("gpt2_tied_embeddings", 2)])
def test_the_split_trains_like_one_process(example, processes, device, tmp_path):
    """On CUDA every process shares the one GPU: its tensors cross in device memory (UCX's
    cuda_ipc), and the reference runs on that GPU too."""
    script = EXAMPLES / f"{example}.py"
    code, out = launch(processes, script, "--out", tmp_path, "--device", device)
    assert code == 0, out[-4000:]
    assert_trains_like_the_model_alone(script, processes, device, tmp_path)


def test_the_split_trains_like_one_process_under_torchrun(tmp_path):
    """torchrun's environment serves as well as `conveyor launch`'s (its agent's store holds
    MASTER_PORT; process 0 hands out another through it)."""
    script = EXAMPLES / "seq2seq.py"
    r = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--master-port",
                        str(free_port()), str(script), "--out", str(tmp_path)], env=environment(), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert_trains_like_the_model_alone(script, 2, "cpu", tmp_path)


def assert_trains_like_the_model_alone(script: Path, processes: int, device: str, tmp_path: Path) -> None:
    """The split's results (rank<R>.pt in tmp_path) against the same script run alone."""
    alone = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--device", device],
                           capture_output=True, text=True, env=environment(CONVEYOR_EXAMPLE_WORLD=str(processes)),
                           timeout=240)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    reference = torch.load(tmp_path / "reference.pt")
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(processes)]
    state = {k: v for p in parts for k, v in p["state"].items()}
    assert state.keys() == reference["state"].keys()
    for name, want in reference["state"].items():
        err = (state[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        assert err <= TOLERANCE, f"{name}: relative error {err:.2e}"
    losses = next(p["losses"] for p in parts if p["losses"])
    assert losses == pytest.approx(reference["losses"], rel=TOLERANCE, abs=0)


@pytest.mark.parametrize("processes", [2, 3])
def test_every_collective_s_backward_is_its_pair(processes):
    code, out = launch(processes, Path(__file__).with_name("communication_worker.py"))
    assert code == 0, out[-4000:]
    assert out.count("every collective and its backward as expected") == processes, out[-4000:]


def test_large_messages_without_the_shared_region():
    """CONVEYOR_UCX_REGION_MB=0: every large message goes through UCX, and arrives the same."""
    code, out = launch(2, Path(__file__).with_name("communication_worker.py"),
                       env=environment(CONVEYOR_UCX_REGION_MB="0"))
    assert code == 0, out[-4000:]
    assert "process 1: 0 of 72 large messages arrived over the sender's region" in out, out[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_session runs it)")
@pytest.mark.parametrize("device_memory", ["1", "0"])
def test_every_collective_on_cuda_tensors(device_memory):
    """Two processes on the one GPU: CUDA tensors cross from device memory to device memory
    through UCX's CUDA transports (cuda_ipc), or with CONVEYOR_UCX_CUDA=0 through host memory,
    and arrive on the caller's device; every backward still pairs."""
    code, out = launch(2, Path(__file__).with_name("communication_worker.py"),
                       env=environment(DEVICE="cuda", CONVEYOR_UCX_CUDA=device_memory))
    assert code == 0, out[-4000:]
    assert out.count("every collective and its backward as expected") == 2, out[-4000:]


@pytest.mark.parametrize("processes", [2, 3])
def test_every_collective_over_nccl(processes):
    """init(transport="nccl"), a GPU per process: CUDA tensors cross GPU to GPU over NCCL (a
    two-member group per direction), headers and host tensors over UCX; every backward pairs."""
    if torch.cuda.device_count() < processes:
        pytest.skip(f"NCCL needs a GPU per process: {processes} GPUs ({torch.cuda.device_count()} visible)")
    code, out = launch(processes, Path(__file__).with_name("communication_worker.py"),
                       env=environment(DEVICE="cuda", TRANSPORT="nccl", GPU_PER_PROCESS="1"))
    assert code == 0, out[-4000:]
    assert out.count("every collective and its backward as expected") == processes, out[-4000:]


def nccl_refused(**extra) -> str:
    """The worker with init(transport="nccl") where NCCL cannot serve: every process must fail
    at once (well inside the 60 s timeout), saying why."""
    r = subprocess.run([str(TOOL), "launch", "-n", "2", "--timeout", "60", "--", sys.executable,
                        str(Path(__file__).with_name("communication_worker.py"))],
                       env=environment(TRANSPORT="nccl", **extra), capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "did not complete within" not in out, out[-3000:]
    assert 'init(transport="nccl") needs NCCL and a GPU of its own in every process' in out, out[-3000:]
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_nccl_without_a_gpu_fails_on_every_process_naming_why():
    out = nccl_refused()
    for rank in (0, 1):
        assert f"process {rank} cannot join NCCL point to point" in out, out[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_session runs it)")
def test_nccl_with_two_processes_on_one_gpu_fails_naming_why():
    """Both processes on their current device, GPU 0: NCCL refuses two members on one GPU."""
    out = nccl_refused(DEVICE="cuda")
    assert "each process needs a GPU of its own" in out, out[-3000:]


def mismatched(kind: str, timeout_s: int, processes: int = 2) -> str:
    """The worker's collectives on `processes`, then the mismatch `kind`; the job must fail."""
    r = subprocess.run([str(TOOL), "launch", "-n", str(processes), "--timeout", str(timeout_s), "--", sys.executable,
                        str(Path(__file__).with_name("communication_worker.py"))],
                       env=environment(MISMATCH=kind), capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    return out


def test_a_receive_nobody_sends_ends_within_the_timeout_naming_the_call():
    out = mismatched("1", 5)
    assert re.search(r"process 0: conveyor\.distributed: receive #\d+ from process 1 did not complete within 5000 ms",
                     out), out[-3000:]


def test_a_receive_from_a_process_that_exited_fails_at_once_naming_it():
    """SystemExit(3) mid-job reaches no excepthook; the process still says it leaves, and the
    one waiting for its message fails within seconds, not at the (60 s) timeout."""
    out = mismatched("exit", 60)
    assert re.search(r"process 0, conveyor\.distributed: receive #\d+ from process 1: process 1 sent nothing for "
                     r"this before it left the job", out), out[-3000:]
    assert "did not complete within" not in out, out[-3000:]


def by_hand(command: list, world: int, **env) -> list:
    """`command` run as the `world` processes of a job started by hand (RANK, WORLD_SIZE,
    MASTER_*), as a cluster's own launcher would: no `conveyor launch` stops the others when
    one dies. Each one's (returncode, output)."""
    port = free_port()
    procs = [subprocess.Popen(command, env=environment(**env) | {
        "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def test_a_process_killed_mid_job_is_named_by_the_one_waiting_for_it():
    """SIGKILL gives process 1 no chance to say it leaves: process 0, waiting in a receive
    from it, fails within 10 s (the timeout is 60), naming the lost process (started by
    hand: no launcher stops process 0 for it)."""
    (code, out), (killed, last) = by_hand([sys.executable, str(Path(__file__).with_name("communication_worker.py"))],
                                          2, MISMATCH="kill", CONVEYOR_TIMEOUT="60")
    assert killed == -signal.SIGKILL, last[-2000:]
    assert code != 0, out[-3000:]
    assert re.search(r"receive #\d+ from process 1.*process 1 was lost", out), out[-3000:]
    waited = re.search(r"process 0 failed ([\d.]+) s after it began waiting", out)
    assert waited and float(waited[1]) < 10, out[-3000:]


# Process 0 sends 48 KB to process 1 (under the shared region's threshold: UCX's rendezvous,
# in flight until the receiver reads it), which is killed without receiving it; process 0
# then waits in backward() for what it sent to arrive.
SEND_TO_THE_KILLED = """
import os, signal, time, torch
import conveyor.distributed as dist
dist.barrier()
if dist.rank() == 1:
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
dist.send(torch.ones(12000), 1)
time.sleep(2)
start = time.monotonic()
try:
    dist.backward()
finally:
    print(f"process 0 stopped waiting {time.monotonic() - start:.1f} s after it began", flush=True)
"""


def test_a_send_in_flight_to_a_killed_process_fails_within_seconds_naming_it():
    """A send to a process that died before reading it used to stay in flight for good (UCX's
    shared memory has no error handling), and the wait for it ran out the 60 s timeout saying
    only that it did not complete; now the member finishes a lost peer's sends itself, with
    the loss, and the wait ends within seconds naming the process. (UCX still warns at exit
    that the request never came back to its pool.)"""
    (code, out), (killed, _) = by_hand([sys.executable, "-c", SEND_TO_THE_KILLED], 2, CONVEYOR_TIMEOUT="60")
    assert killed == -signal.SIGKILL
    assert code != 0, out[-3000:]
    assert re.search(r"send #\d+ to process 1.*process 1 was lost", out), out[-3000:]
    waited = re.search(r"process 0 stopped waiting ([\d.]+) s", out)
    assert waited and float(waited[1]) < 10, out[-3000:]


# Process 1 joins and never calls the allreduce: process 0's times out, leaving its receive
# from process 1 pending, which holds what the transport was given until the job ends.
ALLREDUCE_LEFT_PENDING = """
import gc, os, time, weakref, torch
from conveyor import _C
rank = int(os.environ["RANK"])
g = _C.ProcessGroup(rank, 2, "127.0.0.1", int(os.environ["MASTER_PORT"]), job="pending", timeout_s=5)
if rank == 1:
    time.sleep(8)
    os._exit(0)
t = torch.ones(3)
alive = weakref.ref(t)
try:
    g.allreduce(t)
except Exception as e:
    print("the allreduce failed:", e, flush=True)
del t
gc.collect()
print("the tensor is freed" if alive() is None else "the transport still holds the tensor", flush=True)
"""


def test_a_tensor_given_to_an_allreduce_that_failed_is_not_held_by_the_transport():
    """The transport holds its own handle on a Python tensor, never the tensor itself: it
    drops what a failed call left pending on its own thread, maybe while Python finalizes,
    and a tensor Python made needs the GIL to go (at exit after a peer died, a process
    aborted with "terminate called without an active exception")."""
    (code, out), _ = by_hand([sys.executable, "-c", ALLREDUCE_LEFT_PENDING], 2)
    assert "the allreduce failed: process 0: an allreduce did not complete within 5000 ms" in out, out[-3000:]
    assert "the tensor is freed" in out, out[-3000:]
    assert code == 0 and "terminate called" not in out, out[-3000:]


# Both processes wait to receive from the other; process 1 gets Ctrl-C's SIGINT a second in
# (its handler made sure of: a shell's background job starts with SIGINT ignored).
INTERRUPTED_WHILE_WAITING = """
import os, signal, threading, time, torch
import conveyor.distributed as dist
signal.signal(signal.SIGINT, signal.default_int_handler)
dist.barrier()
start = time.monotonic()
if dist.rank() == 1:
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    dist.recv(1 - dist.rank())
except KeyboardInterrupt:
    print(f"KeyboardInterrupt {time.monotonic() - start - 1:.1f} s after the signal", flush=True)
    try:
        dist.recv(0)
    except Exception as e:
        print("and then:", e, flush=True)
    raise
except Exception as e:
    print(f"process {dist.rank()} failed {time.monotonic() - start:.1f} s after it began waiting: {e}", flush=True)
    raise
"""


def test_ctrl_c_ends_a_wait_on_the_peers_and_the_job_within_seconds():
    """A process waiting in a receive runs Python's signal handlers while it waits: Ctrl-C
    raises KeyboardInterrupt there within a second, not at the end of the timeout (60 s
    here), and gives up the job, so the process waiting for it fails within seconds naming
    it, and a later call of the interrupted one says why it cannot go on."""
    (code, out), (interrupted, last) = by_hand([sys.executable, "-c", INTERRUPTED_WHILE_WAITING], 2,
                                               CONVEYOR_TIMEOUT="60")
    after = re.search(r"KeyboardInterrupt ([\d.]+) s after the signal", last)
    assert after and float(after[1]) < 1.5, last[-3000:]
    assert "and then: " in last and "process 1 was interrupted while waiting for" in last, last[-3000:]
    assert interrupted != 0 and last.rstrip().endswith("KeyboardInterrupt"), last[-3000:]
    failed = re.search(r"process 0 failed ([\d.]+) s after it began waiting: .*process 1 gave up the job: process 1 "
                       r"was interrupted while waiting for conveyor.distributed: receive #\d+ from process 0", out)
    assert failed and float(failed[1]) < 10, out[-3000:]
    assert code != 0


# Process 1 raises while process 0 waits for its message.
RAISES_WHILE_ITS_PEER_WAITS = """
import time, torch
import conveyor.distributed as dist
dist.barrier()
if dist.rank() == 1:
    time.sleep(0.5)
    raise ValueError("the batch has NaNs")
start = time.monotonic()
try:
    dist.recv(1)
except Exception as e:
    print(f"process 0 failed {time.monotonic() - start:.1f} s after it began waiting: {e}", flush=True)
"""


def test_a_process_that_raises_tells_the_one_waiting_for_it_why():
    """An uncaught exception gives the job up, and the goodbye says why: the process waiting
    for it fails within seconds with the exception, not with a bare "was lost" (started by
    hand: no launcher stops process 0 for it)."""
    (code, out), (raised, last) = by_hand([sys.executable, "-c", RAISES_WHILE_ITS_PEER_WAITS], 2, CONVEYOR_TIMEOUT="60")
    assert raised != 0 and "ValueError: the batch has NaNs" in last, last[-3000:]
    failed = re.search(r"process 0 failed ([\d.]+) s after it began waiting: process 0, conveyor.distributed: receive "
                       r"#\d+ from process 1: process 1 gave up the job: process 1 failed: ValueError: the batch has NaNs",
                       out)
    assert failed and float(failed[1]) < 10, out[-3000:]


def test_communication_recomputed_by_checkpointing_is_refused_naming_why():
    out = mismatched("checkpoint", 20)
    assert "conveyor.distributed.send called inside a backward pass (activation checkpointing" in out, out[-3000:]


def test_a_collective_only_some_processes_reach_fails_naming_both_calls():
    out = mismatched("call", 20)
    assert re.search(r"process 0's allgather received message #\d+ of process 1's bcast: every process must make "
                     r"the same calls in the same order", out), out[-3000:]


def test_a_collective_of_another_group_fails_naming_both_groups():
    """Process 0's allreduce over processes 0 and 1 meets process 1's over the whole job."""
    out = mismatched("group", 20, processes=3)
    assert re.search(r"process 1's allreduce over group \[0, 1, 2\] received message #\d+ of process 0's allreduce "
                     r"over group \[0, 1\]: every process must make the same calls", out), out[-3000:]


def test_a_send_nobody_receives_fails_the_job_at_exit_naming_both():
    out = mismatched("send", 20)
    counts = re.search(r"process 0 sent (\d+) messages to process 1, which asked for (\d+): a send nobody received", out)
    assert counts and int(counts[1]) == int(counts[2]) + 1, out[-3000:]
    assert out.count("a send nobody received (") == 1, out[-3000:]  # said once for the job


def test_a_receive_nothing_was_sent_for_is_named_at_exit_the_other_way():
    """A receiver that went on past a failed receive: the counts differ the other way."""
    out = mismatched("caught", 20)
    counts = re.search(r"process 0 sent (\d+) messages to process 1, which asked for (\d+): a receive nothing was "
                       r"sent for", out)
    assert counts and int(counts[1]) + 1 == int(counts[2]), out[-3000:]


def test_a_gradient_no_backward_applied_is_named_at_exit():
    """A tagged microbatch left without its backward(microbatch=k) on the sending process:
    the job ends normally, and the sender names the gradient it never applied."""
    r = subprocess.run([str(TOOL), "launch", "-n", "2", "--timeout", "20", "--", sys.executable,
                        str(Path(__file__).with_name("communication_worker.py"))],
                       env=environment(MISMATCH="unapplied"), capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert re.search(r"process 0's send #\d+ to process 1 \(microbatch 1\) got its gradient, which no backward\(\) "
                     r"applied \(1 message\(s\) in all\): call backward\(microbatch=1\)", out), out[-3000:]
    assert out.count("which no backward() applied") == 1, out[-3000:]


def test_without_a_job_it_says_how_to_start_one():
    r = subprocess.run([sys.executable, "-c", "import torch, conveyor.distributed as d; d.send(torch.ones(1), 1)"],
                       env=environment(), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "conveyor launch -n N" in r.stderr, r.stderr[-2000:]


def test_a_group_is_named_by_its_processes_and_bad_ones_are_refused(monkeypatch):
    """Making a group is local (no process joins anything): a job of 40 processes, seen from
    process 35, whose sets span two words of a message's flags."""
    import conveyor.distributed as dist
    from conveyor.distributed import groups
    from conveyor.errors import ConveyorValueError
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConveyorValueError, match="needs the processes of a job"):
        dist.new_group([0])
    monkeypatch.setenv("WORLD_SIZE", "40")
    monkeypatch.setenv("RANK", "35")
    g = dist.new_group([35, 3, 34])
    assert (g.ranks, g.size, g.rank, 3 in g, 4 in g) == ((3, 34, 35), 3, 2, True, False)
    assert groups.named(g.mask) == "group [3, 34, 35]" and len(g.mask) == 2
    assert g == dist.new_group([3, 34, 35]) and g != dist.new_group([3, 34])
    assert dist.new_group(torch.tensor([35, 3, 34])).ranks == (3, 34, 35)  # any integers
    assert dist.new_group().ranks == tuple(range(40))
    with pytest.raises(ConveyorValueError, match=r"process 35 is not in group \[0, 1\]"):
        dist.new_group([1, 0]).rank
    for bad, says in [([], "a group needs at least one process"), ([0, 40], "40 is not a process of this job of 40"),
                      ([2, "1"], "'1' is not a process"), ([3, 3], "process 3 is named twice"),
                      (7, "expected a list of process ranks")]:
        with pytest.raises(ConveyorValueError, match=re.escape(says)):
            dist.new_group(bad)
