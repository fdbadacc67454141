"""conveyor.distributed side by side with torch.distributed on gloo, in one run: 2 processes
on this machine (or --processes N), host tensors (float32), the same calls a script split by
hand makes.

  send/recv   process 0 sends a stream of tensors (256 MB in all, at least 8) to process 1,
              which receives each; then one 8-byte message back. conveyor:
              conveyor.distributed.send / recv (the shape and dtype travel; the receiver gets a
              new tensor). gloo: torch.distributed isend for the stream then one wait each,
              recv into a buffer of the known shape (gloo needs it given).
  allreduce   a run of allreduces of one tensor (16 MB in all, at least 4) among every
              process: conveyor: conveyor.distributed.allreduce (differentiable: every process
              sends its tensor to every other and sums in process order; among 3 or more from
              4 MB, reduce_scatter then allgather); gloo: torch.distributed.all_reduce, in place.
  ping-pong   an 8-byte tensor back and forth (2,000 round trips): half a round trip, as a
              script whose processes hand each other small tensors in turn waits for each.
              conveyor: send / recv; gloo: send / recv into a buffer of the known shape.

Both groups join once; the contenders alternate in rounds (A B, then B A), process 0 times
each from a barrier to the stream's last reply, and the figures are medians over rounds with
their spread. Ratios are throughputs (above 1: conveyor faster).

send/recv and ping-pong run between processes 0 and 1 (any others wait at the barrier).

    ./run bench distributed [--rounds 5] [--sizes-kb 64,1024,16384,65536] [--processes 2]
"""
import argparse
import os
import statistics
import sys
import time

import torch

from job import free_port, run_job

STREAM_BYTES = 256 << 20
ALLREDUCE_BYTES = 16 << 20


def stream_length(nbytes: int) -> int:
    return max(8, STREAM_BYTES // nbytes)


def allreduce_count(nbytes: int) -> int:
    return max(4, ALLREDUCE_BYTES // nbytes)


def contenders(rank: int, nbytes: int):
    """(op, name) -> a function running one measured stream, every process calling it."""
    import torch.distributed as dist
    import conveyor.distributed as cd
    x = torch.ones(nbytes // 4)
    buf = torch.empty(nbytes // 4)
    ack = torch.zeros(2)
    n, k = stream_length(nbytes), allreduce_count(nbytes)

    def conveyor_stream():
        if rank == 0:
            for _ in range(n):
                cd.send(x, 1)
            cd.recv(1)
        elif rank == 1:
            for _ in range(n):
                cd.recv(0)
            cd.send(ack, 0)

    def gloo_stream():
        if rank == 0:
            for w in [dist.isend(x, 1) for _ in range(n)]:
                w.wait()
            dist.recv(ack, 1)
        elif rank == 1:
            for _ in range(n):
                dist.recv(buf, 0)
            dist.send(ack, 0)

    def conveyor_allreduce():
        for _ in range(k):
            cd.allreduce(x)

    def gloo_allreduce():
        y = x.clone()
        for _ in range(k):
            dist.all_reduce(y)

    return {("send/recv", "conveyor"): (conveyor_stream, n * nbytes),
            ("send/recv", "gloo"): (gloo_stream, n * nbytes),
            ("allreduce", "conveyor"): (conveyor_allreduce, k * nbytes),
            ("allreduce", "gloo"): (gloo_allreduce, k * nbytes)}


PING_PONGS = 2000


def ping_pong_contenders(rank: int):
    """name -> a function running PING_PONGS round trips of an 8-byte tensor."""
    import torch.distributed as dist
    import conveyor.distributed as cd
    x, buf = torch.zeros(2), torch.empty(2)
    other = 1 - rank

    def conveyor_ping_pong():
        for _ in range(PING_PONGS if rank < 2 else 0):
            if rank == 0:
                cd.send(x, other)
                cd.recv(other)
            else:
                cd.send(cd.recv(other), other)

    def gloo_ping_pong():
        for _ in range(PING_PONGS if rank < 2 else 0):
            if rank == 0:
                dist.send(x, other)
                dist.recv(buf, other)
            else:
                dist.recv(buf, other)
                dist.send(buf, other)

    return {"conveyor": conveyor_ping_pong, "gloo": gloo_ping_pong}


def worker(args):
    import torch.distributed as dist
    import conveyor.distributed as cd
    rank = int(os.environ["RANK"])
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.processes))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=rank,
                            world_size=args.processes)
    cd.rank()  # joins conveyor's group
    sizes = [int(s) << 10 for s in args.sizes_kb.split(",")]
    runs = {nbytes: contenders(rank, nbytes) for nbytes in sizes}
    ping_pongs = ping_pong_contenders(rank)
    for nbytes in sizes:  # each warmed up once, every process in the same order
        for run, _ in runs[nbytes].values():
            run()
    for run in ping_pongs.values():
        run()
    for r in range(args.rounds):
        for name in (["conveyor", "gloo"] if r % 2 == 0 else ["gloo", "conveyor"]):
            dist.barrier()
            start = time.perf_counter()
            ping_pongs[name]()
            elapsed = time.perf_counter() - start
            if rank == 0:
                print(f"LATENCY {name}\t{elapsed / PING_PONGS / 2 * 1e6}", flush=True)
        for nbytes in sizes:
            for op in ("send/recv", "allreduce"):
                order = ["conveyor", "gloo"] if r % 2 == 0 else ["gloo", "conveyor"]  # neither always first
                for name in order:
                    run, moved = runs[nbytes][(op, name)]
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    elapsed = time.perf_counter() - start
                    if rank == 0:
                        print(f"RESULT {op}\t{nbytes}\t{name}\t{moved / elapsed / 1e9}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes-kb", default="64,1024,16384,65536", help="message sizes in KB, comma-separated")
    ap.add_argument("--processes", type=int, default=2, help="processes in the job (allreduce runs among all)")
    ap.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.processes < 2:
        sys.exit("--processes: at least 2")
    outputs = run_job([sys.executable, __file__, "--worker", "--gloo-port", free_port(), *sys.argv[1:]], 1800,
                      "distributed", processes=args.processes)
    rates: dict[tuple, list[float]] = {}
    latencies: dict[str, list[float]] = {}
    for line in outputs[0].splitlines():
        if line.startswith("LATENCY "):
            name, us = line[len("LATENCY "):].split("\t")
            latencies.setdefault(name, []).append(float(us))
        if line.startswith("RESULT "):
            op, nbytes, name, rate = line[len("RESULT "):].split("\t")
            rates.setdefault((op, int(nbytes), name), []).append(float(rate))
    cores = os.cpu_count() or 2
    print(f"conveyor.distributed against torch.distributed (gloo): {args.processes} processes on {cores} cores, "
          "float32 host tensors (send/recv and ping-pong: processes 0 and 1); "
          f"GB/s of tensor data (allreduce: the tensor's bytes per call), median over {args.rounds} alternating "
          "rounds (min-max)")
    print(f"{'':10} {'bytes':>10} {'conveyor GB/s':>26} {'gloo GB/s':>26} {'ratio':>8}")
    for op in ("send/recv", "allreduce"):
        for nbytes in sorted({k[1] for k in rates}):
            ours, theirs = rates[(op, nbytes, "conveyor")], rates[(op, nbytes, "gloo")]
            a, b = statistics.median(ours), statistics.median(theirs)
            print(f"{op:10} {nbytes:>10} {a:>9.3f} ({min(ours):.3f}-{max(ours):.3f})".ljust(48) +
                  f"{b:>9.3f} ({min(theirs):.3f}-{max(theirs):.3f})".ljust(27) + f"{a / b:>7.2f}x")
    ours, theirs = latencies["conveyor"], latencies["gloo"]
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{'ping-pong':10} {8:>10} {a:>9.1f} us ({min(ours):.1f}-{max(ours):.1f})".ljust(51) +
          f"{b:>9.1f} us ({min(theirs):.1f}-{max(theirs):.1f})".ljust(27) + f"{b / a:>4.2f}x  (half a round trip)")


if __name__ == "__main__":
    main()
