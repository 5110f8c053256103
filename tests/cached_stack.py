"""Cache, executor and planner on loopback serving SmolLM2, restartable on the same cache directory, and a
conversation's turn over it: what the conversation tests (tests/test_e2e_conversation_*.py,
tests/test_e2e_delete.py) run on."""

from __future__ import annotations

from cache_svc.server import start_cache_server
from executor_svc.config import ExecutorConfig
from planner_svc.config import PlannerConfig, SchedulingConfig
from protos import client_pb2
from protos.wire import unpack_i32
from tests.conftest import SMOL_BUCKETS, start_stack, stop_stack

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
PAGE = 16


class CachedStack:
    """Cache, executor and planner on loopback, restartable on the same cache directory."""

    def __init__(self, cache_dir: str, pool_pages: int = 400, cache_bytes: int = 2 << 30):
        self.cache_dir, self.pool_pages, self.cache_bytes = cache_dir, pool_pages, cache_bytes
        self.servers = []

    async def start(self):
        cache = await start_cache_server(self.cache_dir, budget_bytes=self.cache_bytes)
        address = f"127.0.0.1:{cache.port}"
        self.stack, servers = await start_stack(
            ExecutorConfig(
                device="cpu", dtype="float32", pool_pages=self.pool_pages, buckets=SMOL_BUCKETS, cache=address
            ),
            PlannerConfig(cache=address, scheduling=SchedulingConfig(prefill_token_budget=512)),
        )
        self.servers = [*servers, cache]
        return self.stack

    async def stop(self):
        await stop_stack(self.servers)


async def turn(client, chat, conversation="", max_tokens=8, **fields):
    """One Generate, gathering the final message's mount details."""
    tokens, last = [], None
    async for response in client._stub.Generate(
        client_pb2.GenerateRequest(
            chat=client_pb2.ChatMessages(messages=[client_pb2.ChatMessage(**m) for m in chat]),
            max_tokens=max_tokens,
            conversation_id=conversation,
            **fields,
        )
    ):
        tokens += unpack_i32(response.token_ids).tolist()
        last = response
    return tokens, last


def reply(stack, tokens):
    return stack.planner.tokenizer.decode(tokens, skip_special_tokens=True)
