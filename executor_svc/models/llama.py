"""The Llama family (Llama 2 and 3, SmolLM2, and kin): the dense decoder as Llama's checkpoints configure it."""

from __future__ import annotations

from typing import Any

from executor_svc.models.dense import DenseConfig, DenseModel, dense_config_from_hf
from executor_svc.models.family import ModelFamily
from executor_svc.models.gguf_dense import read_dense_gguf


def _read_hf_config(hf: dict[str, Any], path: str) -> DenseConfig:
    from transformers import LlamaConfig

    return dense_config_from_hf(hf, path, LlamaConfig, qk_norm=False)


def hf_weight_name(name: str) -> str | None:
    if name.endswith("rotary_emb.inv_freq"):
        return None  # older checkpoints saved the rope buffer; the rope tables are computed from the config
    return name.removeprefix("model.")


FAMILY = ModelFamily(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    gguf_architectures=("llama",),
    read_hf_config=_read_hf_config,
    hf_weight_name=hf_weight_name,
    read_gguf=lambda reader, path, pack: read_dense_gguf(reader, path, permute_qk=True, pack=pack),
    build=DenseModel,
)
