"""Device diagnostic (not in the repo): ours (defaults) against the SyncVectorEnv loop on CartPole x8."""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
torch.set_num_threads(1)
from benchmarks import scenarios  # noqa: E402

sc = scenarios.SCENARIOS["cheap"]
w = sc.workload(False)
NAMES = ["threaded auto (defaults)", "gym SyncVectorEnv loop", "threaded env_time ept=8"]


def rate(name: str, frames: int = 20_480, reps: int = 3) -> float:
    s = sc.contenders[name](w)
    try:
        s.run(w.frames_per_batch * 2)
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            got = s.run(frames)
            out.append(got / (time.perf_counter() - t0))
        return statistics.median(out)
    finally:
        s.close()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "compare":
        for r in range(2):
            print(" | ".join(f"{n}: {rate(n):,.0f}" for n in NAMES), flush=True)
    else:
        name = NAMES[0] if mode == "ours" else NAMES[1]
        s = sc.contenders[name](w)
        s.run(w.frames_per_batch * 2)
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < float(sys.argv[2]):
            n += s.run(w.frames_per_batch)
        print(f"{name}: {n / (time.perf_counter() - t0):,.0f} steps/s", flush=True)
        s.close()
