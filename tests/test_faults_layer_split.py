"""A layer split under churn and faults, each stage its own process (gloo) on a tiny random Qwen3 (q/k norms,
its own head_dim): a randomized soak with the row check on every stage (0 mismatches), then greedy tokens equal
to transformers' all at once and one at a time; a stage SIGKILLed mid-step loses its group, handled as a lost
executor (the stream ends UNAVAILABLE, health NOT_SERVING, the surviving stage exits by itself), and once the
group is restarted the planner serves again with the same greedy tokens. And `up --layer-split` (a tiny
Llama)."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.soak import one_request
from planner_svc.client import GenerateOptions, PlannerClient
from tests import tiny_families
from tests.split_stages import StageGroup, start_group_planner

pytestmark = pytest.mark.asyncio(loop_scope="session")

LAYERS = 4
RANGES = [(0, 1), (1, LAYERS)]  # uneven
# A tiny model's stages on the CPU: small pools, small buckets, small pages
TINY_STAGE_FLAGS = (
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--pool-pages",
    "64",
    "--buckets",
    "1,2,4",
    "--page-size",
    "4",
)
VOCAB = 64
PARITY_TOKENS = 12
SERVING = health_pb2.HealthCheckResponse.SERVING


def tiny_checkpoint(path, variant: str) -> str:
    """A tiny random checkpoint of a tests/tiny_families variant: LAYERS layers over VOCAB ids."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_families.hf_config(
        variant, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(path)
    return str(path)


async def health(addr: str) -> int:
    async with grpc.aio.insecure_channel(addr) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def until(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not await predicate():
        assert time.monotonic() - started < timeout, f"{what} not within {timeout:g} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_a_split_soaks_with_no_row_mismatch_and_a_lost_stage_loses_its_group(tmp_path):
    model = tiny_checkpoint(tmp_path / "tiny", "qwen3")
    flags = ("--model", model, *TINY_STAGE_FLAGS)
    group = StageGroup(tmp_path, RANGES, flags=flags)
    planner = None
    try:
        group.wait_listening()
        stack, planner = await start_group_planner(group.addresses, executor_timeout=2.0)
        stack_engine = stack.engine  # the group attached as one engine
        rng = random.Random(18)
        async with PlannerClient(stack.addr) as client:
            await asyncio.gather(*(one_request(client, rng, i, VOCAB) for i in range(30)))
            await stack.wait_idle()
            assert stack_engine.row_mismatches == 0
            assert stack_engine.steps > 50
            scheduler = stack.scheduler
            assert scheduler.pages.free_count == scheduler.pages.total
            await equals_transformers(client, model)
            prompt = GenerateOptions(token_ids=[5, 9, 17, 3], max_tokens=12, ignore_eos=True)
            before = (await client.generate_all(prompt)).token_ids

            # A stage killed while a request streams: the group is lost.
            long = GenerateOptions(token_ids=[7, 8, 9], max_tokens=100, ignore_eos=True)
            stream = client.generate(long)
            await stream.__anext__()
            group.kill(1)
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                async for _ in stream:
                    pass
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value.details()
            waited = await until(lambda: _not_serving(stack.addr), 10, "NOT_SERVING")
            print(f"NOT_SERVING {waited:.2f} s after the kill")
            survivor = group.stages[0].process
            await until(lambda: _exited(survivor), 15, "the surviving stage's exit")
            assert survivor.returncode == 3
            assert stack.scheduler.pages.free_count == stack.scheduler.pages.total

            group.stop()
            group = StageGroup(tmp_path, RANGES, flags=flags, ports=group.ports)  # where the planner knows it
            group.wait_listening()
            back = await until(lambda: _serving(stack.addr), 60, "SERVING again")
            print(f"SERVING {back:.2f} s after the restarted group listens")
            assert (await client.generate_all(prompt)).token_ids == before
            assert stack_engine.row_mismatches == 0
    finally:
        if planner is not None:
            await planner.stop(None)
        group.stop()


async def equals_transformers(client: PlannerClient, model: str) -> None:
    """Greedy tokens of prompts over one to several pages equal transformers' fp32 ones, all at once and one at
    a time."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 22)]
    expected = [
        tiny_families.hf_greedy(reference, p, PARITY_TOKENS, [reference.config.eos_token_id]) for p in prompts
    ]
    options = [GenerateOptions(token_ids=p, max_tokens=PARITY_TOKENS) for p in prompts]
    all_at_once = await asyncio.gather(*(client.generate_all(o) for o in options))
    assert [r.token_ids for r in all_at_once] == expected
    assert [(await client.generate_all(o)).token_ids for o in options] == expected


async def _serving(addr: str) -> bool:
    return await health(addr) == SERVING


async def _not_serving(addr: str) -> bool:
    return await health(addr) != SERVING


async def _planner_listening(up, port: int) -> bool:
    """Up's own listening line (its stages log theirs to the same stderr)."""
    assert up.process.poll() is None, up.log_path.read_text()[-3000:]
    return any(e["event"] == "listening" and e["addr"].endswith(f":{port}") for e in up.events())


async def _exited(process) -> bool:
    return process.poll() is not None


async def test_up_layer_split_runs_the_stages_as_processes(tmp_path):
    """`deltaserve up --layer-split 1,3` on the CPU: three stage processes behind its planner, the same greedy
    tokens as the whole model in one executor; with --metrics-port each stage serves its executor's metrics
    on a port of its own, named in the listening line."""
    import urllib.request

    from executor_svc.config import ExecutorConfig
    from tests.cli_helpers import Serving, deltaserve_json, free_port
    from tests.conftest import start_stack, stop_stack
    from tests.hf_reference import hf_tokenizer

    model = tiny_checkpoint(tmp_path / "tiny", "llama3")
    hf_tokenizer().save_pretrained(model)  # `up`'s planner reads its tokenizer from --model
    common = (
        "--model",
        model,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--pool-pages",
        "64",
        "--buckets",
        "1,2",
    )
    keys = tmp_path / "keys.txt"
    keys.write_text("split-key-0123456789 alice\n")
    port = free_port()
    up = Serving(
        tmp_path / "up.log",
        "up",
        *common,
        "--layer-split",
        "1,3",
        "--port",
        str(port),
        "--cache",
        "off",
        "--metrics-port",
        str(free_port()),
        "--api-keys",  # the stages take up's own service key alone (a file only up and they read)
        str(keys),
    )
    try:
        await until(lambda: _planner_listening(up, port), 180, "up's planner listening")
        asked = (
            "--token-ids",
            "5,9,17,3",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--addr",
            f"127.0.0.1:{port}",
            "--api-key",
            "split-key-0123456789",
        )
        split = deltaserve_json("generate", *asked)
        stages = [e for e in up.events() if e["event"] == "starting stage"]
        assert [s["layers"] for s in stages] == ["0:1", "1:3", "3:4"]
        (listening,) = [e for e in up.events() if e["event"] == "listening" and e.get("executor")]  # up's
        stage_metrics = listening["stage_metrics"].split(",")
        assert len(stage_metrics) == 3
        for addr in stage_metrics:
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as answer:
                assert b"deltaserve_executor_step_seconds" in answer.read()
    finally:
        assert up.stop() == 0
    stack, servers = await start_stack(
        ExecutorConfig(model=model, device="cpu", dtype="float32", pool_pages=64)
    )
    try:
        async with PlannerClient(stack.addr) as client:
            whole = await client.generate_all(
                GenerateOptions(token_ids=[5, 9, 17, 3], max_tokens=12, ignore_eos=True)
            )
    finally:
        await stop_stack(servers)
    assert split["token_ids"] == whole.token_ids
