"""What every benchmark script shares: the commit and the JSON file it records with its figures, and the model
shape it fills with random weights."""

from __future__ import annotations

import json
import os
import subprocess


def commit_hash() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_json(path: str, results: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


def replay_us(graph, replays: int) -> float:
    """Mean device µs of one replay of a captured CUDA graph, after 10 unmeasured ones."""
    import torch

    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def captured_us(run, replays: int, warmups: int = 1) -> float:
    """Mean device µs of one replay of `run()` captured in a CUDA graph: run `warmups` times eagerly on the
    capture's side stream first (Triton compiles, cuBLAS picks its kernels), then captured there."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            run()
    return replay_us(graph, replays)


def smollm2_config(**overrides):
    """SmolLM2-135M's shape (what the benchmarks fill with random weights); overrides name what differs."""
    from executor_svc.models.dense import DenseConfig

    fields = dict(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        rope_theta=100000.0,
        rms_eps=1e-5,
        max_seq_len=8192,
        tie_embeddings=True,
        eos_token_ids=(2,),
        bos_token_id=1,
        name="SmolLM2-135M (random bf16 weights)",
    )
    fields.update(overrides)
    return DenseConfig(**fields)


def qwen3_5_0_8b_config():
    """Qwen3.5-0.8B's published text configuration (Qwen/Qwen3.5-0.8B, a Qwen3_5ForConditionalGeneration whose
    text_config reads: vocab 248,320, hidden 1,024, intermediate 3,584, 24 layers as 6 x (3 gated delta net + 1
    gated full attention), attention 8 query / 2 KV heads of 256 with partial rotary 0.25 and rope theta 1e7,
    gated delta nets of 16 key and 16 value heads of 128 with a conv of 4, RMS eps 1e-6, tied embeddings, EOS
    248044), which the benchmarks fill with random weights."""
    from executor_svc.models.qwen3_5_config import FULL, LINEAR, Qwen35Config

    return Qwen35Config(
        vocab_size=248320,
        hidden_size=1024,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=256,
        rotary_dim=64,
        linear_key_heads=16,
        linear_value_heads=16,
        linear_key_dim=128,
        linear_value_dim=128,
        conv_width=4,
        intermediate_size=3584,
        rope_theta=10_000_000.0,
        rms_eps=1e-6,
        max_seq_len=262144,
        tie_embeddings=True,
        eos_token_ids=(248044,),
        bos_token_id=None,
        name="Qwen3.5-0.8B (random bf16 weights)",
    )
