"""Load a model of any registered family from a GGUF file or a Hugging Face safetensors directory (sharded or
not): the family says how to read its config and name its weights; the loading and its checks are shared."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any

import torch

from executor_svc.device import resolve_weights
from executor_svc.models import dense_cpu
from executor_svc.models.family import ExecutorModel, ModelFamily, family_for_gguf, family_for_hf, read_json
from executor_svc.models.packed import PackedWeight, fuse_projections, install_packed
from executor_svc.stage import StageOf
from protos.layer_split import LayerRange

log = logging.getLogger(__name__)

_READ_BLOCK = 8 << 20
_EMBEDDING = "embed_tokens.weight"  # the families' name for it, as hf_weight_name gives it


def load_model(
    path: str,
    device: torch.device | str,
    dtype: torch.dtype,
    weights_mode: str = "auto",
    stage_of: StageOf | None = None,
) -> ExecutorModel:
    """The model of the checkpoint's family with every weight loaded, on `device` in `dtype`; weights_mode
    (auto, dequantize, packed) says whether a GGUF's quantized matrices stay packed (resolve_weights); with
    `stage_of`, the stage of a layer split it says (given the model's layer count), with only that stage's
    weights."""
    began = time.perf_counter()
    device = torch.device(device)
    mode = resolve_weights(weights_mode, device, dtype, path)
    weights: dict[str, Any]  # tensors, and PackedWeights when packing
    if os.path.isdir(path):
        family, config, weights = _read_hf_dir(path)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        family, config, weights = _read_gguf(path, pack=mode == "packed")
    else:
        raise ValueError(f"model path {path!r} is neither a .gguf file nor a Hugging Face model directory")
    stage = None if stage_of is None else stage_of(config.num_layers)
    model = family.build(config, torch.device(device), dtype, stage)
    if stage is not None:
        weights = stage_weights(weights, stage.layers, set(model.state_dict()))
    expected = set(model.state_dict())
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(
            f"{path}: weights do not match a {family.name} model (missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for name, param in model.named_parameters():
        if param.shape != weights[name].shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(weights[name].shape)}, expected {tuple(param.shape)}"
            )
    packed = {name: w for name, w in weights.items() if isinstance(w, PackedWeight)}
    install_packed(model, packed)
    # assign=True adopts the converted tensors instead of copying into the placeholders (saves a pass).
    model.load_state_dict(
        {name: w.to(device=device, dtype=dtype) for name, w in weights.items() if name not in packed},
        assign=True,
    )
    fuse_projections(model)  # after the load: the biases are in place
    if packed and device.type == "cpu":
        # Built now, not by the first decode step: a first build takes seconds of compiler, which the planner's
        # watchdog would read as a hung step.
        dense_cpu.library()
    log.info(
        "model loaded: %s, weights %s (%d of %d matrices packed, %.0f MB), %.1f s",
        config.name,
        mode,
        len(packed),
        sum(1 for w in weights.values() if isinstance(w, PackedWeight) or w.dim() == 2),
        sum(
            w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size()
            for w in weights.values()
        )
        / 1e6,
        time.perf_counter() - began,
    )
    return model


_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def stage_weights(weights: dict[str, Any], layers: LayerRange, held: set[str]) -> dict[str, Any]:
    """A stage's weights out of the whole model's: layers [begin, end) renumbered from 0, and of the rest
    (embedding, final norm, head) those the stage's model holds."""
    kept = {}
    for name, weight in weights.items():
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            if name in held:
                kept[name] = weight
        elif layers.begin <= int(match[1]) < layers.end:
            kept[f"layers.{int(match[1]) - layers.begin}.{match[2]}"] = weight
    return kept


def layer_count(path: str) -> int:
    """The model's decoder layers, from its config alone (no weights read): what a layer split divides."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        return int(hf.get("text_config", hf)["num_hidden_layers"])
    reader = _gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    # llama.cpp counts a multi-token-prediction block (Qwen3.5's) among the blocks; the decoder has the rest
    mtp = reader.fields.get(f"{arch}.nextn_predict_layers")
    return int(reader.fields[f"{arch}.block_count"].contents()) - (0 if mtp is None else int(mtp.contents()))


def model_fingerprint(path: str, stop: threading.Event | None = None) -> str:
    """sha256 over the config and the name, size and whole contents of each weight file.

    What a snapshot's KV is checked against before it is restored: a fine-tune differs from its base only
    in weights, anywhere in a file, so every byte counts (~1 s a GB). A GGUF keeps its config in its header.
    Once `stop` is set it gives up at its next block (CancelledError)."""
    digest = hashlib.sha256()
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), "rb") as f:
            digest.update(f.read())
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    else:
        files = [path]
    for file in files:
        size = os.path.getsize(file)
        digest.update(os.path.basename(file).encode() + size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            while block := f.read(_READ_BLOCK):
                if stop is not None and stop.is_set():
                    raise CancelledError(f"fingerprint of {path} stopped")
                digest.update(block)
    return digest.hexdigest()


def load_fingerprinted(
    path: str,
    device: torch.device | str,
    dtype: torch.dtype,
    weights_mode: str = "auto",
    stage_of: StageOf | None = None,
) -> tuple[ExecutorModel, str]:
    """load_model's model and model_fingerprint's digest, the hash taken on a second thread while the load
    runs (file reads and sha256 release the GIL), so that start-up does not pay a second pass over the
    weights after the load. A failed load's error is the one raised."""
    stop = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="fingerprint") as pool:
        fingerprint = pool.submit(model_fingerprint, path, stop)
        try:
            return load_model(path, device, dtype, weights_mode, stage_of), fingerprint.result()
        finally:
            stop.set()  # after a failed load, so that leaving the pool does not wait for a whole hash


def _gguf_reader(path: str) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError) as err:  # gguf's own words: a type id it lacks, a size off
        raise ValueError(
            f"{path}: not a GGUF this can read (a tensor type unknown to gguf, or cut short?): {err}"
        ) from None


def _read_gguf(path: str, pack: bool) -> tuple[ModelFamily, Any, dict[str, Any]]:
    reader = _gguf_reader(path)
    field = reader.fields.get("general.architecture")
    family = family_for_gguf("" if field is None else str(field.contents()), path)
    assert family.read_gguf is not None  # family_for_gguf returns only families that read GGUF
    config, weights = family.read_gguf(reader, path, pack)
    return family, config, weights


def _read_hf_dir(path: str) -> tuple[ModelFamily, Any, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path}: config.json is missing")
    hf = read_json(config_path)
    family = family_for_hf(hf, path)
    try:
        config = family.read_hf_config(hf, path)
    except (
        KeyError,
        TypeError,
    ) as err:  # a field missing or of the wrong kind (e.g. a rope_scaling's factor)
        raise ValueError(f"{path}: config.json is incomplete or malformed: {err!r}") from None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    weights = {}
    stored_head = None  # a tied model's lm_head.weight, where the checkpoint stores one
    for file in files:  # a sharded checkpoint's files hold disjoint tensors
        try:
            tensors = load_file(file)
        except Exception as err:  # safetensors' own error type: a truncated or corrupt file
            raise ValueError(f"{file} cannot be read (truncated or corrupt?): {err}") from None
        for stored, tensor in tensors.items():
            name = family.hf_weight_name(stored)
            if name is None:
                continue  # not this model's
            if config.tie_embeddings and name == "lm_head.weight":
                stored_head = tensor
                continue
            if name in weights:  # two files hold it: a stale file beside the checkpoint's own
                raise ValueError(f"{path}: {stored} is in more than one *.safetensors file (a stale one?)")
            weights[name] = tensor
    if stored_head is not None:
        config = _tie_as_transformers_does(config, weights, stored_head, path)
    return family, config, weights


def _tie_as_transformers_does(
    config: Any, weights: dict[str, torch.Tensor], head: torch.Tensor, path: str
) -> Any:
    """A tied config whose checkpoint stores a head too. transformers (5) ties only what is equal: a head that
    differs from the embedding (a fine-tune that trained it untied) is served untied, and a head alone is
    the embedding too. The same here, so that the tokens are transformers'."""
    embedding = weights.get(_EMBEDDING)
    if embedding is None:
        weights[_EMBEDDING] = head
    elif not torch.equal(embedding, head):
        log.warning(
            "%s: lm_head.weight differs from the embedding, so it is not tied (as transformers)", path
        )
        weights["lm_head.weight"] = head
        return dataclasses.replace(config, tie_embeddings=False)
    return config
