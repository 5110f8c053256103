"""bench/decode.py's report: the outputs' agreement between arms and rounds, and the plot of tok/s."""

from __future__ import annotations

import statistics

from bench.decode_arms import ARMS
from bench.decode_model import MODEL_SHAPES


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests whose whole outputs are equal, and the mean length of the common prefix."""
    same = sum(1 for x, y in zip(a, b) if x == y)
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"equal": same, "of": len(a), "mean_common_prefix": round(statistics.fmean(prefixes), 1)}


def plot(records: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for arm in ARMS:
        points = sorted(
            (r["concurrency"], r["tok_s"]) for r in records if r.get("arm") == arm and "tok_s" in r
        )
        if points:
            axes.plot(*zip(*points), marker="o", label=arm)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent requests")
    axes.set_ylabel("output tokens / s")
    gpu = next((r["gpu"] for r in records if "gpu" in r), "")
    shape = next((r["model_shape"] for r in records if "model_shape" in r), MODEL_SHAPES[0])
    axes.set_title(f"{shape} shape, bf16, 512 in / 256 out ({gpu})", fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
