"""Pipelines across processes, on loopback: exactness against the single-process run of the
same plan, a process that dies mid-step, and rendezvous mismatches.

Every process is a `multiproc_worker.py` started here with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT (UCX and the rendezvous bound to 127.0.0.1); every process a test starts
is killed and reaped when it ends, whatever happens.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import free_port
from conveyor import _C

WORKER = Path(__file__).with_name("multiproc_worker.py")
TOLERANCE = 1e-12
# Parameters whose exact gradient is zero (a key bias before softmax) hold rounding noise
# (~1e-23): relative error is measured against at least this scale, as in the pipeline tests.
FLOOR = 1e-6

UCX_PROBLEM = _C.ucx_status()  # empty when UCX can start here


def env_for(rank: int, world: int, port: int) -> dict:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               UCX_NET_DEVICES="lo", OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    return env


class Job:
    """Processes of one test job; all of them are killed and reaped on exit."""

    def __init__(self):
        self.procs = []

    def start(self, args, env):
        p = subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def run_world(world: int, args: list, out: Path, timeout: float = 240) -> list:
    """Runs `world` processes of the worker; returns (returncode, output) per rank."""
    port = free_port()
    with Job() as job:
        procs = [job.start([*args, "--out", str(out)], env_for(r, world, port)) for r in range(world)]
        results = []
        for p in procs:
            try:
                text, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
                text += "\n[killed: timed out]"
            results.append((p.returncode, text))
        return results


def run_single(args: list, out: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, str(WORKER), *args, "--out", str(out)], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).abs().max().item() / max(b.abs().max().item(), FLOOR) if b.numel() else 0.0


needs_ucx = pytest.mark.skipif(bool(UCX_PROBLEM), reason=f"UCX cannot start here: {UCX_PROBLEM}")

# (case, worker arguments): four stages each, so 2 and 4 processes both hold whole ranks;
# every schedule, replicas and interleaving appear across the zoo.
CASES = {
    "mlp": ["--schedule", "1f1b", "--microbatches", "4"],
    "cnn_batchnorm": ["--schedule", "gpipe", "--microbatches", "4"],
    "resnet18": ["--schedule", "1f1b", "--microbatches", "2", "--batch", "8"],
    "bert": ["--schedule", "interleaved", "--chunks", "2", "--microbatches", "4"],
    "gpt2": ["--schedule", "zb-h1", "--microbatches", "4"],
    "t5": ["--schedule", "1f1b", "--microbatches", "4", "--replicas", "2"],
    "unet3d": ["--schedule", "gpipe", "--microbatches", "2", "--batch", "4"],
    "inplace": ["--schedule", "zb-h1", "--microbatches", "8"],
}
# The process counts each case runs in: every schedule of CASES in 2 processes (two ranks
# each) and in 4 (one rank each) across the zoo, both for two of them.
WORLDS = {"mlp": (2, 4), "cnn_batchnorm": (2,), "resnet18": (4,), "bert": (2, 4), "gpt2": (2,), "t5": (2,),
          "unet3d": (4,), "inplace": (4,)}


@needs_ucx
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize("name", ["mlp", "bert", "gpt2", "t5", "inplace", "resnet18", "unet3d"])
def test_gpu_pipelines_across_processes_train_like_one_process(name, tmp_path):
    """The same on the GPU, 2 processes sharing it: values and gradients cross in host memory
    over UCX, each landing on the device on the receiving replica's stream. The BatchNorm
    CNNs are among them: cuDNN's BatchNorm bounds the batch (880801 samples), which capture
    keeps as the graph's range instead of fixing the batch."""
    args = ["--case", name, "--stages", "4", "--steps", "3", "--device", "cuda", *CASES[name]]
    run_single(args, tmp_path / "one.pt")
    reference = torch.load(tmp_path / "one.pt")
    results = run_world(2, args, tmp_path / "2.pt")
    for rank, (code, text) in enumerate(results):
        assert code == 0, f"{name} on the GPU: process {rank} failed:\n{text[-3000:]}"
    got = torch.load(tmp_path / "2.pt")
    assert got["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE, abs=0)
    for key, want in reference["state"].items():
        assert got["state"][key].device.type == "cuda", key
        assert rel(got["state"][key], want) <= TOLERANCE, f"{name} on the GPU: {key}"


@needs_ucx
@pytest.mark.parametrize("name", list(CASES))
def test_processes_train_exactly_like_one_process_running_the_same_plan(name, tmp_path):
    """3 SGD steps in 2 or in 4 processes (`WORLDS`) give the single-process run's losses and
    state, each process holding only part of the parameters while it trains."""
    args = ["--case", name, "--stages", "4", "--steps", "3", *CASES[name]]
    run_single(args, tmp_path / "one.pt")
    reference = torch.load(tmp_path / "one.pt")
    for world in WORLDS[name]:
        results = run_world(world, args, tmp_path / f"{world}.pt")
        held = []
        for rank, (code, text) in enumerate(results):
            assert code == 0, f"{name}, {world} processes: process {rank} failed:\n{text[-3000:]}"
            words = next(line for line in text.splitlines() if line.startswith("HELD")).split()  # HELD n OF total
            held.append(int(words[1]))
            total = int(words[3])
        # Each holds what its stages read: together at least the model, no process all of it
        # unless its stages read every parameter (then some other holds less).
        assert sum(held) >= total and min(held) < total, f"{name}, {world} processes: held {held} of {total}"
        got = torch.load(tmp_path / f"{world}.pt")
        assert got["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE, abs=0)
        for key, want in reference["state"].items():
            assert rel(got["state"][key], want) <= TOLERANCE, f"{name}, {world} processes: {key}"


# Data parallelism across processes: a stage's replicas in different processes (the worker's
# replica-major placement), their gradients summed across the processes every step.
# (case, processes, worker arguments)
SPREAD_REPLICAS = {
    "mlp-2": ("mlp", 2, ["--stages", "2", "--replicas", "2", "--microbatches", "2"]),
    "mlp-4-redistributed": ("mlp", 4, ["--stages", "2", "--replicas", "3,1", "--batch", "12", "--microbatches", "2"]),
    "cnn_batchnorm-2": ("cnn_batchnorm", 2, ["--stages", "2", "--replicas", "2", "--schedule", "gpipe", "--batch", "8",
                                             "--microbatches", "2"]),
    "bert-2-interleaved": ("bert", 2, ["--stages", "4", "--chunks", "2", "--schedule", "interleaved", "--replicas", "2",
                                       "--microbatches", "4"]),
    "gpt2-4-tied": ("gpt2", 4, ["--stages", "2", "--replicas", "2", "--schedule", "zb-h1", "--microbatches", "2"]),
    # Dropout in every stage: each replica draws the masks it would draw in one process.
    "dropout-2": ("dropout", 2, ["--stages", "2", "--replicas", "2", "--microbatches", "2"]),
    # Attention dropout as well (scaled_dot_product_attention with dropout_p 0.1).
    "gpt2-dropout-2": ("gpt2", 2, ["--stages", "2", "--replicas", "2", "--microbatches", "2", "--dropout", "0.1"]),
}


@needs_ucx
@pytest.mark.parametrize("label", list(SPREAD_REPLICAS))
def test_replicas_of_a_stage_in_different_processes_train_like_one_process(label, tmp_path):
    """Each stage's replicas spread over the processes (with two pipeline ranks on 4
    processes, every replica its own process; with 3,1 replicas the single replica of stage
    1 redistributes the shares of three processes): 3 steps give the single-process run's
    losses and state. gpt2's tied embedding is read in every process."""
    name, world, extra = SPREAD_REPLICAS[label]
    args = ["--case", name, "--steps", "3", "--placement", "replicas", *extra]
    run_single(args, tmp_path / "one.pt")
    reference = torch.load(tmp_path / "one.pt")
    results = run_world(world, [*args, "--trace", str(tmp_path / "run")], tmp_path / "many.pt")
    buffers = {}  # name -> {rank: checksum} of the buffers each process held after training
    spans = {}  # rank -> the last step's measured spans (stream, stage, replica, start, end)
    profiles = {}  # rank -> its live profile report
    for rank, (code, text) in enumerate(results):
        assert code == 0, f"{label}: process {rank} failed:\n{text[-3000:]}"
        for line in text.splitlines():
            if line.startswith("BUFFER "):
                _, key, checksum = line.split()
                buffers.setdefault(key, {})[rank] = checksum
            elif line.startswith(("SPANS ", "PROFILE ")):
                key, data = line.split(" ", 1)
                (spans if key == "SPANS" else profiles)[rank] = json.loads(data)
    check_spans_across_processes(label, world, args, spans, profiles, tmp_path / "run")
    # Every process that reads a buffer holds replica 0's (running statistics included).
    for key, held in buffers.items():
        assert len(set(held.values())) == 1, f"{label}: processes hold different values of {key}: {held}"
    if name == "cnn_batchnorm":
        assert any(len(held) > 1 and "running_mean" in key for key, held in buffers.items()), buffers
    got = torch.load(tmp_path / "many.pt")
    assert got["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE, abs=0)
    for key, want in reference["state"].items():
        assert rel(got["state"][key], want) <= TOLERANCE, f"{label}: {key}"


def check_spans_across_processes(label, world, args, spans, profiles, trace_prefix):
    """What each process measured of a step whose stages have replicas in several processes:
    its own replicas only; one 'across processes' span per gradient bucket of each stage it
    runs (the same number on every process running that stage), inside the step; the live
    profile counts them; and its trace holds them on their own track."""
    import multiproc_worker
    options = dict(zip(args[::2], args[1::2]))
    stages, chunks = int(options.get("--stages", 2)), int(options.get("--chunks", 1))
    counts = [int(c) for c in options.get("--replicas", "1").split(",")]
    ranks = stages // chunks
    where = multiproc_worker.placement(counts * ranks if len(counts) == 1 else counts, world, "replicas")
    across = {}  # stage -> {rank: spans}
    waits = {}  # rank -> spans of its sums' waits for the last process (on the same track)
    for rank in range(world):
        assert rank in spans and rank in profiles, f"{label}: process {rank} printed no spans or profile"
        step_end = max(s[4] for s in spans[rank])
        for stream, stage, replica, start, end in spans[rank]:
            assert where[stage % ranks][replica] == rank, \
                f"{label}: process {rank} measured replica {replica} of stage {stage}, placed elsewhere"
            assert 0 <= start <= end <= step_end
            if stream == "across processes":
                across.setdefault(stage, {}).setdefault(rank, 0)
                across[stage][rank] += 1
            if stream == "waiting for processes":
                waits[rank] = waits.get(rank, 0) + 1
    assert across, f"{label}: no gradient sum across processes was measured"
    for stage, per_rank in across.items():
        runs_it = {p for p in where[stage % ranks]}
        assert set(per_rank) == runs_it and len(set(per_rank.values())) == 1, f"{label}: stage {stage}: {per_rank}"
        for rank in runs_it:
            assert profiles[rank]["stages"][stage]["allreduce_s"] > 0, f"{label}: {profiles[rank]}"
    tool = Path(os.environ.get("CONVEYOR_BUILD_DIR", "build")) / "tools" / "conveyor"
    for rank in range(world):
        r = subprocess.run([str(tool), "trace", "check", f"{trace_prefix}.rank{rank}.pftrace"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        want = sum(per_rank.get(rank, 0) for per_rank in across.values()) + waits.get(rank, 0)
        if want:
            track = [line for line in r.stdout.splitlines() if line.strip().startswith("on 'across processes'")]
            assert len(track) == 1 and track[0].endswith(f" {want} slices"), r.stdout


@needs_ucx
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per process: 2 GPUs (fewer visible)")
@pytest.mark.parametrize("name, extra", [("mlp", []), ("gpt2", []),
                                         ("t5", ["--placement", "replicas"]), ("bert", [])])
def test_gpu_pipelines_across_processes_over_nccl_train_like_one_process(name, extra, tmp_path):
    """transport nccl: activations and gradients cross between the processes' GPUs over NCCL
    (a two-member group per direction, headers over UCX), bit for bit what UCX carries: the
    same results as one process running the plan. t5 with placement "replicas" spreads each
    stage's replicas over both processes, so every stage sends both ways."""
    args = ["--case", name, "--stages", "4", "--steps", "3", "--device", "cuda", *CASES[name], *extra]
    run_single(args, tmp_path / "one.pt")
    reference = torch.load(tmp_path / "one.pt")
    results = run_world(2, [*args, "--transport", "nccl", "--gpu-per-process"], tmp_path / "2.pt")
    for rank, (code, text) in enumerate(results):
        assert code == 0, f"{name} over NCCL: process {rank} failed:\n{text[-3000:]}"
    got = torch.load(tmp_path / "2.pt")
    assert got["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE, abs=0)
    for key, want in reference["state"].items():
        assert rel(got["state"][key].to(want.device), want) <= TOLERANCE, f"{name} over NCCL: {key}"


@needs_ucx
@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="checks two processes on one GPU (needs exactly one)")
def test_nccl_transport_with_two_processes_on_one_gpu_fails_naming_why(tmp_path):
    """NCCL refuses two members of a group on one GPU: both processes fail, saying each
    needs a GPU of its own (UCX, the default, runs them: see the test above)."""
    args = ["--case", "mlp", "--stages", "2", "--steps", "1", "--device", "cuda", "--transport", "nccl",
            "--timeout", "60"]
    for rank, (code, text) in enumerate(run_world(2, args, tmp_path / "2.pt", timeout=180)):
        assert code != 0, f"process {rank} ran two NCCL members on one GPU:\n{text[-2000:]}"
        assert "GPU of its own" in text, text[-2000:]


@needs_ucx
def test_nccl_transport_refuses_a_model_on_the_cpu_naming_it():
    import conveyor
    import zoo
    from conveyor.errors import ConveyorError
    from conveyor.loss_wrapper import loss_wrapper
    case = zoo.CASES["mlp"](batch=8)
    graph = conveyor.capture(loss_wrapper(case.model, case.loss, case.args, case.kwargs), case.args, case.kwargs)
    stages = graph.random_partition(2, seed=0, keep_node_order=True)
    job = _C.ProcessGroup(0, 1, "127.0.0.1", free_port(), "transport-test", 30.0)
    try:
        with pytest.raises(ConveyorError, match='transport "nccl" moves GPU tensors between processes, but this '
                                                "pipeline's model is on the CPU"):
            _C.PipelineStep(graph.executor, stages, "1f1b", 2, 1, [1, 1], processes=job, rank_process=[0, 0],
                            transport="nccl")
        with pytest.raises(ConveyorError, match='transport "tcp"'):
            _C.PipelineStep(graph.executor, stages, "1f1b", 2, 1, [1, 1], processes=job, rank_process=[0, 0],
                            transport="tcp")
    finally:
        job.close()


def test_a_placement_that_does_not_match_the_pipeline_is_refused_naming_it():
    if UCX_PROBLEM:
        pytest.skip(f"UCX cannot start here: {UCX_PROBLEM}")
    import conveyor
    import zoo
    from conveyor.errors import ConveyorError
    case = zoo.CASES["mlp"](batch=8)
    from conveyor.loss_wrapper import loss_wrapper
    graph = conveyor.capture(loss_wrapper(case.model, case.loss, case.args, case.kwargs), case.args, case.kwargs)
    stages = graph.random_partition(2, seed=0, keep_node_order=True)
    job = _C.ProcessGroup(0, 1, "127.0.0.1", free_port(), "placement-test", 30.0)
    try:
        with pytest.raises(ConveyorError, match="pipeline rank 1 has 2 replicas but 1 are placed on processes"):
            _C.PipelineStep(graph.executor, stages, "1f1b", 2, 1, [1, 2], processes=job, replica_process=[[0], [0]])
        with pytest.raises(ConveyorError, match="pipeline rank 0 placed on process 3 of a world of 1"):
            _C.PipelineStep(graph.executor, stages, "1f1b", 2, 1, [1, 1], processes=job, replica_process=[[3], [0]])
    finally:
        job.close()


@needs_ucx
@pytest.mark.parametrize("placement", ["blocks", "replicas"])
def test_a_process_that_dies_mid_step_stops_every_other_naming_it(placement, tmp_path):
    """Process 1 kills itself during step 2: the others exit within 10 s, naming process 1
    (with replicas spread, while the others may be summing gradients with it). Step 2, not 1:
    the kill comes half the previous step's time in, and the first step (connections, pools)
    can take longer than the three after it together, which then all ended before it."""
    port = free_port()
    args = ["--case", "gpt2", "--stages", "3", "--steps", "4", "--microbatches", "8", "--timeout", "60",
            "--placement", placement] + (["--replicas", "2", "--batch", "32"] if placement == "replicas" else [])
    with Job() as job:
        procs = [job.start([*args, "--out", str(tmp_path / "x.pt")] + (["--die-at-step", "2"] if r == 1 else []),
                           env_for(r, 3, port)) for r in range(3)]
        deadline = time.monotonic() + 180
        while procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs[1].returncode == -signal.SIGKILL, procs[1].communicate()[0][-2000:]
        died = time.monotonic()
        for rank in (0, 2):
            try:
                text, _ = procs[rank].communicate(timeout=30)
            except subprocess.TimeoutExpired:
                procs[rank].send_signal(signal.SIGUSR1)  # its threads' Python stacks, then its output
                time.sleep(1)
                procs[rank].kill()
                pytest.fail(f"process {rank} still runs 30 s after process 1 died; where it was:\n"
                            + procs[rank].communicate()[0][-6000:])
            waited = time.monotonic() - died
            assert procs[rank].returncode != 0, text[-2000:]
            assert "process 1 was lost" in text, text[-3000:]
            assert waited < 10, f"process {rank} took {waited:.1f} s to stop"


@needs_ucx
def test_a_process_whose_script_ends_early_is_named_at_once_by_one_summing_gradients_with_it(tmp_path):
    """Process 1's loop runs 2 steps, process 0's 4, with the only stage's replicas in both
    (data parallel): process 1 leaves the job as its script ends, and process 0, in step 3's
    gradient sum with it, fails within seconds naming it, not at the (60 s) timeout."""
    port = free_port()
    args = ["--case", "mlp", "--stages", "1", "--replicas", "2", "--placement", "replicas", "--steps", "4",
            "--timeout", "60"]
    with Job() as job:
        procs = [job.start([*args, "--out", str(tmp_path / "x.pt")] + (["--end-after", "2"] if r == 1 else []),
                           env_for(r, 2, port)) for r in range(2)]
        assert procs[1].wait(timeout=120) == 0, procs[1].communicate()[0][-3000:]
        ended = time.monotonic()
        text, _ = procs[0].communicate(timeout=50)
        waited = time.monotonic() - ended
    assert procs[0].returncode != 0, text[-3000:]
    assert "summing the gradients of replicas in other processes: process 1 sent nothing for this before it left " \
           "the job" in text, text[-3000:]
    assert waited < 10, f"process 0 took {waited:.1f} s to stop"


@needs_ucx
def test_ctrl_c_stops_a_step_waiting_for_a_hung_process_and_the_job(tmp_path):
    """Process 1 hangs (SIGSTOP) during step 2, and process 0 gets Ctrl-C's SIGINT 2 s later,
    while its step waits for process 1: the step runs Python's signal handlers as it waits,
    so process 0 stops with KeyboardInterrupt within seconds, not at the timeout (60 s)."""
    port = free_port()
    args = ["--case", "mlp", "--steps", "4", "--timeout", "60", "--die-at-step", "2"]
    with Job() as job:
        procs = [job.start([*args, "--out", str(tmp_path / "x.pt"), "--signal", ["INT", "STOP"][r],
                            "--signal-delay", ["2", "0"][r]], env_for(r, 2, port)) for r in range(2)]
        try:
            text, _ = procs[0].communicate(timeout=30)
        except subprocess.TimeoutExpired:
            procs[0].send_signal(signal.SIGUSR1)
            time.sleep(1)
            procs[0].kill()
            pytest.fail("process 0 still runs 30 s after its Ctrl-C; where it was:\n" + procs[0].communicate()[0][-6000:])
        assert procs[0].returncode != 0, text[-3000:]
        assert text.rstrip().endswith("KeyboardInterrupt") and "step.run(inputs)" in text, text[-3000:]


@needs_ucx
@pytest.mark.parametrize("what, flag, expected", [
    ("version", ["--version", "0.0.0-other"], "process 1 runs conveyor 0.0.0-other but process 0 runs conveyor"),
    ("job", ["--job", "another-model"], "process 1 runs a different model or plan than process 0"),
])
def test_a_rendezvous_with_mismatched_processes_fails_on_every_process(what, flag, expected, tmp_path):
    port = free_port()
    with Job() as job:
        procs = [job.start(["--case", "mlp", "--timeout", "30", "--out", str(tmp_path / "x.pt")] + (flag if r == 1 else []),
                           env_for(r, 2, port)) for r in range(2)]
        for rank, p in enumerate(procs):
            text, _ = p.communicate(timeout=120)
            assert p.returncode != 0, f"process {rank} went on with a mismatched {what}"
            assert expected in text, text[-3000:]


@needs_ucx
def test_a_pipeline_that_differs_between_processes_fails_naming_them(tmp_path):
    port = free_port()
    with Job() as job:
        procs = [job.start(["--case", "mlp", "--timeout", "30", "--out", str(tmp_path / "x.pt"), "--microbatches",
                            "4" if r == 0 else "2"], env_for(r, 2, port)) for r in range(2)]
        for p in procs:
            text, _ = p.communicate(timeout=120)
            assert p.returncode != 0
            assert "processes 1 built a different pipeline" in text, text[-3000:]


@needs_ucx
def test_a_process_that_never_joins_fails_the_rendezvous_naming_it_within_the_timeout(tmp_path):
    port = free_port()
    with Job() as job:
        start = time.monotonic()
        p = job.start(["--case", "mlp", "--timeout", "3", "--out", str(tmp_path / "x.pt")], env_for(0, 3, port))
        text, _ = p.communicate(timeout=120)
        assert p.returncode != 0
        assert "processes 1, 2 did not join" in text, text[-3000:]
        assert time.monotonic() - start < 60
