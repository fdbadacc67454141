"""The benchmarks' way of running a job of processes on this machine (two by default): a
worker command started once per RANK with WORLD_SIZE and a free MASTER_PORT on loopback,
the cores shared out among them, waited for, and killed if still running when something
fails."""
import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(cmd: list, timeout: float, what: str, processes: int = 2, **env_extra) -> list[str]:
    """Each process's output (stdout and stderr); exits naming `what` when one fails."""
    port, cores = free_port(), os.cpu_count() or 2
    procs, outputs = [], []
    try:
        for rank in range(processes):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), UCX_NET_DEVICES="lo", OMP_NUM_THREADS=str(max(1, cores // processes)))
            env.update(env_extra)  # the caller's settings win (OMP_NUM_THREADS among them)
            env.pop("LOCAL_RANK", None)
            procs.append(subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    if any(p.returncode for p in procs):
        sys.exit(f"{what}: a process failed (exits {[p.returncode for p in procs]}):\n" +
                 "\n".join(f"-- process {rank}:\n{out[-3000:]}" for rank, out in enumerate(outputs)))
    return outputs


def process_status(field: str) -> int:
    """A byte figure of this process's /proc/self/status (VmHWM, VmRSS, VmData)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def launch_workers(script: str, args, out: str, **env_extra) -> None:
    """`script --worker --out OUT` with `args` (an argparse namespace: every option passed on)
    under `conveyor launch -n args.processes`, profiles cached under OUT; exits if it fails."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tool = os.path.join(os.environ.get("CONVEYOR_BUILD_DIR", os.path.join(root, "build")), "tools", "conveyor")
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("worker", "out") and not isinstance(v, bool)]
    argv += [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if v is True and k != "worker"]
    env = dict(os.environ, CONVEYOR_CACHE_DIR=os.path.join(out, "cache"), UCX_NET_DEVICES="lo", **env_extra)
    run = subprocess.run([tool, "launch", "-n", str(args.processes), "--", sys.executable, os.path.abspath(script),
                          "--worker", "--out", out, *argv], env=env)
    if run.returncode != 0:
        sys.exit(f"the job failed (exit {run.returncode})")
