"""The Qwen3 family (dense): the dense decoder with an RMSNorm over each query and key head before rope, an
explicit head_dim, tied embeddings in the small sizes."""

from __future__ import annotations

from typing import Any

from executor_svc.models.dense import DenseConfig, DenseModel, dense_config_from_hf
from executor_svc.models.family import ModelFamily
from executor_svc.models.gguf_dense import read_dense_gguf
from executor_svc.models.llama import hf_weight_name


def _read_hf_config(hf: dict[str, Any], path: str) -> DenseConfig:
    from transformers import Qwen3Config

    if hf.get("use_sliding_window"):
        raise ValueError(f"{path}: Qwen3 with sliding-window attention is not supported (use_sliding_window)")
    return dense_config_from_hf(hf, path, Qwen3Config, qk_norm=True)


FAMILY = ModelFamily(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    gguf_architectures=("qwen3",),
    read_hf_config=_read_hf_config,
    hf_weight_name=hf_weight_name,
    # llama.cpp's Qwen converter keeps Hugging Face's row order (NEOX rope): nothing to undo
    read_gguf=lambda reader, path, pack: read_dense_gguf(reader, path, permute_qk=False, pack=pack),
    build=DenseModel,
)
