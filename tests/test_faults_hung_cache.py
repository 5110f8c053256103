"""A hung cache service (SIGSTOP: its process alive, its connections open, nothing answered) over real gRPC,
every service a `deltaserve` process: a Put or Get under way ends UNAVAILABLE within the channels' keepalive
bound instead of waiting forever."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc

from cache_svc.client import CacheClient
from protos.rpc import KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS
from tests.test_cli import Serving, free_port

# A hung peer is given up on once a ping goes unanswered: the ping after KEEPALIVE_MS, then its timeout.
HUNG_BOUND_S = (KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 10  # and slack for a loaded machine


def manifest(conversation_id: str) -> dict:
    return {
        "conversation_id": conversation_id,
        "token_ids": [1, 2, 3],
        "checkpoints": [{"position": 3}],
        "model_fingerprint": "hung-cache-test",
        "num_layers": 1,
        "page_size": 16,
        "dtype": "float32",
        "shards": [{"layers": [0, 1]}],
    }


async def test_a_put_and_a_get_on_a_hung_cache_end_unavailable_instead_of_waiting_forever(tmp_path):
    port = free_port()
    serving = Serving(
        tmp_path / "cache.log", "cache", "serve", "--cache-dir", str(tmp_path / "c"), "--port", str(port)
    )
    try:
        serving.wait_listening(60)
        addr = f"127.0.0.1:{port}"
        async with CacheClient(addr) as putting, CacheClient(addr) as getting:
            await putting.put(manifest("stored"), [bytes(4096)])
            await getting.stat()  # both connected before the cache hangs
            serving.process.send_signal(signal.SIGSTOP)
            began = time.monotonic()
            put = putting.put(manifest("more"), [bytes(16 << 20)])  # more than the socket buffers hold
            get = getting.get("default", "stored")
            outcomes = await asyncio.wait_for(
                asyncio.gather(put, get, return_exceptions=True), HUNG_BOUND_S + 30
            )
            took = time.monotonic() - began
        for outcome in outcomes:
            assert isinstance(outcome, grpc.aio.AioRpcError), outcome
            assert outcome.code() == grpc.StatusCode.UNAVAILABLE, outcome.details()
        assert took < HUNG_BOUND_S, took
        print(f"a hung cache's Put and Get ended UNAVAILABLE after {took:.1f} s")
    finally:
        serving.process.send_signal(signal.SIGCONT)
        serving.process.kill()
        serving.process.wait()
