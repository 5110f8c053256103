"""The Qwen3.5 hybrid's eager prefill step on the GPU, the whole model as the executor runs it (PrefillGraphs'
eager path: the batch packed, the state slots, the forward over the prefill attention kernel): Qwen3.5-0.8B's
shape with random bf16 weights, N fresh sequences of L tokens a step. Reports the host's time to issue the step
(no wait at its end), the wall time to its end, the GPU's kernel time and launches, the kernels taking most of
it, and the argmax of each sequence's last logits (to compare two commits' outputs); `--profile` prints where
the host's time goes, `--graph` adds the step replayed from a prefill graph of its size (or of `--graph-tokens`,
the padding a step of bench/decode.py's c = 64 gets with `--shapes 11x512 --graph-tokens 8192 --graph-widest 64`).

    python bench/hybrid_prefill.py --graph --commit X --out docs/bench/hybrid_prefill.json
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, write_json
from bench.hybrid_step import random_model
from executor_svc.attention.prefill import PrefillAttention
from executor_svc.models.qwen3_5_model import Qwen35Model
from executor_svc.prefill.batch import PrefillBatch
from executor_svc.state_pool import StateInputs

PAGE = 16
GRAPH_MAX_SEQ_LEN = 1024  # bench/decode_model.py's MAX_SEQ_LEN
TOP_KERNELS = 15  # kernel names reported by GPU time


def prefill_step(model: Qwen35Model, kv, pool, chunks: list, slots: np.ndarray) -> torch.Tensor | None:
    """One eager prefill step of `chunks`, as PrefillGraphs._eager runs it: the last token's logits of each."""
    device = model.device
    batch = PrefillBatch.build(chunks, PAGE, model.config.max_seq_len, device)
    attention = PrefillAttention(kv, model.scale, batch, fused=True)
    on_device = torch.from_numpy(slots).pin_memory().to(device, non_blocking=True)
    states = StateInputs(pool, on_device, batch.seq_starts_host, slots, batch.starts == 0)
    with torch.inference_mode():
        return model.forward(batch.inputs._replace(states=states), attention, select=batch.last_index)


def replayed(
    model: Qwen35Model,
    kv,
    pool,
    chunks: list,
    slots: np.ndarray,
    rounds: int,
    bucket: int | None,
    widest: int,
) -> dict:
    """The same step replayed from a prefill graph (PrefillGraphs.launch: the batch and its state index laid
    out, one replay) of `bucket` tokens (None: the step's) beside decode buckets up to `widest` rows (which bound
    the graph's sequences): host and wall ms, and the argmax it samples."""
    from executor_svc.prefill.graphs import PrefillGraphs
    from executor_svc.slot_store import GREEDY, SlotStore
    from protos.layout import RowLayout

    cfg, n = model.config, len(chunks)
    # an executor's context as bench/decode.py serves it: the graph's block tables are that wide (the model's
    # own 262,144 tokens would lay out 16,384 pages a chunk each step)
    max_seq_len = GRAPH_MAX_SEQ_LEN
    store = SlotStore(
        RowLayout.build([max(n, widest)], max_seq_len, PAGE, kv.num_pages), model.device, cfg.vocab_size
    )
    tokens = sum(len(ids) for ids, _, _ in chunks)
    if bucket is not None and bucket < tokens:
        return {"graph": f"the step's {tokens} tokens do not fit a {bucket}-token bucket"}
    bucket = bucket or tokens
    graphs = PrefillGraphs(model, kv, store, [bucket], max_seq_len=max_seq_len, state_pool=pool)
    if graphs.states.get(bucket) != "captured":
        return {"graph": graphs.states.get(bucket, "off")}
    host, wall = [], []
    for _ in range(rounds + 3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        sampled = graphs.launch(chunks, list(slots), GREEDY, list(slots))
        host.append((time.perf_counter() - began) * 1000)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - began) * 1000)
    assert sampled is not None
    return {
        "graph_host_ms": round(float(np.median(host[3:])), 3),
        "graph_wall_ms": round(float(np.median(wall[3:])), 3),
        "graph_argmax": sampled[0].tolist(),
    }


def top_kernels(kernels: list, count: int) -> list[dict]:
    """The `count` kernel names taking the most GPU time of a profiled step: total µs and launches each."""
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        by_name.setdefault(event.name, []).append(event.time_range.elapsed_us())
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:count]
    return [
        {"kernel": name[:120], "us": round(sum(times), 1), "launches": len(times)} for name, times in ranked
    ]


def measure(model: Qwen35Model, sequences: int, tokens: int, args: argparse.Namespace) -> dict:
    rounds = args.rounds
    cfg = model.config
    span = -(-tokens // PAGE)
    kv = model.make_kv_pool(sequences * span + 1, PAGE)
    pool = model.make_state_pool(sequences + 1)
    rng = np.random.default_rng(0)
    chunks = [
        (
            rng.integers(0, cfg.vocab_size, tokens),
            0,
            np.arange(1 + i * span, 1 + (i + 1) * span, dtype=np.int64),
        )
        for i in range(sequences)
    ]
    slots = np.arange(1, sequences + 1, dtype=np.int64)
    for _ in range(3):
        prefill_step(model, kv, pool, chunks, slots)
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(rounds):
        began = time.perf_counter()
        logits = prefill_step(model, kv, pool, chunks, slots)
        host.append((time.perf_counter() - began) * 1000)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - began) * 1000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        prefill_step(model, kv, pool, chunks, slots)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    row = {
        "sequences": sequences,
        "tokens": tokens,
        "host_ms": round(float(np.median(host)), 3),
        "wall_ms": round(float(np.median(wall)), 3),
        "gpu_kernel_ms": round(sum(e.time_range.elapsed_us() for e in kernels) / 1000, 3),
        "gpu_kernels": len(kernels),
        "gpu_top_kernels": top_kernels(kernels, TOP_KERNELS),
        "argmax": logits.argmax(-1).tolist() if logits is not None else None,
        "fell_back": bool(getattr(model._prefill, "failed", False)),
    }
    print(row, flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        prefill_step(model, kv, pool, chunks, slots)
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.graph:
        row.update(replayed(model, kv, pool, chunks, slots, rounds, args.graph_tokens, args.graph_widest))
        print(row, flush=True)
    del kv, pool
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["1x512", "4x512", "16x128"], help="sequences x tokens of a step"
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one step per shape")
    parser.add_argument("--graph", action="store_true", help="also the step replayed from a prefill graph")
    parser.add_argument(
        "--graph-tokens", type=int, default=None, help="the graph's token bucket (default: the step's tokens)"
    )
    parser.add_argument(
        "--graph-widest",
        type=int,
        default=1,
        help="the widest decode bucket beside it (default: the step's sequences)",
    )
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--out", default="docs/bench/hybrid_prefill.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = random_model()
    rows = []
    for shape in args.shapes:
        sequences, tokens = (int(x) for x in shape.split("x"))
        rows.append(measure(model, sequences, tokens, args))
    write_json(
        args.out,
        [{"commit": args.commit or commit_hash(), "device": torch.cuda.get_device_name(), "steps": rows}],
    )


if __name__ == "__main__":
    main()
