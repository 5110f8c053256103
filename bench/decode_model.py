"""bench/decode.py's model and executor: the model shapes it fills with random bf16 weights, the executor's
config and runner built on them (page size, context, buckets), and the FlashInfer kernel's ahead-of-time build
(--compile-only)."""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import qwen3_5_0_8b_config, smollm2_config
from executor_svc.config import ExecutorConfig
from executor_svc.models.dense import DenseModel
from executor_svc.models.family import ExecutorModel
from executor_svc.models.qwen3_5_model import Qwen35Model
from executor_svc.runner import StepRunner, runner_for_model

PAGE_SIZE = 16
MAX_SEQ_LEN = 1024
SMOLLM2 = smollm2_config()
MODEL_SHAPES = ("smollm2-135m", "qwen3.5-0.8b")


def random_model(device: torch.device, shape: str = MODEL_SHAPES[0]) -> ExecutorModel:
    """The shape's model, weights ~ N(0, 0.02) and norms of one (Qwen3.5's (1 + w) norms: w = 0), gated delta
    net decays as transformers initialises them, in bf16."""
    if shape == "qwen3.5-0.8b":
        model: ExecutorModel = Qwen35Model(qwen3_5_0_8b_config(), device=device, dtype=torch.bfloat16)
    else:
        model = DenseModel(SMOLLM2, device=device, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    offset_norms = isinstance(model, Qwen35Model)
    with torch.no_grad():
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            if name.endswith("linear_attn.norm.weight"):
                param.fill_(1.0)
            elif name.endswith("norm.weight"):
                param.fill_(0.0 if offset_norms else 1.0)
            elif name.endswith("A_log"):
                param.copy_(
                    torch.empty_like(param, dtype=torch.float32).uniform_(1, 16, generator=generator).log()
                )
            elif name.endswith("dt_bias"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model


def model_fingerprint(shape: str) -> str:
    return f"random-{shape}"


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def executor_config(
    device: str,
    pool_pages: int,
    buckets: tuple[int, ...],
    arm: str,
    prefill_buckets: tuple[int, ...],
) -> ExecutorConfig:
    return ExecutorConfig(
        device=device,
        prefill_buckets=prefill_buckets,
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        pool_pages=pool_pages,
        max_seq_len=MAX_SEQ_LEN,
        buckets=buckets,
        decode_path="host-planned" if arm == "host-planned" else "resident",
    )


def build_runner(
    model: ExecutorModel, config: ExecutorConfig, shape: str
) -> tuple[StepRunner | None, dict[str, str]]:
    """The runner and its capture state per bucket; (None, {"error": ...}) when it cannot be built."""
    try:
        runner = runner_for_model(model, config, model_fingerprint(shape))
    except Exception as err:  # an arm that cannot be built is reported; the rest run
        return None, {"error": f"{type(err).__name__}: {err}"}
    graphs = runner.graphs
    return runner, {str(b): s for b, s in graphs.states.items()} if graphs else {"all": "eager (CPU)"}


def compile_only(shape: str) -> None:
    """Build FlashInfer's decode kernel for the shape (its JIT cache then serves the benchmark)."""
    from executor_svc.attention.host_planned import FlashInferDecode, plan_from_rows
    from executor_svc.kv_pool import KVPool
    from protos.layout import RowLayout

    began = time.perf_counter()
    device = torch.device("cuda")
    cfg = qwen3_5_0_8b_config() if shape == "qwen3.5-0.8b" else SMOLLM2
    kv = KVPool(1, 4, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device)
    layout = RowLayout(slots=3, block_span=4)
    attention = FlashInferDecode((1,), kv, cfg.num_heads, layout.block_span, cfg.head_dim**-0.5)
    rows = np.zeros((layout.slots, layout.columns), dtype=np.int32)
    attention.plan(1, plan_from_rows(rows, np.zeros(1, dtype=np.int32), PAGE_SIZE, 4 * PAGE_SIZE))
    q = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device=device)
    attention.attend(1, 0, q)
    torch.cuda.synchronize()
    print(f"FlashInfer decode kernel ready in {time.perf_counter() - began:.1f} s", flush=True)
