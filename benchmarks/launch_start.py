"""How long does `pl.distributed.launch` take before the ranks' work, spawned against forked from a server?

A spawned rank is a new Python that imports torch and pipelab; since the forkserver change the ranks
are forked from a server that imported them once per launcher (runtime/launcher/forkserver.py).  Each
way runs in a fresh launcher process (PIPELAB_START_METHOD=spawn or unset): the first launch (the
server starts then), then the median of the next `--repeats` launches of a function that returns at
once, on 2 and on 4 ranks.  Prints the seconds and the ratio spawn / forked, measured in this one run.

    python benchmarks/launch_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

LAUNCHER = '''
import json, statistics, sys, time
import pipelab as pl

def nothing():
    return 0

if __name__ == "__main__":
    found = {}
    for nproc in (2, 4):
        times = []
        for _ in range(1 + int(sys.argv[1])):
            begin = time.perf_counter()
            pl.distributed.launch(nothing, nproc, timeout_seconds=120)
            times.append(time.perf_counter() - begin)
        found[nproc] = {"first": times[0], "median": statistics.median(times[1:])}
    print(json.dumps(found))
'''


def measure(method: str | None, repeats: int) -> dict:
    env = dict(os.environ)
    env.pop("PIPELAB_START_METHOD", None)
    if method:
        env["PIPELAB_START_METHOD"] = method
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(repeats)], env=env, capture_output=True, text=True,
                          timeout=600, check=True)
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spawned, forked = measure("spawn", args.repeats), measure(None, args.repeats)
    print(f"{os.cpu_count()} CPUs; seconds from launch() to its return, the ranks' work nothing")
    print("ranks  launch            spawned   forked   spawned / forked")
    for nproc in (2, 4):
        for which in ("first", "median"):
            a, b = spawned[nproc][which], forked[nproc][which]
            label = "first" if which == "first" else f"next ({args.repeats}, median)"
            print(f"{nproc:5}  {label:16} {a:8.2f} {b:8.2f} {a / b:12.1f}x")


if __name__ == "__main__":
    main()
