"""The executor's model interface, and the registry of model families behind it.

The runner, the decode and prefill graphs and the attention backends call a model only through
`ExecutorModel`. A family (Llama, Qwen3, ...) is one module that exposes `FAMILY`, a `ModelFamily` saying which
checkpoints are its own (HF config `model_type` / `architectures`, GGUF `general.architecture`) and how to read
their config and weights; `FAMILY_MODULES` lists them. A checkpoint no family claims is refused by name, with
the supported ones listed.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from executor_svc.attention import Attention, StepInputs
    from executor_svc.kv_pool import KVPool
    from executor_svc.stage import Stage

# One module per family, each with a FAMILY. A new family adds its module here.
FAMILY_MODULES = ("executor_svc.models.llama", "executor_svc.models.qwen3", "executor_svc.models.qwen3_5")


class ModelConfig(Protocol):
    """What the executor reads of a model's configuration."""

    @property
    def name(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class ExecutorModel(Protocol):
    """A decoder whose attention reads and writes a paged KV pool: all the executor calls of a model."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def stage(self) -> Stage:
        """The layers it holds, [begin, end) of the model's (all of them unless a stage of a layer split):
        a family builds those only, the embedding on the first stage, the final norm and head on the last."""
        ...

    @property
    def scale(self) -> float:
        """The attention's softmax scale."""
        ...

    def make_kv_pool(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVPool: ...

    def forward(
        self, inputs: StepInputs, attention: Attention, select: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """One position for each of B rows, writing its K/V to (inputs.write_page, inputs.write_offset) of
        attention.kv; `select` the rows that need logits (default all). Returns logits[B or len(select), V]
        in the head's dtype (bfloat16 on a GPU: a greedy step's argmax needs no float32 copy, which would give
        the same argmax; the samplers make one) on the last stage; an earlier stage of a split enters from the
        previous stage's hidden states (stage.enter), hands its own on (stage.hand_on) and returns None. Fixed
        shapes, no host reads: the decode graphs capture it."""
        ...


@dataclass(frozen=True)
class ModelFamily:
    """How to read one family's checkpoints; `config` below is the family's own config type."""

    name: str
    model_types: tuple[str, ...]  # HF config.json "model_type"
    architectures: tuple[str, ...]  # HF config.json "architectures"
    gguf_architectures: tuple[str, ...]  # GGUF "general.architecture"; () = no GGUF
    # config.json's contents and the directory (for generation_config.json) -> config; ValueError if unservable
    read_hf_config: Callable[[dict[str, Any], str], Any]
    # a safetensors tensor name -> the model's parameter name, or None for a tensor the model does not use
    hf_weight_name: Callable[[str], str | None]
    # an open gguf.GGUFReader, its path and whether to keep quantized matrices packed -> (config, weights named as
    # the model's parameters: tensors, or PackedWeights when packing)
    read_gguf: Callable[[Any, str, bool], tuple[Any, dict[str, Any]]] | None
    # config, device, dtype, stage (None: the whole model) -> the model of the stage's layers with
    # uninitialised weights (the loader fills them)
    build: Callable[[Any, torch.device, torch.dtype, Stage | None], Any]


def families() -> list[ModelFamily]:
    return [importlib.import_module(module).FAMILY for module in FAMILY_MODULES]


def supported_hf() -> str:
    return ", ".join(t for family in families() for t in family.model_types)


def family_for_hf(hf: dict[str, Any], path: str) -> ModelFamily:
    """The family of a Hugging Face config.json, by model_type, else by architectures; ValueError naming the
    type and the supported ones when no family claims it."""
    model_type, architectures = hf.get("model_type"), hf.get("architectures") or []
    for family in families():
        if model_type in family.model_types:
            return family
    for family in families():
        if any(arch in family.architectures for arch in architectures):
            return family
    raise ValueError(
        f"{path}: model type {model_type!r} is not supported (architectures {architectures}); "
        f"supported model types: {supported_hf()}"
    )


def family_for_gguf(architecture: str, path: str) -> ModelFamily:
    for family in families():
        if architecture in family.gguf_architectures and family.read_gguf is not None:
            return family
    supported = ", ".join(a for family in families() for a in family.gguf_architectures)
    raise ValueError(
        f"{path}: GGUF architecture {architecture!r} is not supported; supported GGUF architectures: {supported}"
    )


def read_json(path: str) -> dict[str, Any]:
    """A checkpoint's JSON file; ValueError naming the file where it is not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def stop_ids(hf: dict[str, Any], path: str) -> tuple[int, ...]:
    """The stop ids as transformers' `generate` takes them: generation_config.json's where it names them, else
    config.json's (`hf`, the text model's part of it); ValueError where neither does."""
    eos = hf.get("eos_token_id")
    generation_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation_path):
        named = read_json(generation_path).get("eos_token_id")
        eos = eos if named is None else named
    if eos is None:
        raise ValueError(f"{path}: neither config.json nor generation_config.json names an eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (eos,)


def check_activation(hf: dict[str, Any], path: str) -> None:
    """The MLPs here are SiLU-gated: a checkpoint asking for another activation would serve wrong tokens."""
    activation = hf.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"{path}: hidden_act {activation!r} is not supported (only 'silu')")
