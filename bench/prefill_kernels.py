"""The hybrid prefill step's own Triton kernels alone, each over a choice of launch configurations, at one step's
shape: Qwen3.5-0.8B's, N fresh sequences of L tokens (default 16 x 512, the GPU planner's 8,192-token step).
The gated delta net's causal conv (gated_delta_conv.conv_qkv, its tokens a program and warps), the gated attention's
norm-rope-write and output gate (gated_attention) and the paged prefill attention (prefill_attention), µs a
launch: the median of rounds of CUDA-event timing, each configuration's output checked equal to the default's.
`default` marks what the executor launches.

    python bench/prefill_kernels.py --out docs/bench/prefill_kernels.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import commit_hash, qwen3_5_0_8b_config, write_json
from executor_svc.kernels.gated_attention import norm_rope_kv_write, output_gate
from executor_svc.kernels.gated_delta_conv import conv_qkv
from executor_svc.kernels.gated_delta_fla import Packed
from executor_svc.kernels.prefill_attention import paged_prefill_attention
from executor_svc.prefill.batch import PrefillBatch

PAGE = 16
MAX_SEQ_LEN = 1024  # bench/decode.py's context: the batch's block tables are that wide
ROUNDS, LAUNCHES = 7, 20  # timed rounds of launches each

CONV: list[dict] = [{}] + [{"block_tokens": t, "warps": w} for t in (16, 32, 64) for w in (2, 4, 8)]
ROWS: list[dict] = [{}] + [{"rows_per_program": r, "warps": w} for r in (1, 4, 8, 16, 32) for w in (4, 8)]
ATTENTION: list[dict] = [{}] + [{"tiles": (n, w, s)} for n in (32, 64) for w in (4, 8) for s in (1, 2, 3)]


def launch_us(launch: Callable[[], object]) -> float:
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(LAUNCHES):
            launch()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / LAUNCHES)
    return round(statistics.median(times), 2)


def sweep(kernel: str, configs: list[dict], launch: Callable[..., torch.Tensor]) -> list[dict]:
    """Each configuration's µs a launch, its output compared with the default's ({} is the default)."""
    expected = launch().clone()
    rows = []
    for config in configs:
        try:
            equal = bool(torch.equal(launch(**config), expected))
            us = launch_us(functools.partial(launch, **config))
            row = {"kernel": kernel, "config": config or "default", "us": us, "equal": equal}
        except Exception as error:  # a configuration that does not compile or fit: say so, go on
            row = {"kernel": kernel, "config": config, "error": f"{type(error).__name__}: {error}"[:300]}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512, help="tokens of each sequence")
    parser.add_argument("--kernels", nargs="+", default=["conv", "norm_rope", "gate", "attention"])
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--out", default="docs/bench/prefill_kernels.json")
    args = parser.parse_args()
    cfg, device, dtype = qwen3_5_0_8b_config(), torch.device("cuda"), torch.bfloat16
    n, length = args.sequences, args.tokens
    total, span = n * length, -(-length // PAGE)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    chunks = [
        (rng.integers(0, cfg.vocab_size, length), 0, np.arange(1 + i * span, 1 + (i + 1) * span))
        for i in range(n)
    ]
    batch = PrefillBatch.build(chunks, PAGE, MAX_SEQ_LEN, device)
    inputs = batch.inputs
    kv_shape = (n * span + 1, PAGE, cfg.num_kv_heads, cfg.head_dim)  # k, v: [pages, page, kv_heads, dim]
    k_layer, v_layer = (torch.randn(kv_shape, device=device, dtype=dtype) for _ in range(2))
    heads, dim = cfg.num_heads, cfg.head_dim
    # mixed: [T, 2 H D + 2 KVH D], each query head's D then its gate's, then k, then v
    mixed = torch.randn(total, 2 * (heads + cfg.num_kv_heads) * dim, device=device, dtype=dtype)
    q_norm, k_norm = (1 + 0.1 * torch.randn(dim, device=device) for _ in range(2))
    angles = torch.arange(MAX_SEQ_LEN, device=device)[:, None] * torch.rand(cfg.rotary_dim, device=device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = torch.randn(total, heads, dim, device=device, dtype=dtype)  # q: [T, H, D]
    channels, width = cfg.conv_channels, cfg.conv_width
    # x: [T, C] strided, as the in-projection's leading columns (its z, b and a follow)
    x = torch.randn(total, channels + 2080, device=device, dtype=dtype)[:, :channels]
    conv_weight = torch.randn(channels, width, device=device, dtype=dtype)
    windows = torch.randn(n + 1, channels, width - 1, device=device, dtype=dtype)
    starts = np.arange(n + 1) * length
    packed = Packed.build(starts, np.ones(n, dtype=bool), np.arange(1, n + 1), device)
    conv_heads = (cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_heads, cfg.linear_value_dim)
    launches: dict[str, tuple[list[dict], Callable[..., torch.Tensor]]] = {
        "conv": (CONV, lambda **c: torch.cat(conv_qkv(x, conv_weight, windows, packed, conv_heads, **c), 1)),
        "norm_rope": (
            ROWS,
            lambda **c: norm_rope_kv_write(
                mixed,
                q_norm,
                k_norm,
                cfg.rms_eps,
                cos,
                sin,
                inputs.positions,
                k_layer,
                v_layer,
                inputs.write_page,
                inputs.write_offset,
                heads,
                **c,
            ),
        ),
        "gate": (ROWS, lambda **c: output_gate(q, mixed, **c)),
        "attention": (
            ATTENTION,
            lambda **c: paged_prefill_attention(q, k_layer, v_layer, batch, dim**-0.5, **c),
        ),
    }
    rows = [row for name in args.kernels for row in sweep(name, *launches[name])]
    shape = {"sequences": n, "tokens": length, "device": torch.cuda.get_device_name()}
    write_json(args.out, [{"commit": args.commit or commit_hash(), **shape, "launches": rows}])


if __name__ == "__main__":
    main()
