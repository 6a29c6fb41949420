"""How long the chapter-13 simulator takes at full scale: Llama-2 7B as rank 0 of 1,024, on meta tensors.

    python bench/simulate_speed.py [--model 7b] [--world-size 1024] [--strategies fsdp ...] [--repeat 3]

Times `simulate(...)` (building the model on the meta device, wrapping it, two training steps under the
fake process group, the meter and the counter on) and, for comparison, `python -m minifsdp simulate ...` as a
reader runs it (a fresh interpreter: importing torch included). The test suite runs the same simulation
with 2 layers instead of 32 (tests/test_ch13_simulate.py); this is where the full size is timed. The
chapter states its budget: under 60 s on a 2-core machine; it takes a few seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minifsdp.measure.simulate import Spec, simulate  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="7b")
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--strategies", nargs="+", default=["fsdp"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"| {args.model} at N = {args.world_size:,} | in this process: median of {args.repeat} (s) | the command, "
          f"with import (s) | peak per rank |\n|---|---|---|---|")
    for strategy in args.strategies:
        times, result = [], None
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = simulate(Spec(model=args.model, world_size=args.world_size, strategy=strategy))
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "minifsdp", "simulate", "--model", args.model, "--world-size",
                        str(args.world_size), "--strategy", strategy], check=True, stdout=subprocess.DEVNULL,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        command = time.perf_counter() - start
        peak = max(result["phases"][p]["total"] for p in ("peak of forward", "peak of backward",
                                                          "peak of optimizer step"))
        print(f"| {strategy} | {statistics.median(times):.1f} | {command:.1f} | {peak / 1e9:.2f} GB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
