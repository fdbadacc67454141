"""conveyor's NCCL backend on one GPU against torch.distributed's NCCL, in one run:

1. Allreduce time of a 1-member group from 1 MiB to 256 MiB: conveyor's NcclGroup (its own
   stream, waits for the caller's stream by an event, returns once the kernel is done)
   against torch.distributed.all_reduce on a 1-rank NCCL process group followed by a
   synchronize (the ratio: torch's time / conveyor's).
2. Overlap: matrix products queued on one stream while allreduces run on the group's
   stream; (compute alone + allreduces alone - both together) / the shorter of the two is
   the share of the shorter one hidden behind the other (1 is perfect overlap).

A 1-member group moves no data between GPUs, so the times measure launch and kernel
overheads, not NCCL's bandwidth; several GPUs in several processes are needed for that.

    ./run bench nccl [--iters 20] [--max-mib 256]
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch

from conveyor import _C


def timed(fn, iters: int) -> float:
    fn()  # warm up
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-mib", type=int, default=256)
    args = ap.parse_args()
    ok, text = _C.nccl_status()
    if not ok:
        print(f"nccl: NCCL cannot be loaded here ({text}); nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print(f"nccl: {text} loads, but this machine has no GPU; nothing to measure")
        return 0
    print(f"{text} on {torch.cuda.get_device_name(0)}")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    group = _C.NcclGroup(0, 1, _C.nccl_unique_id(), "cuda:0")

    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))

    print("\n1. allreduce, 1-member group (median of", args.iters, "iterations)")
    print(f"{'size':>10} {'conveyor':>12} {'torch':>12} {'ratio':>8}")
    mib = 1
    while mib <= args.max_mib:
        t = torch.ones(mib << 18, device="cuda")  # float32: mib MiB
        ours = timed(lambda: group.allreduce(t), args.iters)
        theirs = timed(lambda: dist.all_reduce(t), args.iters)
        print(f"{mib:>7} MiB {ours * 1e6:>9.1f} us {theirs * 1e6:>9.1f} us {theirs / ours:>7.3f}x")
        mib *= 4

    print("\n2. allreduce overlapping compute on another stream")
    a = torch.randn(4096, 4096, device="cuda")
    grad = torch.ones(64 << 18, device="cuda")  # 64 MiB
    side = torch.cuda.Stream()

    def compute():
        with torch.cuda.stream(side):
            for _ in range(8):
                a @ a

    def reduce():
        for _ in range(8):
            group.allreduce(grad)

    def both():
        compute()  # queued, not waited for
        reduce()

    t_compute = timed(compute, args.iters)
    t_reduce = timed(reduce, args.iters)
    t_both = timed(both, args.iters)
    hidden = (t_compute + t_reduce - t_both) / min(t_compute, t_reduce)
    print(f"compute alone {t_compute * 1e3:.2f} ms, allreduces alone {t_reduce * 1e3:.2f} ms, "
          f"together {t_both * 1e3:.2f} ms: overlap {hidden:.2f} of the shorter")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
