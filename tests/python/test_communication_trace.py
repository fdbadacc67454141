"""conveyor.distributed's trace (conveyor/distributed/trace.py): a traced job writes one
trace of every process's communication, each message's send joined to where its receive's
wait ended and each gradient to where its sender's wait ended; the trace's bound and the
flows left without an end."""
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conveyor import _C
from conveyor.distributed import trace as tracing

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "distributed"
TOOL = Path(os.environ.get("CONVEYOR_BUILD_DIR", ROOT / "build")) / "tools" / "conveyor"

needs_ucx = pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")


def environment(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CONVEYOR_TRACE"):
        env.pop(k, None)
    return dict(env, **extra)


def launch(n: int, example: str, *launch_args, out: Path, env=None):
    r = subprocess.run([str(TOOL), "launch", "-n", str(n), *map(str, launch_args), "--", sys.executable,
                        str(EXAMPLES / f"{example}.py"), "--out", str(out)], env=env or environment(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stderr


@needs_ucx
def test_a_traced_pipeline_by_hand_has_every_message_and_gradient_joined(tmp_path):
    """1F1B written by hand over 3 processes, 3 steps of 4 microbatches, under `conveyor
    launch --trace`: per step stages 0 and 1 each send 4 activations (received by stages 1
    and 2) and get 4 gradients back, each stage runs 4 microbatch blocks, stages 0 and 1 a
    backward(microbatch=k) each, with a backward through each send."""
    path = tmp_path / "run.pftrace"
    err = launch(3, "one_f_one_b", "--trace", path, out=tmp_path)
    assert f"trace of 3 processes (228 slices) written to {path}" in err
    check = subprocess.run([str(TOOL), "trace", "check", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "3 tracks, 228 slices, 0 instants, 48 flows" in check.stdout  # 24 activations, 24 gradients
    families = dict(re.findall(r"^  (\w+)\s+(\d+) slices$", check.stdout, re.M))
    assert families == {"microbatch": "36", "send": "24", "recv": "24", "gradient": "48", "arrived": "48",
                        "backward": "48"}
    per_process = dict(re.findall(r"^  on '(process \d)'\s+(\d+) slices$", check.stdout, re.M))
    assert per_process == {"process 0": "72", "process 1": "108", "process 2": "48"}


@needs_ucx
def test_a_traced_job_in_chrome_json_draws_each_flow_from_its_send(tmp_path):
    """The channel-parallel CNN over 2 processes, traced by CONVEYOR_TRACE to a .json file:
    a process per track, its collectives around their messages, and each flow going from a
    send (or a gradient sent back) to the empty slice where the receiver's wait ended."""
    path = tmp_path / "cnn.json"
    launch(2, "channel_parallel_cnn", out=tmp_path, env=environment(CONVEYOR_TRACE=str(path)))
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {"process 0", "process 1"}
    open_slices: dict = {}
    flows: dict = {}
    calls = Counter()
    for e in events:
        where = (e["pid"], e.get("tid"))
        if e["ph"] == "B":
            open_slices.setdefault(where, []).append(e["name"])
            if e["name"] in ("allgather", "gather"):
                calls[e["name"]] += 1
        elif e["ph"] == "E":
            open_slices[where].pop()
        elif e["ph"] in "sf":
            flows.setdefault(e["id"], []).append((e["ph"], open_slices[where][-1], e["ts"]))
    assert calls == {"allgather": 6, "gather": 6}  # 3 steps, on each of the 2 processes
    assert flows
    for ends in flows.values():
        (start, sent, t0), (finish, arrived, t1) = ends
        assert (start, finish) == ("s", "f") and t0 <= t1
        assert sent.startswith(("send #", "gradient of recv #")), ends
        assert arrived.startswith("arrived: "), ends


def test_a_full_record_says_where_it_stopped_and_drops_flows_without_their_other_end(tmp_path, monkeypatch):
    """Past EVENTS_PER_PROCESS a process records nothing more, and its track says when it
    stopped; a send whose receive was not recorded draws no flow (the trace stays valid)."""
    monkeypatch.setattr(tracing, "EVENTS_PER_PROCESS", 2)
    sender, receiver = tracing.Recorder("unused"), tracing.Recorder("unused")
    with tracing.span(sender, tracing.SEND, 1, 0):
        pass
    with tracing.span(sender, tracing.SEND, 1, 1):
        pass
    with tracing.span(sender, tracing.SEND, 1, 2):  # past the bound
        pass
    with tracing.span(receiver, tracing.RECV, 0, 0):
        pass
    records = [{"rows": r.rows, "labels": list(r.labels), "full_at": r.full_at} for r in (sender, receiver)]
    assert len(sender.rows) == 2 and sender.full_at is not None and receiver.full_at is None
    path = tmp_path / "t.pftrace"
    assert tracing.write(str(path), records) == 4  # two sends; a receive and where it arrived
    check = subprocess.run([str(TOOL), "trace", "check", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "2 tracks, 4 slices, 1 instants, 1 flows" in check.stdout  # send #1's receive never came


def test_a_trace_into_a_missing_folder_is_refused_before_the_job_starts(tmp_path):
    r = subprocess.run([str(TOOL), "launch", "-n", "2", "--trace", str(tmp_path / "no" / "t.pftrace"), "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "its folder does not exist (make it first)" in r.stderr


@needs_ucx
def test_a_trace_asked_of_some_processes_only_is_not_written_saying_why(tmp_path):
    """init(trace=...) on process 0 alone: the job ends normally, no process waits for a
    record that never comes, and the one message names the processes that traced."""
    script = tmp_path / "some.py"
    script.write_text(
        "import sys, torch\n"
        "import conveyor.distributed as dist\n"
        f"dist.init(trace={str(tmp_path / 't.pftrace')!r} if int(sys.argv[1]) == 0 else None)\n"
        "if dist.rank() == 0:\n"
        "    dist.send(torch.ones(2), 1)\n"
        "else:\n"
        "    dist.recv(0)\n")
    r = subprocess.run([str(TOOL), "launch", "-n", "2", "--", "bash", "-c", f'{sys.executable} {script} $RANK'],
                       env=environment(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no trace written: processes [0] traced and [1] did not" in r.stderr
    assert r.stderr.count("no trace written") == 1
    assert not (tmp_path / "t.pftrace").exists()
