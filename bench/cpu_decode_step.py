"""The CPU decode step (issue 17), three ways in one process, interleaved: every layer in one C call
(models/dense_cpu.c, what the executor runs), the torch layers with the attention read in place off the pages
(paged_cpu.c), and the torch layers with the gathered copy and SDPA. Process CPU time per step, which a shared
machine's load distorts least, and wall time beside it.

    python bench/cpu_decode_step.py [--contexts 40,540] [--concurrency 1,4] [--steps 32] [--threads 1]

SmolLM2's GGUF (packed weights), rows of `context` stored positions on pages in a shuffled order, the same
steps run by each arm in turn (rounds alternated), greedy tokens fed back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common import commit_hash, write_json
from executor_svc.attention.torch_ref import TorchDecode
from executor_svc.kv_pool import KVPool
from executor_svc.models.loader import load_model
from protos.model_files import default_model_path

PAGE_SIZE = 16


def step_times(
    model, attention: TorchDecode, context: int, batch: int, steps: int, c_step: bool
) -> tuple[float, float]:
    """CPU and wall ms per step of `steps` decode steps of `batch` rows from `context` stored positions;
    `c_step` False: the torch layers (the model's C step set aside for this pool)."""
    model.cpu_layers = None if c_step else (attention.kv, None)
    width = -(-(context + steps) // PAGE_SIZE)
    pages = torch.randperm(attention.kv.num_pages - 1)[: batch * width] + 1
    tables = pages.view(batch, width).to(torch.int32)
    tokens = torch.full((batch,), 42, dtype=torch.int64)
    cpu, wall = time.process_time(), time.perf_counter()
    for step in range(steps):
        kv_lens = torch.full((batch,), context + step, dtype=torch.int32)
        inputs = attention.over(tokens, kv_lens.long(), kv_lens, tables)
        tokens = model.forward(inputs, attention).argmax(-1)
    return (time.process_time() - cpu) * 1e3 / steps, (time.perf_counter() - wall) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[40, 540])
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/bench/cpu_decode_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(default_model_path(), "cpu", torch.float32)
    cfg = model.config
    need = max(args.concurrency) * -(-(max(args.contexts) + args.steps) // PAGE_SIZE)
    kv = KVPool(cfg.num_layers, need + 1, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    kv.k.normal_(), kv.v.normal_()  # stored K/V as if a prompt had been read: only the cost is measured
    # arm -> (attention, C step)
    arms = {
        "C step": (TorchDecode(None, kv, model.scale, model.config.max_seq_len), True),
        "torch, in place": (TorchDecode(None, kv, model.scale, model.config.max_seq_len), False),
        "torch, gathered": (TorchDecode(None, kv, model.scale, model.config.max_seq_len), False),
    }
    assert arms["C step"][0].in_place, "the paged_cpu kernel does not build here"
    arms["torch, gathered"][0].in_place = False
    results = []
    for context in args.contexts:
        for batch in args.concurrency:
            runs: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
            step_times(model, arms["C step"][0], context, batch, 2, True)  # warm-up
            for _ in range(args.rounds):
                for arm, (attention, c_step) in arms.items():
                    runs[arm].append(step_times(model, attention, context, batch, args.steps, c_step))
            for arm, times in runs.items():
                cpu_ms = statistics.median(t[0] for t in times)
                wall_ms = statistics.median(t[1] for t in times)
                results.append(
                    {
                        "arm": arm,
                        "context": context,
                        "concurrency": batch,
                        "cpu_ms_per_step": round(cpu_ms, 2),
                        "wall_ms_per_step": round(wall_ms, 2),
                        "threads": args.threads,
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                        "commit": commit_hash(),
                    }
                )
                print(
                    f"context {context:4d} c={batch}  {arm:15s} {cpu_ms:6.2f} ms CPU / step  "
                    f"({wall_ms:6.2f} ms wall)  load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
