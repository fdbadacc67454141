"""The NCCL backend (transport/nccl.h). Loading NCCL and making unique ids need no GPU and run
everywhere torch brings NCCL; groups need a GPU: 1-member groups (the only kind one GPU can
hold) run every collective for real, and a 1-process job makes its group through the
process group. Without a GPU the group's error is checked instead."""

import pytest
import torch

from conftest import free_port
from conveyor import _C
from conveyor.errors import ConveyorError

NCCL_OK, NCCL_TEXT = _C.nccl_status()
needs_nccl = pytest.mark.skipif(not NCCL_OK, reason=f"NCCL cannot be loaded here: {NCCL_TEXT}")
needs_gpu = pytest.mark.skipif(not (NCCL_OK and torch.cuda.is_available()), reason="needs a CUDA GPU and NCCL")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without a GPU")


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@needs_nccl
def test_nccl_reports_its_version_and_makes_unique_ids():
    assert NCCL_TEXT.startswith("NCCL 2."), NCCL_TEXT
    major, minor = (int(x) for x in NCCL_TEXT.split()[1].split(".")[:2])
    assert (major, minor) >= (2, 18)
    a, b = _C.nccl_unique_id(), _C.nccl_unique_id()
    assert len(a) == 128 and len(b) == 128 and a != b


@needs_nccl
@no_gpu
def test_a_group_without_a_gpu_says_so():
    with pytest.raises(ConveyorError, match="NCCL needs a GPU"):
        _C.NcclGroup(0, 1, _C.nccl_unique_id(), "cuda:0")


@needs_nccl
def test_a_group_refuses_bad_arguments():
    with pytest.raises(ConveyorError, match="CUDA devices, not cpu"):
        _C.NcclGroup(0, 1, _C.nccl_unique_id(), "cpu")
    with pytest.raises(ConveyorError, match="rank 1 of 1"):
        _C.NcclGroup(1, 1, _C.nccl_unique_id(), "cuda:0")
    with pytest.raises(ConveyorError, match="not 5"):
        _C.NcclGroup(0, 1, b"short", "cuda:0")


@pytest.fixture
def one_process_job():
    """A job of one process (its rendezvous on loopback), closed after the test."""
    if _C.ucx_status():
        pytest.skip(f"UCX cannot start here: {_C.ucx_status()}")
    job = _C.ProcessGroup(0, 1, "127.0.0.1", free_port(), "nccl-test", 60.0)
    yield job
    job.close()


@needs_nccl
@no_gpu
def test_a_job_without_gpus_cannot_make_its_nccl_group(one_process_job):
    with pytest.raises(ConveyorError, match="cannot join an NCCL group"):
        one_process_job.nccl("cpu")
    with pytest.raises(ConveyorError, match="NCCL needs a GPU"):
        one_process_job.nccl("cuda:0")
    with pytest.raises(ConveyorError, match="cannot join an NCCL group of processes 0"):
        one_process_job.nccl_subgroup([0], "cpu")
    with pytest.raises(ConveyorError, match="distinct processes of the job"):
        one_process_job.nccl_subgroup([0, 0], "cpu")


def one_member_group():
    return _C.NcclGroup(0, 1, _C.nccl_unique_id(), "cuda:0", timeout_s=60.0)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_every_collective_on_one_member(dtype):
    group = one_member_group()
    assert (group.rank, group.size, group.device) == (0, 1, "cuda:0")
    x = (torch.arange(1000, device="cuda") % 97).to(dtype)
    # Written on the current stream just before: the group's stream must wait for it.
    y = x * 3
    want = (torch.arange(1000, device="cuda") % 97).to(dtype) * 3
    group.allreduce(y)
    assert torch.equal(y, want)
    group.reduce(y, 0)
    assert torch.equal(y, want)
    group.broadcast(y, 0)
    assert torch.equal(y, want)
    out = torch.empty_like(y)
    group.allgather(y, out)
    assert torch.equal(out, want)
    out2 = torch.zeros_like(y)
    group.reduce_scatter(y, out2)
    assert torch.equal(out2, want)


@needs_gpu
def test_point_to_point_exchange_with_itself_moves_every_tensor_in_order():
    """What a lane between processes does (ncclSend/ncclRecv grouped), on the one member one
    GPU can hold: several tensors of several dtypes, bools included, written on the current
    stream just before; a send alone or a receive alone is refused by nothing but NCCL's
    matching, so the self exchange pairs them in one group."""
    group = one_member_group()
    base = torch.arange(1 << 16, device="cuda")
    send = [(base * 3).float().view(256, 256), (base % 2).bool()[:1000], base.double()[:7], (base * 5)[:0]]
    recv = [torch.empty_like(t) for t in send]
    group.exchange(send, 0, recv, 0)
    for a, b in zip(send, recv):
        assert torch.equal(a, b)
    group.exchange([], 0, [], 0)  # nothing to move: completes
    with pytest.raises(ConveyorError, match="contiguous"):
        group.exchange([torch.ones(4, 4, device="cuda").t()], 0, [torch.empty(16, device="cuda")], 0)
    with pytest.raises(ConveyorError, match="must be a member"):
        group.exchange([torch.ones(4, device="cuda")], 1, [torch.empty(4, device="cuda")], 1)


@needs_gpu
def test_a_group_refuses_what_nccl_cannot_do_and_fails_after_abort():
    group = one_member_group()
    with pytest.raises(ConveyorError, match="cannot sum Bool"):
        group.allreduce(torch.ones(4, dtype=torch.bool, device="cuda"))
    group.broadcast(torch.ones(4, dtype=torch.bool, device="cuda"), 0)  # moving bools is fine
    with pytest.raises(ConveyorError, match="contiguous"):
        group.allreduce(torch.ones(4, 4, device="cuda").t()[1])
    with pytest.raises(ConveyorError, match="live on cuda:0"):
        group.allreduce(torch.ones(4))
    with pytest.raises(ConveyorError, match="out must hold 1 times"):  # one member: out is in
        group.allgather(torch.ones(4, device="cuda"), torch.ones(8, device="cuda"))
    group.abort("a member was lost")
    with pytest.raises(ConveyorError, match="a member was lost"):
        group.allreduce(torch.ones(4, device="cuda"))


@needs_gpu
def test_a_one_process_job_makes_nccl_subgroups_in_order(one_process_job):
    """What a stage whose replicas span processes sums its gradients in (transport nccl)."""
    first = one_process_job.nccl_subgroup([0], "cuda:0")
    second = one_process_job.nccl_subgroup([0], "cuda:0")  # a group of its own, not the first again
    for group in (first, second):
        assert (group.rank, group.size) == (0, 1)
        t = torch.arange(4096, dtype=torch.float64, device="cuda")
        group.allreduce(t)
        assert torch.equal(t, torch.arange(4096, dtype=torch.float64, device="cuda"))


@needs_gpu
def test_a_one_process_job_makes_its_nccl_group(one_process_job):
    group = one_process_job.nccl("cuda:0")
    t = torch.full((1 << 20,), 2.0, device="cuda")
    group.allreduce(t)
    assert torch.equal(t, torch.full_like(t, 2.0))
    assert one_process_job.nccl("cuda:0").device == "cuda:0"  # made once


@needs_gpu
def test_a_member_whose_peers_never_join_gives_up_within_the_timeout_naming_the_group():
    """Member 0 of a group of 2 whose member 1 never comes: NCCL's join would wait forever;
    conveyor's gives up after the timeout with an error naming the group. In a process of its
    own: NCCL's join thread stays behind, blocked, until that process exits."""
    import subprocess
    import sys
    import time
    code = (
        "import sys, time, torch\n"
        "from conveyor import _C\n"
        "start = time.monotonic()\n"
        "try:\n"
        "    _C.NcclGroup(0, 2, _C.nccl_unique_id(), 'cuda:0', timeout_s=2.0)\n"
        "except Exception as e:\n"
        "    print(f'{time.monotonic() - start:.1f}', e)\n"
        "    sys.exit(3)\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    waited, _, message = done.stdout.partition(" ")
    assert 2.0 <= float(waited) < 10.0, done.stdout
    assert "joining a group of 2 as member 0 on cuda:0" in message, message
    assert "did not all join within 2000 ms" in message, message
    assert time.monotonic() - start < 60
