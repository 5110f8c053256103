"""Each dense family variant (Llama with llama3 / yarn / linear rope, tied and untied, biases, several EOS ids,
a sharded checkpoint; Qwen3), a tiny random checkpoint saved by transformers, served by deltaserve over real gRPC:
greedy tokens equal to transformers' fp32 `generate`, one request at a time and all at once. And the refusals."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
import torch

from executor_svc.config import ExecutorConfig
from executor_svc.models.loader import load_model
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from tests import tiny_families
from tests.conftest import start_stack, stop_stack

# Short, mid-page, several pages, and over 1,000 tokens (three prefill chunks of the 512-token budget).
PROMPT_LENGTHS = [5, 37, 300, 1100]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (checkpoint directory, prompts, transformers' tokens for each)."""
    from tests.hf_reference import hf_tokenizer

    prompts = tiny_families.prompts(PROMPT_LENGTHS)
    built = {}
    for variant in tiny_families.VARIANTS:
        directory = tmp_path_factory.mktemp(variant)
        tiny_families.save_variant(variant, directory, hf_tokenizer(), prompts[1])
        built[variant] = (
            directory,
            prompts,
            tiny_families.reference(directory, prompts, tiny_families.NEW_TOKENS),
        )
    return built


@pytest_asyncio.fixture(loop_scope="session")
async def serve():
    """serve(directory) -> a started stack of that checkpoint (stopped at the test's end)."""
    started = []

    async def start(directory):
        stack, servers = await start_stack(
            ExecutorConfig(
                model=str(directory),
                device="cpu",
                dtype="float32",
                pool_pages=400,
                buckets=(1, 2, 4),
                row_check=True,
            ),
            PlannerConfig(
                model=str(directory), scheduling=SchedulingConfig(row_check=True, prefill_token_budget=512)
            ),
        )
        started.append(servers)
        return stack

    yield start
    for servers in started:
        await stop_stack(servers)


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("variant", sorted(tiny_families.VARIANTS))
async def test_variant_equals_transformers_one_at_a_time_and_all_at_once(variant, checkpoints, serve):
    directory, prompts, expected = checkpoints[variant]
    stack = await serve(directory)
    options = [GenerateOptions(token_ids=p, max_tokens=tiny_families.NEW_TOKENS) for p in prompts]
    async with PlannerClient(stack.addr) as client:
        # All at once first, on an empty pool (every prefill fresh, chunks of several prompts in one step);
        # one at a time then resumes each from the prefix the first pass left.
        all_at_once = await asyncio.gather(*(client.generate_all(o) for o in options))
        one_at_a_time = [await client.generate_all(o) for o in options]
    for mode, results in (("one at a time", one_at_a_time), ("all at once", all_at_once)):
        got = [list(r.token_ids) for r in results]
        assert got == expected, f"{variant}, {mode}: deltaserve {got} != transformers {expected}"
    assert stack.engine.row_mismatches == 0
    if variant == tiny_families.EOS_LIST:  # the second EOS id ended a request, as it did in transformers
        second = json.loads((directory / "generation_config.json").read_text())["eos_token_id"][1]
        ended = [r for r in one_at_a_time if r.token_ids[-1] == second]
        assert ended and all(r.finish_reason == "stop" for r in ended)
    await stack.wait_idle()
    assert stack.scheduler.pages.free_count == stack.scheduler.pages.total


def test_a_rope_whose_frequencies_follow_the_sequence_is_refused(tmp_path):
    from transformers import LlamaForCausalLM

    config = tiny_families.hf_config(
        "linear_biases", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match="rope type 'dynamic' changes its frequencies with the sequence length"
    ):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_an_unsupported_model_type_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(
        ValueError, match=r"model type 'gpt2' is not supported .*supported model types: llama, qwen3"
    ):
        load_model(str(tmp_path), "cpu", torch.float32)
