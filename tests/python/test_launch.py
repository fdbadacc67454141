"""`conveyor launch` and its job config: the same training script (conveyor.Module, automatic
plan) under the launcher (and under torchrun) trains exactly like one process running the
plan process 0 made; a
failing process stops the job at once, named; bad configs are refused naming the line.
Loopback only; every process started is reaped (the launcher reaps its own)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ephemeral_range_start, free_port
from conveyor import _C

BUILD = os.environ.get("CONVEYOR_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
TOOL = os.path.join(BUILD, "tools", "conveyor")
WORKER = Path(__file__).with_name("launch_worker.py")
TOLERANCE = 1e-12
FLOOR = 1e-6  # as in test_multiproc: parameters whose exact gradient is zero hold rounding noise


def env():
    out = dict(os.environ, UCX_NET_DEVICES="lo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CONVEYOR_PLAN", "CONVEYOR_TRACE",
              "CONVEYOR_SCHEDULE", "CONVEYOR_REPLAN", "CONVEYOR_REPLAN_HORIZON"):
        out.pop(k, None)
    return out


def launch(*args, timeout=300):
    proc = subprocess.Popen([TOOL, "launch", *map(str, args)], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"conveyor launch did not finish within {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def assert_trains_like_one_process(job_result: Path, world: int, alone_args: list, tmp_path: Path) -> None:
    """Runs the worker alone with `alone_args` and checks the job's result (from `world`
    processes) against it: the same losses and state within TOLERANCE."""
    alone = subprocess.run([sys.executable, WORKER, *alone_args, "--out", tmp_path / "one.pt"], env=env(),
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    many, one = torch.load(job_result), torch.load(tmp_path / "one.pt")
    assert many["world"] == world and one["world"] == 1
    assert many["losses"] == pytest.approx(one["losses"], rel=TOLERANCE, abs=0)
    for key, want in one["state"].items():
        got = many["state"][key].double()
        err = (got - want.double()).abs().max().item() / max(want.double().abs().max().item(), FLOOR)
        assert err <= TOLERANCE, key


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_the_same_script_under_the_launcher_trains_like_one_process_running_its_plan(tmp_path):
    """Launched from a job config that asks for a trace: each process writes its own, valid."""
    config = tmp_path / "job.toml"
    config.write_text(f'[job]\nprocesses = 2\ntrace = "{tmp_path / "run.pftrace"}"\n')
    code, out = launch("--config", config, "--", sys.executable, WORKER, "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    for rank in (0, 1):
        check = subprocess.run([TOOL, "trace", "check", tmp_path / f"run.rank{rank}.pftrace"], capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "valid Perfetto trace" in check.stdout
    assert_trains_like_one_process(tmp_path / "two.pt", 2, ["--plan", tmp_path / "two.pt.plan.json"], tmp_path)


def trace_check(path) -> dict:
    """`conveyor trace check`'s counts of a trace file: tracks, slices, instants, flows."""
    check = subprocess.run([TOOL, "trace", "check", path], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "valid Perfetto trace" in check.stdout, check.stdout + check.stderr
    counts = check.stdout.split(": valid Perfetto trace: ")[1].splitlines()[0]
    return {name: int(n) for n, name in (part.split() for part in counts.strip().split(", "))}


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_the_job_trace_holds_every_process_and_the_flows_between_them(tmp_path):
    """`conveyor launch -n 2 --trace`: each process writes its own replicas' trace, whose
    transfers to the other process have no end there (no flow); process 0 writes the job's,
    every process's tracks, with a flow for each of the 2 x 4 transfers between the stages."""
    trace = tmp_path / "job.pftrace"
    code, out = launch("-n", 2, "--trace", trace, "--", sys.executable, WORKER, "--stages", 2, "--replicas", 1,
                       "--microbatches", 4, "--schedule", "1f1b", "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    own = [trace_check(tmp_path / f"job.rank{rank}.pftrace") for rank in (0, 1)]
    job = trace_check(trace)
    assert [o["flows"] for o in own] == [0, 0]
    assert job["flows"] == 2 * 4
    assert job["slices"] == own[0]["slices"] + own[1]["slices"]
    assert job["tracks"] > max(o["tracks"] for o in own)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_evaluation_between_steps_is_pipelined_across_the_processes_and_exact(tmp_path):
    """A CNN with BatchNorm and dropout, evaluated (model.eval(), no_grad) after every third
    step under `conveyor launch -n 2`: the eval mode's capture runs forwards only across both
    processes, each holding only its stages' parameters (nothing gathered), and gives what one
    process gives; training between the evaluations goes on exactly as without them. The
    re-planning window due at the seventh step falls right after an evaluation, on a pipeline
    built again with no step measured yet: it waits for the new pipeline's steps (it failed,
    'a measured step of 0.000000 s', under Trainer's evaluation with accumulation)."""
    flags = ["--case", "cnn_batchnorm", "--batch", "16", "--stages", "2", "--steps", "7", "--evaluate-every", "3",
             "--momentum", "0.9"]
    code, out = launch("-n", 2, "--", sys.executable, WORKER, *flags, "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    assert_trains_like_one_process(tmp_path / "two.pt", 2, ["--plan", tmp_path / "two.pt.plan.json", *flags], tmp_path)
    many, one = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert len(many["evaluations"]) == 2
    assert many["evaluations"] == pytest.approx(one["evaluations"], rel=TOLERANCE, abs=0)
    other = torch.load(f"{tmp_path / 'two.pt'}.rank1")
    for result in (many, other):
        assert all(0 < held < result["whole"] for held in result["held"]), (result["held"], result["whole"])
    assert many["captures"] == 2  # one per mode


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_the_same_script_under_torchrun_trains_like_one_process_running_its_plan(tmp_path):
    """torchrun's agent holds MASTER_PORT (its TCPStore): process 0 listens on a free port and
    hands it out through that store (it failed: 'cannot listen ... at 127.0.0.1:29500')."""
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), str(WORKER),
                        "--out", str(tmp_path / "two.pt")], env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert_trains_like_one_process(tmp_path / "two.pt", 2, ["--plan", tmp_path / "two.pt.plan.json"], tmp_path)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_the_plan_process_0_makes_keeps_every_share_within_the_batch_range(tmp_path):
    """A model that runs at least 4 samples at once, batch 8 in 2 microbatches over 2
    processes: replicating a stage over both would leave 2 samples a replica, so the plan
    does not, and the job trains like one process running it."""
    asked = ["--case", "bounded", "--batch", "8", "--microbatches", "2"]
    code, out = launch("-n", 2, "--", sys.executable, WORKER, *asked, "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    plan = json.loads((tmp_path / "two.pt.plan.json").read_text())
    assert all(8 // plan["microbatches"] // stage["replicas"] >= 4 for stage in plan["stages"]), plan
    assert_trains_like_one_process(tmp_path / "two.pt", 2, ["--case", "bounded", "--batch", "8", "--plan",
                                                            tmp_path / "two.pt.plan.json"], tmp_path)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_replicas_of_a_stage_in_different_processes_train_like_one_process(tmp_path):
    """stages=2, replicas=2 under 4 processes: every stage replica its own process, each
    stage data parallel across two of them, against the same pipeline in one process."""
    fixed = ["--case", "mlp", "--stages", "2", "--replicas", "2", "--microbatches", "2"]
    code, out = launch("-n", 4, "--", sys.executable, WORKER, *fixed, "--out", tmp_path / "four.pt")
    assert code == 0, out[-4000:]
    assert_trains_like_one_process(tmp_path / "four.pt", 4, fixed, tmp_path)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_two_machines_each_with_its_own_launcher_train_like_one_process(tmp_path):
    """Two machines as two launchers on loopback (--hosts twice 127.0.0.1, --node-rank 0 and
    1, a fixed master port), two processes each: ranks 0-1 start on node 0, 2-3 on node 1,
    and the 4-process job (stages=2, replicas=2) trains like one process."""
    fixed = ["--case", "mlp", "--stages", "2", "--replicas", "2", "--microbatches", "2"]
    port = free_port()
    launchers = []
    for node in (0, 1):
        launchers.append(subprocess.Popen(
            [TOOL, "launch", "-n", "2", "--hosts", "127.0.0.1,127.0.0.1", "--node-rank", str(node), "--master-port",
             str(port), "--", sys.executable, WORKER, *fixed, "--out", str(tmp_path / "four.pt")],
            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outputs = []
    for proc in launchers:
        try:
            outputs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for p in launchers:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("a launcher did not finish within 300 s")
    for node, (proc, out) in enumerate(zip(launchers, outputs)):
        assert proc.returncode == 0, f"node {node}:\n{out[-4000:]}"
        first = 2 * node
        assert f"ranks {first}-{first + 1} of 4), rendezvous at 127.0.0.1:{port}" in out, out
    assert_trains_like_one_process(tmp_path / "four.pt", 4, fixed, tmp_path)


def test_a_failing_process_stops_the_job_at_once_naming_it():
    script = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(120)\n"
    start = time.monotonic()
    code, out = launch("-n", 3, "--grace", 2, "--", sys.executable, "-c", script, timeout=60)
    assert code == 3, out
    assert "process 1 exited with status 3; stopping the other processes" in out
    assert time.monotonic() - start < 30


# Both processes wait to receive from the other, for good.
WAITS_FOR_EACH_OTHER = """
import signal
import conveyor.distributed as dist
signal.signal(signal.SIGINT, signal.default_int_handler)
dist.barrier()
print("waiting", flush=True)
dist.recv(1 - dist.rank())
"""


def test_ctrl_c_at_a_terminal_stops_every_process_saying_where_it_was():
    """Ctrl-C reaches the launcher and its processes (one process group): each stops with
    KeyboardInterrupt, its traceback showing where it waited, before the launcher would
    SIGTERM it; the launcher exits 130 within seconds, not at the (60 s) timeout."""
    proc = subprocess.Popen([TOOL, "launch", "-n", "2", "--timeout", "60", "--", sys.executable, "-c",
                             WAITS_FOR_EACH_OTHER], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    try:
        while "".join(lines).count("waiting") < 2:  # the two may share a line
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
        time.sleep(0.5)  # each in its receive
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does
        start = time.monotonic()
        out = "".join(lines) + proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - start < 10, out
    assert proc.returncode == 130, out
    assert "the launcher got Interrupt; the processes stop" in out, out
    # Where each waited. Whether both stopped within the launcher's second before SIGTERM is
    # the machine's load, not the launcher's behaviour: a loaded 2-core machine took longer.
    assert out.count("KeyboardInterrupt") >= 2 and out.count(", in _recv") >= 2, out


@pytest.mark.parametrize("flags, expected", [([], "42 1f1b nccl"), (["--transport", "ucx", "--timeout", "7"], "7 1f1b ucx")])
def test_every_process_gets_the_environment_of_its_rank(flags, expected, tmp_path):
    """The job config's settings reach every process; flags given override them. The port
    the launcher picks is below the kernel's ephemeral range, which outgoing connections
    draw from while process 0 starts."""
    script = (f"import os\nEPHEMERAL = {ephemeral_range_start()}\n"
              "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'CONVEYOR_TIMEOUT',"
              " 'CONVEYOR_SCHEDULE', 'CONVEYOR_TRANSPORT', 'CONVEYOR_REPLAN', 'CONVEYOR_REPLAN_HORIZON']\nopen(os.path.join(os.environ['OUT'], os.environ['RANK']), 'w').write("
              "' '.join(os.environ[k] for k in keys) + ' ' + str(0 < int(os.environ['MASTER_PORT']) < EPHEMERAL))\n")
    config = tmp_path / "job.toml"
    config.write_text('[job]\nprocesses = 2\ntimeout = 42\nschedule = "1f1b"\ntransport = "nccl"\nreplan = "off"\n'
                      'replan_horizon = 250\n')
    os.environ["OUT"] = str(tmp_path)
    try:
        code, out = launch("--config", config, *flags, "--", sys.executable, "-c", script, timeout=60)
    finally:
        del os.environ["OUT"]
    assert code == 0, out
    assert (tmp_path / "0").read_text() == f"0 0 2 2 127.0.0.1 {expected} off 250 True"
    assert (tmp_path / "1").read_text() == f"1 1 2 2 127.0.0.1 {expected} off 250 True"


@pytest.mark.parametrize("config, flags, expected", [
    (None, [], "9 zb-h1 nccl auto"),                   # the environment's, as a script alone reads them
    ("timeout = 42\n", [], "42 zb-h1 nccl auto"),     # a job config overrides the environment
    ("timeout = 42\n", ["--transport", "ucx", "--timeout", "7"], "7 zb-h1 ucx auto")])  # and flags it
def test_the_environment_s_settings_are_the_launcher_s_defaults(config, flags, expected, tmp_path):
    """CONVEYOR_TIMEOUT and the like set where `conveyor launch` runs reach its processes
    (the launcher used to overwrite them with its own defaults: a 300 s timeout)."""
    script = ("import os\nopen(os.path.join(os.environ['OUT'], os.environ['RANK']), 'w').write(' '.join(os.environ[k] "
              "for k in ['CONVEYOR_TIMEOUT', 'CONVEYOR_SCHEDULE', 'CONVEYOR_TRANSPORT', 'CONVEYOR_REPLAN']))\n")
    args = ["-n", 1]
    if config is not None:
        (tmp_path / "job.toml").write_text("[job]\n" + config)
        args = ["--config", tmp_path / "job.toml"]
    environment = dict(env(), OUT=str(tmp_path), CONVEYOR_TIMEOUT="9", CONVEYOR_SCHEDULE="zb-h1",
                       CONVEYOR_TRANSPORT="nccl")
    r = subprocess.run([TOOL, "launch", *map(str, args + flags), "--", sys.executable, "-c", script], env=environment,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "0").read_text() == expected


@pytest.mark.parametrize("variable, value, expected", [
    ("CONVEYOR_TIMEOUT", "soon", 'CONVEYOR_TIMEOUT="soon" in the environment: expected a number of seconds'),
    ("CONVEYOR_TIMEOUT", "0", 'CONVEYOR_TIMEOUT="0" in the environment: expected a number of seconds'),
    ("CONVEYOR_TRANSPORT", "tcp", 'CONVEYOR_TRANSPORT="tcp" in the environment: expected one of ucx, nccl'),
    ("CONVEYOR_REPLAN", "never", 'CONVEYOR_REPLAN="never" in the environment: expected one of auto, off')])
def test_a_bad_setting_in_the_environment_is_refused_naming_it(variable, value, expected):
    r = subprocess.run([TOOL, "launch", "-n", "1", "--", sys.executable, "-c", "pass"],
                       env=dict(env(), **{variable: value}), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert expected in r.stderr + r.stdout


@pytest.mark.parametrize("text, expected", [
    ('[job]\nprocesses = 2\nprocesess = 3\n', "job.toml:3: unknown key 'procesess' in [job]"),
    ('[job]\nprocesses = "two"\n', "job.toml:2: processes must be a whole number from 1 to 4096"),
    ('[job]\n\ntimeout = -1\n', "job.toml:3: timeout must be a number of seconds from 0.001 to 604800"),
    ('[job]\ntimeout = 1e300\n', "job.toml:2: timeout must be a number of seconds from 0.001 to 604800"),
    ('[job]\nmaster_addr = "1 parsec"\n', 'job.toml:2: master_addr = "1 parsec" is not a host name or address'),
    ('[job]\nschedule = "fast"\n', 'job.toml:2: schedule = "fast" (expected one of auto, gpipe, 1f1b, interleaved, zb-h1, zb-v)'),
    ('[job]\ntransport = "tcp"\n', 'job.toml:2: transport = "tcp" (expected one of ucx, nccl)'),
    ('[job]\nplan = "missing.json"\n', 'job.toml:2: plan = "missing.json": no such readable file'),
    ('[job]\nhosts = []\n', "job.toml:2: hosts must be a non-empty list"),
    ('[job]\nreplan = "sometimes"\n', 'job.toml:2: replan = "sometimes" (expected one of auto, off)'),
    ('[job]\nreplan_horizon = 0\n', "job.toml:2: replan_horizon must be a whole number from 1 to 1000000000"),
    ('[jobs]\n', "job.toml:1: unknown key 'jobs' in the job config"),
    ('[job]\nsecret = "a\\u0000bcdefghijklmnopq"\n', "job.toml:2: secret must not hold a NUL character"),
    ('[job\n', "job.toml:1: not valid TOML"),
])
def test_a_bad_job_config_is_refused_naming_the_line(text, expected, tmp_path):
    config = tmp_path / "job.toml"
    config.write_text(text)
    code, out = launch("--config", config, "--", sys.executable, "-c", "pass", timeout=60)
    assert code != 0
    assert expected.split(": ", 1)[1].split(" (")[0] in out, out
    assert "job.toml:" + expected.split(":")[1] in out, out


@pytest.mark.parametrize("flag, value", [("--timeout", "nan"), ("--grace", "nan"), ("--timeout", "0"),
                                         ("--timeout", "1e9")])
def test_a_bad_number_of_seconds_on_the_command_line_is_refused_naming_it(flag, value):
    code, out = launch(flag, value, "-n", 1, "--", sys.executable, "-c", "pass", timeout=30)
    assert code != 0
    assert f"expected a number of seconds from 0.001 to 604800, not '{value}'" in out, out


def test_launch_without_a_command_says_how_to_give_one():
    code, out = launch("-n", 2, timeout=30)
    assert code == 2
    assert "write the command after --" in out


@pytest.mark.parametrize("variables", [
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
    {"PMI_RANK": "1", "PMI_SIZE": "4"},
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "4"},
])
def test_mpirun_and_srun_ranks_are_read_when_rank_and_world_size_are_unset(variables):
    script = ("from conveyor import distributed\nprint(distributed.world())\n")
    e = env()
    e.update(variables, MASTER_ADDR="10.0.0.1", MASTER_PORT="1234")
    r = subprocess.run([sys.executable, "-c", script], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "(1, 4, '10.0.0.1', 1234)"


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_a_stopped_process_is_named_within_the_timeout(tmp_path):
    """Process 1 stops (SIGSTOP: hung, not dead) before its second step: process 0 fails
    after the 8 s timeout naming it, and the launcher stops the job."""
    start = time.monotonic()
    code, out = launch("-n", 2, "--timeout", 8, "--grace", 2, "--", sys.executable, WORKER, "--case", "mlp",
                       "--stages", 2, "--steps", 3, "--stop-at-step", 1, "--out", tmp_path / "x.pt", timeout=120)
    assert code != 0, out
    assert "process 1 does not answer (stopped or hung)" in out, out[-3000:]
    assert time.monotonic() - start < 90


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_when_process_0_finds_no_plan_every_process_says_why(tmp_path):
    """A cluster with too little memory: process 0's planner refuses, and process 1, which
    waits for the plan, raises the same refusal at once (not after the job's timeout)."""
    cluster = tmp_path / "tiny.toml"
    cluster.write_text('name = "tiny"\n[[node]]\ndevices = 2\nmemory = "1 KiB"\nspeed = 1.0\n'
                       '[link.intra_node]\nbandwidth = "10 GB/s"\nlatency = "5 us"\n')
    start = time.monotonic()
    code, out = launch("-n", 2, "--", sys.executable, WORKER, "--cluster", cluster, "--out", tmp_path / "two.pt")
    assert code != 0
    # Whichever process the launcher hears from first; the other is stopped then.
    assert ("DoesNotFitError: process 0 found no plan: no plan fits" in out
            or "DoesNotFitError: no plan fits" in out), out[-4000:]
    assert time.monotonic() - start < 60, "the refusal waited for a timeout"


def test_hosts_addresses_and_world_size_are_checked_however_given(tmp_path):
    """Flags are checked as a job config's are, and the world size cannot overflow: 2,048
    processes on each of 1,048,577 hosts launched with RANK=-2147483648 before."""
    hosts = tmp_path / "many_hosts.toml"
    hosts.write_text("[job]\nprocesses = 2048\nmaster_port = 5\nhosts = [" + ",".join(['"h"'] * 1048577) + "]\n")
    for args, says in [(["--config", hosts], "make 2147485696 processes; a job has 1 to 1048576"),
                       (["-n", 2, "--hosts", "a;rm -rf x,b", "--master-port", 5], "host 'a;rm -rf x' is not a host name"),
                       (["-n", 2, "--master-addr", "\x1b[31mx"], "master address '?[31mx' is not a host name")]:
        code, out = launch(*args, "--", sys.executable, "-c", "pass", timeout=60)
        assert code == 2 and says in out, out
