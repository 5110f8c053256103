"""The Qwen3.5 hybrid's decode step on the GPU, its torch-ops forward against its Triton-kernels forward
(qwen3_5_kernels) in the same run, both captured as CUDA graphs: Qwen3.5-0.8B's shape with random bf16 weights,
each row `--context` tokens deep, over the paged decode attention kernel the resident backend uses. Reports
the replayed step's time per arm and batch, the kernel launches each arm's graph holds and where the GPU time
goes; then one gated delta net layer's decode kernels by path and tile, and one such layer's prefill (fla-core's
chunked kernel) of several sequences in one packed call against one call a sequence.

    python bench/hybrid_step.py --out docs/bench/hybrid_step.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import captured_us, commit_hash, qwen3_5_0_8b_config, replay_us, write_json
from executor_svc.attention import StepInputs
from executor_svc.kernels.attention import decode_splits, paged_decode_attention
from executor_svc.models.qwen3_5_config import LINEAR
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


def step_time(
    model: Qwen35Model, batch: int, context: int, fused: bool, replays: int
) -> tuple[float, dict[str, list[float]]]:
    """Microseconds a replayed step takes, and the eager step's kernels by name (their durations, µs)."""
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
    # what the captured graph holds: the eager step's kernel launches (memsets and copies included), and the
    # GPU time by kernel name
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name[:60], []).append(event.time_range.elapsed_us())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        model(inputs, attention)
    graph_us = replay_us(graph, replays)
    del graph, kv, pool
    torch.cuda.empty_cache()
    return graph_us, kernels


def prefill_time(model: Qwen35Model, sequences: int, tokens: int, packed: bool, rounds: int = 20) -> float:
    """Milliseconds one gated delta net layer's prefill (conv and rule) of `sequences` fresh sequences of `tokens`
    each takes: in one packed call, or one call a sequence (the path before the packed one)."""
    import numpy as np

    from executor_svc.kernels.gated_delta_fla import prefill_for

    cfg = model.config
    hk, dk, hv, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_heads, cfg.linear_value_dim
    pool = model.make_state_pool(sequences + 1)
    total = sequences * tokens
    mixed = torch.randn(total, cfg.conv_channels, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(total, hv, device="cuda")
    beta = torch.rand(total, hv, device="cuda", dtype=torch.bfloat16)
    weight = model._decoder_layers()[0].linear_attn.conv1d.weight[:, 0, :]
    prefill = prefill_for(torch.device("cuda"), torch.bfloat16)

    def split(x: torch.Tensor):
        q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
        return q.view(-1, hk, dk), k.view(-1, hk, dk), v.view(-1, hv, dv)

    def batch_of(first: int, count: int) -> StateInputs:
        slots = np.arange(first + 1, first + count + 1)
        starts = np.arange(count + 1) * tokens
        return StateInputs(pool, torch.from_numpy(slots).cuda(), starts, slots, np.ones(count, dtype=bool))

    batches = [(slice(0, total), batch_of(0, sequences))]
    if not packed:
        batches = [(slice(i * tokens, (i + 1) * tokens), batch_of(i, 1)) for i in range(sequences)]

    def run() -> None:
        for part, states in batches:
            prefill(mixed[part], weight, g[part], beta[part], pool.conv[0], pool.recurrent[0], states, split)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        run()
    end.record()
    torch.cuda.synchronize()
    assert not getattr(prefill, "failed", False), "fla's kernel failed: the reference ran"
    if packed:
        began = time.perf_counter()
        run()
        host_ms = (time.perf_counter() - began) * 1000  # the host's time to issue it (its syncs included)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:50]] = kernels.get(event.name[:50], 0.0) + event.time_range.elapsed_us()
        top = sorted(kernels.items(), key=lambda item: -item[1])[:8]
        print(f"  packed prefill of {sequences}: host {host_ms:.2f} ms, GPU by kernel (µs):", top, flush=True)
    return start.elapsed_time(end) / rounds


def delta_net_step_time(
    model: Qwen35Model, batch: int, tile: tuple[int, int], replays: int, joined: bool = True
) -> float:
    """Microseconds one gated delta net layer's decode kernels take for `batch` rows with `tile` = (value block,
    warps): the joined one (gated_delta_joined.delta_net_step_at_slots: conv, rule and gated norm), or the three
    it joins (the conv, gated_delta_slots.delta_rule_step_at_slots on block // 8 warps, the gated norm). A captured
    graph of it over 64 layers' states (more than the GPU's L2 holds at one row, as in the model's step, where a
    layer's weights pass between two of its state reads)."""
    from executor_svc.kernels.fused import gated_rmsnorm
    from executor_svc.kernels.gated_delta_joined import delta_net_step_at_slots
    from executor_svc.kernels.gated_delta_slots import conv_step_at_slots, delta_rule_step_at_slots
    from executor_svc.models.qwen3_5_kernels import fused_weights
    from executor_svc.state_pool import StatePool

    cfg, layers = model.config, 64
    hk, hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    channels = cfg.conv_channels
    pool = StatePool(layers, batch + 1, channels, cfg.conv_width, hv, dk, dv, torch.bfloat16, "cuda")
    net = next(layer.linear_attn for layer in model._decoder_layers() if layer.kind == LINEAR)
    gates = next(fused.gates for fused in fused_weights(model).layers if fused.gates is not None)
    # mixed: [B, C + H Dv + 2 H], the joined projection's x | z | b | a
    mixed = torch.randn(batch, channels + hv * dv + 2 * hv, device="cuda", dtype=torch.bfloat16)
    x, z, b, a = mixed.split([channels, hv * dv, hv, hv], dim=-1)
    slots = torch.arange(1, batch + 1, device="cuda")
    weight = net.conv1d.weight[:, 0, :]
    arrivals = torch.zeros(batch * hk, dtype=torch.int32, device="cuda")

    def run() -> None:
        for layer in range(layers):
            if not joined:
                conv = conv_step_at_slots(x, weight, pool.conv[layer], slots)  # conv: [B, C], q | k | v
                q, k, v = conv.split([hk * dk, hk * dk, hv * dv], dim=-1)
                core = delta_rule_step_at_slots(
                    q.view(batch, hk, dk),
                    k.view(batch, hk, dk),
                    v.view(batch, hv, dv),
                    a,
                    b,
                    pool.recurrent[layer],
                    slots,
                    raw_gates=gates,
                    block=tile[0],
                )
                gated_rmsnorm(core, z, net.norm.weight, cfg.rms_eps)
                continue
            delta_net_step_at_slots(
                x,
                z,
                a,
                b,
                weight,
                pool.conv[layer],
                pool.recurrent[layer],
                slots,
                gates,
                (net.norm.weight, cfg.rms_eps),
                hk,
                arrivals,
                tile,
            )

    return captured_us(run, replays) / layers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=640, help="tokens already stored in each row")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument(
        "--arms", nargs="+", choices=("torch_ops", "kernels"), default=["torch_ops", "kernels"]
    )
    parser.add_argument(
        "--prefill-sequences", type=int, nargs="*", default=[1, 4], help="sequences a prefill step"
    )
    parser.add_argument(
        "--rule-blocks", type=int, nargs="*", default=[8, 16, 32], help="the three kernels' rule blocks timed"
    )
    parser.add_argument("--prefill-tokens", type=int, default=512, help="tokens of each prefilled sequence")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--out", default="docs/bench/hybrid_step.json")
    args = parser.parse_args()
    model = random_model()
    results = []
    for batch in args.batches:
        row = {"batch": batch, "context": args.context}
        for arm in args.arms:
            micros, kernels = step_time(model, batch, args.context, arm == "kernels", args.replays)
            row[f"{arm}_us"] = round(micros, 1)
            row[f"{arm}_kernels"] = sum(len(times) for times in kernels.values())
            top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:10]
            row[f"{arm}_top_kernels_us"] = {name: [len(t), round(sum(t), 1)] for name, t in top}
        if len(args.arms) == 2:
            row["speedup"] = round(row["torch_ops_us"] / row["kernels_us"], 2)
        print({k: v for k, v in row.items() if "top" not in k}, flush=True)
        for arm in args.arms:
            print(f" {arm} arm, top by GPU time (count, µs):", row[f"{arm}_top_kernels_us"], flush=True)
        results.append(row)
    from executor_svc.kernels.gated_delta_joined import joined_step_block, joined_step_wins
    from executor_svc.kernels.gated_delta_slots import value_block

    delta_net_steps = []
    cfg = model.config
    for batch in args.batches:
        row = {
            "batch": batch,
            "path": "joined" if joined_step_wins(batch, cfg.linear_value_heads) else "three kernels",
            "joined_block": joined_step_block(batch, cfg.linear_value_heads, cfg.linear_value_dim),
            "rule_block": value_block(batch, cfg.linear_value_heads, cfg.linear_value_dim),
        }
        # up to a whole head a program (128 values: no repeated q/k conv, each program its head's last)
        for block, warps in ((8, 1), (16, 2), (32, 4), (64, 8), (128, 8)):
            row[f"tile_{block}x{warps}_us"] = round(
                delta_net_step_time(model, batch, (block, warps), args.replays), 2
            )
        for block in args.rule_blocks:  # the three kernels (the path wherever joined_step_wins is false)
            row[f"three_kernels_{block}_us"] = round(
                delta_net_step_time(model, batch, (block, block // 8), args.replays, joined=False), 2
            )
        print("one gated delta net layer's decode kernels:", row, flush=True)
        delta_net_steps.append(row)
    prefills = []
    for sequences in args.prefill_sequences:
        row = {"sequences": sequences, "tokens": args.prefill_tokens}
        for arm, packed in (("by_sequence_ms", False), ("packed_ms", True)):
            row[arm] = round(prefill_time(model, sequences, args.prefill_tokens, packed), 3)
        row["speedup"] = round(row["by_sequence_ms"] / row["packed_ms"], 2)
        print("one gated delta net layer's prefill:", row, flush=True)
        prefills.append(row)
    write_json(
        args.out,
        [
            {
                "commit": args.commit or commit_hash(),
                "device": torch.cuda.get_device_name(),
                "steps": results,
                "delta_net_step": delta_net_steps,
                "delta_net_prefill": prefills,
            }
        ],
    )


if __name__ == "__main__":
    main()
