"""The Qwen3.5 hybrid's decode step on the GPU, its torch-ops forward against its Triton-kernels forward
(qwen3_5_kernels) in the same run, both captured as CUDA graphs: Qwen3.5-0.8B's shape with random bf16 weights,
each row `--context` tokens deep, over the paged decode attention kernel the resident backend uses. Reports
the replayed step's time per arm and batch, and the kernel launches each arm's graph holds.

    python bench/hybrid_step.py --out docs/bench/hybrid_step.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, qwen3_5_0_8b_config, write_json
from executor_svc.attention import StepInputs
from executor_svc.kernels.attention import decode_splits, paged_decode_attention
from executor_svc.models.qwen3_5_model import Qwen35Model
from executor_svc.state_pool import StateInputs
from protos.layout import RowLayout

PAGE = 16


class PagedAttention:
    """The resident backend's paged decode kernel over a fixed rows table; `fused` picks the model's path."""

    def __init__(self, kv, rows, step_slots, scale: float, splits: int, fused: bool):
        self.kv, self.rows, self.step_slots, self.scale, self.splits, self.fused = (
            kv,
            rows,
            step_slots,
            scale,
            splits,
            fused,
        )
        self.counters = torch.zeros(len(step_slots) * kv.k.shape[3], dtype=torch.int32, device=rows.device)

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention(
            q,
            self.kv.k[layer],
            self.kv.v[layer],
            self.rows,
            self.step_slots,
            RowLayout.BLOCK_TABLE,
            PAGE,
            self.scale,
            self.splits,
            self.counters,
        )


def random_model() -> Qwen35Model:
    model = Qwen35Model(qwen3_5_0_8b_config(), "cuda", torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(0.0, math.log(16.0))
            elif "norm" in name or name.endswith("dt_bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.02)
    return model


def step_time(model: Qwen35Model, batch: int, context: int, fused: bool, replays: int) -> tuple[float, int]:
    """Microseconds a replayed step takes, and the kernels its graph holds."""
    cfg = model.config
    span = context // PAGE + 1
    kv = model.make_kv_pool(batch * span + 1, PAGE)
    pool = model.make_state_pool(batch + 1)
    layout = RowLayout(2 * batch + 1, span)
    rows = torch.zeros(layout.slots, layout.columns, dtype=torch.int32, device="cuda")
    step_slots = torch.arange(1, batch + 1, device="cuda")
    rows[1 : batch + 1, RowLayout.KV_LEN] = context
    rows[1 : batch + 1, RowLayout.STATE_SLOT] = step_slots.int()
    rows[1 : batch + 1, RowLayout.BLOCK_TABLE :] = 1 + torch.arange(batch * span, device="cuda").view(
        batch, span
    )
    splits = decode_splits(
        batch,
        cfg.num_kv_heads,
        context + PAGE,
        PAGE,
        torch.cuda.get_device_properties(0).multi_processor_count,
    )
    attention = PagedAttention(kv, rows, step_slots, cfg.head_dim**-0.5, splits, fused)
    lens = torch.full((batch,), context, device="cuda")
    inputs = StepInputs(
        tokens=torch.randint(0, cfg.vocab_size, (batch,), device="cuda"),
        positions=lens,
        kv_lens=lens.int(),
        write_page=rows[1 : batch + 1, RowLayout.BLOCK_TABLE + context // PAGE].clone(),
        write_offset=(lens % PAGE).int(),
        states=StateInputs(pool, step_slots),
    )
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(inputs, attention)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(inputs, attention)
            torch.cuda.synchronize()
    # what the captured graph holds: the eager step's kernel launches (memsets and copies included)
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        model(inputs, attention)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph, kv, pool
    torch.cuda.empty_cache()
    return start.elapsed_time(end) * 1000 / replays, kernels


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=640, help="tokens already stored in each row")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--out", default="docs/bench/hybrid_step.json")
    args = parser.parse_args()
    model = random_model()
    results = []
    for batch in args.batches:
        row = {"batch": batch, "context": args.context}
        for arm, fused in (("torch_ops", False), ("kernels", True)):
            micros, kernels = step_time(model, batch, args.context, fused, args.replays)
            row[f"{arm}_us"], row[f"{arm}_kernels"] = round(micros, 1), kernels
        row["speedup"] = round(row["torch_ops_us"] / row["kernels_us"], 2)
        print(row, flush=True)
        results.append(row)
    write_json(
        args.out,
        [{"commit": args.commit or commit_hash(), "device": torch.cuda.get_device_name(), "steps": results}],
    )


if __name__ == "__main__":
    main()
