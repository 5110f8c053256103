"""A Qwen3.5 GGUF (llama.cpp's `qwen35`): the tiny random hybrid written as llama.cpp's converter writes it
(convert_hf_to_gguf's Qwen3_5TextModel: its metadata keys, gguf's own tensor-name map, the +1 norms, -exp(A_log),
the squeezed conv, the value heads tiled, an MTP block after the decoder's) with SmolLM2's tokenizer, loads
back to transformers' weights and, served over real gRPC, generates transformers' greedy tokens."""

from __future__ import annotations

import asyncio
import functools
import random
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from executor_svc.config import ExecutorConfig
from executor_svc.models.loader import layer_count, load_model
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from tests.conftest import start_stack, stop_stack
from tests.hybrid_model import TEXT_CONFIG, build_text_model, greedy

# Three value heads a key head, of another size than the keys': a reorder done the wrong way round, or key and
# value dims swapped, loads other weights (with two a key head the converter's reorder is its own inverse).
CHANGES = {"linear_num_value_heads": 6, "linear_value_head_dim": 8}
CONFIG = {**TEXT_CONFIG, **CHANGES}
NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 40, 300)


def _tiled(tensor: torch.Tensor, head_dim: int, dim: int = 0) -> torch.Tensor:
    """convert_hf_to_gguf's _LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head ->
    tiled, along `dim`."""
    key_heads = CONFIG["linear_num_key_heads"]
    per_key = CONFIG["linear_num_value_heads"] // key_heads
    moved = tensor.movedim(dim, 0)
    tiled = moved.reshape(key_heads, per_key, head_dim, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape)
    return tiled.movedim(0, dim)


def _converted(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One Hugging Face tensor as the converter writes it: _LinearAttentionVReorderBase.modify_tensors, then
    Qwen3NextModel.modify_tensors, then the name from gguf's tensor-name map (TextModel.map_tensor_name)."""
    value_dim = CONFIG["linear_value_head_dim"]
    qk_rows = 2 * CONFIG["linear_num_key_heads"] * CONFIG["linear_key_head_dim"]
    if ".in_proj_qkv." in name or ".conv1d." in name:
        tensor = torch.cat([tensor[:qk_rows], _tiled(tensor[qk_rows:], value_dim)])
    elif ".in_proj_z." in name:
        tensor = _tiled(tensor, value_dim)
    elif any(part in name for part in (".in_proj_a.", ".in_proj_b.", ".A_log", ".dt_bias")):
        tensor = _tiled(tensor, 1)
    elif ".out_proj." in name:
        tensor = _tiled(tensor, value_dim, dim=1)
    if name.endswith(".A_log"):
        tensor = -torch.exp(tensor)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        tensor = tensor.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        tensor = tensor + 1
    return name, tensor


@functools.cache
def _smollm2_tokenizer() -> list[tuple]:
    """The tokenizer.* fields of SmolLM2's GGUF: (key, value, type, array item type or None)."""
    import gguf

    from protos.model_files import default_model_path

    fields = []
    for key, field in gguf.GGUFReader(default_model_path()).fields.items():
        if key.startswith("tokenizer."):
            is_array = field.types[0] == gguf.GGUFValueType.ARRAY
            fields.append((key, field.contents(), field.types[0], field.types[-1] if is_array else None))
    return fields


def write_gguf(
    model,
    path: Path,
    drop: str | None = None,
    vocabulary: int | None = None,
    recurrent_layers: list[bool] | None = None,
) -> None:
    """The model as llama.cpp's qwen35 GGUF, in F32, with one MTP block (layer 4: random, as the reader skips it)
    and SmolLM2's tokenizer fields; `drop` leaves that metadata key out; `vocabulary` keeps only that many of
    its tokens and none of its merges: a file quicker to write and read, where nothing is tokenized (transformers
    sizes its config by the tokens); `recurrent_layers`, llama.cpp's per-block flags, written beside the interval."""
    import gguf

    config, arch = model.config, gguf.MODEL_ARCH.QWEN35
    layers = config.num_hidden_layers
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    rotary = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 0.25))
    metadata = {
        "block_count": (writer.add_block_count, layers + 1),
        "nextn_predict_layers": (writer.add_nextn_predict_layers, 1),
        "context_length": (writer.add_context_length, config.max_position_embeddings),
        "embedding_length": (writer.add_embedding_length, config.hidden_size),
        "feed_forward_length": (writer.add_feed_forward_length, config.intermediate_size),
        "attention.head_count": (writer.add_head_count, config.num_attention_heads),
        "attention.head_count_kv": (writer.add_head_count_kv, config.num_key_value_heads),
        "attention.key_length": (writer.add_key_length, config.head_dim),
        "attention.value_length": (writer.add_value_length, config.head_dim),
        "rope.freq_base": (writer.add_rope_freq_base, config.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
        # Qwen3NextModel.set_gguf_parameters
        "ssm.conv_kernel": (writer.add_ssm_conv_kernel, config.linear_conv_kernel_dim),
        "ssm.state_size": (writer.add_ssm_state_size, config.linear_key_head_dim),
        "ssm.group_count": (writer.add_ssm_group_count, config.linear_num_key_heads),
        "ssm.time_step_rank": (writer.add_ssm_time_step_rank, config.linear_num_value_heads),
        "ssm.inner_size": (
            writer.add_ssm_inner_size,
            config.linear_value_head_dim * config.linear_num_value_heads,
        ),
        "full_attention_interval": (writer.add_full_attention_interval, 4),
        "rope.dimension_count": (writer.add_rope_dimension_count, rotary),
        "rope.dimension_sections": (writer.add_rope_dimension_sections, [rotary // 2, 0, 0, 0]),
    }
    writer.add_name("tiny-qwen35")
    if recurrent_layers is not None:
        writer.add_array(f"{writer.arch}.attention.recurrent_layers", recurrent_layers)
    for key, (add, value) in metadata.items():
        if key != drop:
            add(value)
    for key, value, value_type, sub_type in _smollm2_tokenizer():
        if vocabulary and key.endswith("merges"):
            continue
        writer.add_key_value(key, value[:vocabulary] if sub_type else value, value_type, sub_type)
    names = gguf.get_tensor_name_map(arch, layers + 1)
    for hf_name, tensor in model.state_dict().items():
        name, converted = _converted(hf_name, tensor.float())
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, np.ascontiguousarray(converted.numpy()))
    rng = np.random.default_rng(0)
    for leaf, shape in (("attn_norm.weight", (64,)), ("nextn.eh_proj.weight", (64, 128))):
        writer.add_tensor(f"blk.{layers}.{leaf}", rng.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def qwen35_gguf(tmp_path_factory):
    """(the directory of tiny-qwen35.gguf, with SmolLM2's whole tokenizer, and small.gguf, with its first tokens
    only; the transformers model; [(prompt, transformers' greedy tokens)])."""
    model = build_text_model(**CHANGES)
    directory = tmp_path_factory.mktemp("qwen35_gguf")
    write_gguf(model, directory / "tiny-qwen35.gguf")
    write_gguf(model, directory / "small.gguf", vocabulary=CONFIG["vocab_size"])
    rng = random.Random(1)
    cases = []
    for length in PROMPT_LENGTHS:
        prompt = [rng.randrange(3, CONFIG["vocab_size"]) for _ in range(length)]
        cases.append((prompt, greedy(model, prompt, NEW_TOKENS)))
    return directory, model, cases


def test_gguf_loads_transformers_weights(qwen35_gguf):
    directory, model, _ = qwen35_gguf
    path = directory / "small.gguf"
    assert layer_count(str(path)) == 4  # the MTP block is not a decoder layer
    ours = load_model(str(path), "cpu", torch.float32)
    assert ours.config.layer_types == tuple(model.config.layer_types)
    assert (ours.config.rotary_dim, ours.config.eos_token_ids) == (4, (2,))
    theirs = {name.removeprefix("model."): w for name, w in model.state_dict().items()}
    ours_weights = ours.state_dict()
    assert set(ours_weights) == set(theirs)
    for name, weight in theirs.items():
        torch.testing.assert_close(ours_weights[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_transformers_reads_the_written_gguf_back(qwen35_gguf):
    """transformers' own qwen35 GGUF reader (its account of llama.cpp's layout, independent of this test's)
    gives back the model's weights from what write_gguf wrote: the writer is llama.cpp's layout, not just ours."""
    from transformers import AutoModelForCausalLM

    directory, model, _ = qwen35_gguf
    theirs = AutoModelForCausalLM.from_pretrained(directory, gguf_file="small.gguf", dtype=torch.float32)
    assert theirs.config.layer_types == model.config.layer_types
    read_back = theirs.state_dict()
    assert set(read_back) == set(model.state_dict())
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(read_back[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_gguf_missing_metadata_is_refused(qwen35_gguf, tmp_path):
    path = tmp_path / "no-inner-size.gguf"
    write_gguf(qwen35_gguf[1], path, drop="ssm.inner_size", vocabulary=CONFIG["vocab_size"])
    with pytest.raises(ValueError, match="GGUF metadata 'qwen35.ssm.inner_size' is missing"):
        load_model(str(path), "cpu", torch.float32)


def test_recurrent_layers_flags_set_the_layer_pattern(qwen35_gguf, tmp_path):
    """Where the file flags each block (the MTP block's flag last), the flags win over the interval."""
    import gguf

    from executor_svc.models.gguf_qwen3_5 import read_qwen35_config

    path = tmp_path / "flags.gguf"
    flags = [True, False, True, False, False]
    write_gguf(qwen35_gguf[1], path, vocabulary=CONFIG["vocab_size"], recurrent_layers=flags)
    config, blocks = read_qwen35_config(gguf.GGUFReader(path), str(path))
    assert (config.layer_types, blocks) == (("linear_attention", "full_attention") * 2, 5)
    short = tmp_path / "short-flags.gguf"  # fewer flags than blocks: refused, as llama.cpp does
    write_gguf(qwen35_gguf[1], short, vocabulary=CONFIG["vocab_size"], recurrent_layers=flags[:3])
    with pytest.raises(ValueError, match="recurrent_layers has 3 flags; it needs one per block"):
        read_qwen35_config(gguf.GGUFReader(short), str(short))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gguf_stack(qwen35_gguf):
    model = str(qwen35_gguf[0] / "tiny-qwen35.gguf")
    executor = ExecutorConfig(
        model=model, device="cpu", dtype="float32", pool_pages=64, page_size=16, buckets=(1, 2, 4)
    )
    planner = PlannerConfig(model=model, scheduling=SchedulingConfig(prefill_token_budget=256))
    stack, servers = await start_stack(executor, planner)
    yield stack
    await stop_stack(servers)


@pytest.mark.asyncio(loop_scope="session")
async def test_served_gguf_equals_transformers(gguf_stack, qwen35_gguf):
    """One prompt at a time, then all at once (a padded bucket), over the planner's gRPC."""
    cases = qwen35_gguf[2]
    async with PlannerClient(gguf_stack.addr) as client:
        for prompt, expected in cases:
            got = await client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=NEW_TOKENS))
            assert got.token_ids == expected, len(prompt)
        results = await asyncio.gather(
            *(
                client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=NEW_TOKENS))
                for prompt, _ in cases
            )
        )
    assert [got.token_ids for got in results] == [expected for _, expected in cases]
