"""One benchmark program of this tree against the same program of another commit (a
worktree, built), in one run: rounds alternate old, new, old, new, ... so that the
machine's noise hits both alike; every figure of the lines that match --lines is reported as
the median over the rounds, with the spread, and new / old.

    git worktree add /tmp/old <commit> && (cd /tmp/old && ./run build)
    ./run bench against_commit --old /tmp/old --rounds 3 pipeline_cpu
    ./run bench against_commit --old /tmp/old --rounds 3 --lines 'ms/step|ratio' multiproc

Each side runs its own commit's bench/NAME.py on its own build (the old tree's build/ unless
--old-build names another).
"""
import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_once(source: pathlib.Path, build: pathlib.Path, name: str, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=f"{source / 'bindings'}:{build / 'bindings'}:{source / 'bench'}",
               CONVEYOR_BUILD_DIR=str(build), CONVEYOR_ROOT=str(source), PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, str(source / "bench" / f"{name}.py"), *args], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed in {source}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def figures(output: str, keep: re.Pattern) -> dict[str, list[float]]:
    """Per matching line, its text with the numbers blanked (the key, after the section
    heading it falls under: the last line ending in ':' without numbers) and its numbers."""
    out, section = {}, ""
    for line in output.splitlines():
        if line.rstrip().endswith(":") and not NUMBER.search(line):
            section = line.strip()
        elif keep.search(line) and NUMBER.search(line):
            key = (section + " " if section else "") + NUMBER.sub("#", line.strip())
            out.setdefault(key, [float(x) for x in NUMBER.findall(line)])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the other commit's source tree (a git worktree)")
    ap.add_argument("--old-build", default="", help="its build directory (default: OLD/build)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lines", default="ratio|measured|ms/step|ms ", help="regex: the output lines compared")
    ap.add_argument("name", help="the bench program (bench/NAME.py)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = ap.parse_args()
    old = pathlib.Path(a.old).resolve()
    sides = {"old": (old, pathlib.Path(a.old_build).resolve() if a.old_build else old / "build"),
             "new": (ROOT, pathlib.Path(os.environ.get("CONVEYOR_BUILD_DIR", ROOT / "build")).resolve())}
    keep = re.compile(a.lines)
    seen: dict[str, dict[str, list[list[float]]]] = {"old": {}, "new": {}}
    for r in range(a.rounds):
        for side, (source, build) in sides.items():
            print(f"round {r + 1}/{a.rounds}: {side} ({source})", flush=True)
            for key, numbers in figures(run_once(source, build, a.name, a.args), keep).items():
                seen[side].setdefault(key, []).append(numbers)
    print(f"\n{a.name}: median over {a.rounds} rounds (min-max), old = {old}, new = {ROOT}")
    for key, runs_new in seen["new"].items():
        runs_old = seen["old"].get(key)
        if not runs_old:
            continue
        parts = []
        for k in range(min(len(runs_new[0]), len(runs_old[0]))):
            o = [run[k] for run in runs_old if k < len(run)]
            n = [run[k] for run in runs_new if k < len(run)]
            mo, mn = statistics.median(o), statistics.median(n)
            ratio = f"{mn / mo:.3f}" if mo else "-"
            parts.append(f"{mo:g} ({min(o):g}-{max(o):g}) -> {mn:g} ({min(n):g}-{max(n):g}) new/old {ratio}")
        print(f"  {key}\n    " + "\n    ".join(parts))


if __name__ == "__main__":
    main()
