"""The paged decode attention kernel (kernels/attention.py, what the resident decode graphs run) by its launch:
tokens an inner step, warps, a register cap and pipeline stages, at Qwen3.5-0.8B's attention shape (8 query
heads, 2 KV heads of 256) and SmolLM2's (9 and 3 of 64), each row `--context` tokens deep, split as the decode
graphs split it (or into each of `--splits` partitions: 0 is the graphs' own choice).
A captured graph of the kernel over `--layers` layers' pages (more than the L2 holds, as in a step) reports
microseconds a layer and the bandwidth of the K/V bytes read; beside it, what one plain read of a layer's K and
V pages takes (torch's sum, one kernel): the bandwidth a read of that size gets at all. The default launch is
the first of the sweep.

    python bench/decode_attention.py --out docs/bench/decode_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import captured_us, commit_hash, write_json
from executor_svc.kernels.attention import decode_splits, paged_decode_attention
from protos.layout import RowLayout

PAGE = 16
SHAPES = {"qwen3.5-0.8b": (8, 2, 256), "smollm2-135m": (9, 3, 64)}  # query heads, KV heads, head dim


def pages_of(shape: str, batch: int, context: int, layers: int) -> torch.Tensor:
    """kv: [layers, 2 (K, V), pages, page, kv_heads, dim], page 0 the sink: each row's pages after it."""
    _, kv_heads, dim = SHAPES[shape]
    pages = batch * (context // PAGE + 1) + 1
    return torch.randn(layers, 2, pages, PAGE, kv_heads, dim, device="cuda", dtype=torch.bfloat16)


def read_us(kv: torch.Tensor, replays: int) -> float:
    """Microseconds one plain read of a layer's K and V pages takes (a graph over every layer)."""
    layers = kv.shape[0]
    return (
        captured_us(lambda: [kv[layer].sum(dtype=torch.float32) for layer in range(layers)], replays) / layers
    )


def layer_us(
    shape: str, kv: torch.Tensor, batch: int, context: int, launch, replays: int, splits: int = 0
) -> tuple[float, int]:
    """Microseconds one layer's attention takes (a graph over every layer of `kv`), and the splits it ran
    (`splits` 0: decode_splits', as a decode graph's)."""
    heads, kv_heads, dim = SHAPES[shape]
    span = context // PAGE + 1
    layers = kv.shape[0]
    k, v = kv[:, 0], kv[:, 1]
    layout = RowLayout(2 * batch + 1, span)
    rows = torch.zeros(layout.slots, layout.columns, dtype=torch.int32, device="cuda")
    slots = torch.arange(1, batch + 1, device="cuda")
    rows[1 : batch + 1, RowLayout.KV_LEN] = context
    rows[1 : batch + 1, RowLayout.BLOCK_TABLE :] = 1 + torch.arange(batch * span, device="cuda").view(
        batch, span
    )
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = splits or decode_splits(batch, kv_heads, context + PAGE, PAGE, sms)
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")

    def run() -> None:
        for layer in range(layers):
            paged_decode_attention(
                q,
                k[layer],
                v[layer],
                rows,
                slots,
                RowLayout.BLOCK_TABLE,
                PAGE,
                dim**-0.5,
                splits,
                counters,
                launch,
            )

    return captured_us(run, replays) / layers, splits


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--context", type=int, default=640, help="tokens already stored in each row")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 32, 128], help="tokens an inner step")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--registers", type=int, nargs="+", default=[0, 128], help="register caps (0: none)")
    parser.add_argument(
        "--stages", type=int, nargs="+", default=[0], help="pipeline stages (0: Triton's default)"
    )
    parser.add_argument(
        "--splits",
        type=int,
        nargs="+",
        default=[0],
        help="partitions of a row (0: the decode graphs' choice)",
    )
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--out", default="docs/bench/decode_attention.json")
    args = parser.parse_args()
    results = []
    reads = []
    for shape, batch in itertools.product(args.shapes, args.batches):
        _, kv_heads, dim = SHAPES[shape]
        kv_bytes = batch * (args.context + 1) * kv_heads * dim * 2 * 2  # K and V, bf16
        kv = pages_of(shape, batch, args.context, args.layers)
        plain = read_us(kv, args.replays)
        read = {"shape": shape, "batch": batch, "read_us": round(plain, 2)}
        read["read_tb_per_s"] = round(kv[0].numel() * kv.element_size() / plain / 1e6, 2)
        print(read, flush=True)
        reads.append(read)
        sweep = itertools.product(args.tokens, args.warps, args.registers, args.stages, args.splits)
        for tokens, warps, registers, stages, wanted_splits in sweep:
            launch = (tokens, warps, registers or None, stages or None)
            try:
                micros, splits = layer_us(shape, kv, batch, args.context, launch, args.replays, wanted_splits)
            except Exception as err:  # a launch that does not compile or fit is reported, not fatal
                print({"shape": shape, "batch": batch, "launch": launch, "error": str(err)[:200]}, flush=True)
                continue
            finally:
                torch.cuda.empty_cache()  # the last run's graph
            row = {
                "shape": shape,
                "batch": batch,
                "splits": splits,
                "tokens": tokens,
                "warps": warps,
                "registers": registers or None,
                "stages": stages or None,
                "us_a_layer": round(micros, 2),
                "tb_per_s": round(kv_bytes / micros / 1e6, 2),
            }
            print(row, flush=True)
            results.append(row)
    write_json(
        args.out,
        [
            {
                "commit": args.commit or commit_hash(),
                "device": torch.cuda.get_device_name(),
                "context": args.context,
                "plain_reads": reads,
                "runs": results,
            }
        ],
    )


if __name__ == "__main__":
    main()
