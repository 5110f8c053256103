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
