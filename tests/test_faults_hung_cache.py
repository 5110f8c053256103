"""A hung cache service (SIGSTOP: its process alive, its connections open, nothing answered) over real gRPC,
every service a `deltaserve` process: a Put or Get under way ends UNAVAILABLE within the channels' keepalive
bound instead of waiting forever, and a planner's drain stops parking after the first park it fails instead
of paying each conversation a connect timeout. SmolLM2 on the CPU."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import grpc
import pytest

from cache_svc.client import CacheClient, _transport_failure
from planner_svc.client import PlannerClient
from planner_svc.drain import PARKING_MIN_S
from protos.rpc import INTERNAL_CHANNEL_OPTIONS, INTERNAL_KEEPALIVE_MS, INTERNAL_KEEPALIVE_TIMEOUT_MS
from tests.cli_helpers import Serving, free_port
from tests.test_faults_drain_cache import DRAIN_TIMEOUT_S, PROMPT, Stack, turn

# A hung peer is given up on once a ping goes unanswered: the ping after INTERNAL_KEEPALIVE_MS, then its timeout.
HUNG_BOUND_S = (
    INTERNAL_KEEPALIVE_MS + INTERNAL_KEEPALIVE_TIMEOUT_MS
) / 1000 + 10  # and slack for a loaded machine
CONNECT_TIMEOUT_S = 20  # gRPC's own, for a connection whose peer never says SETTINGS


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


def test_a_put_whose_send_broke_in_the_client_is_unavailable_and_the_services_statuses_stand():
    """gRPC's client sets INTERNAL "Internal error from Core" when its send fails in a broken transport, before
    the call's status arrives (the Put below failed so about one run in seven): that is an unreachable cache."""

    def error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    broke = _transport_failure(error(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert (
        broke.code() == grpc.StatusCode.UNAVAILABLE
        and "connection to the cache service broke" in broke.details()
    )
    for code, details in (
        (grpc.StatusCode.INTERNAL, "disk error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
    ):
        served = error(code, details)
        assert _transport_failure(served) is served


async def test_a_put_and_a_get_on_a_hung_cache_end_unavailable_instead_of_waiting_forever(tmp_path):
    port = free_port()
    serving = Serving(
        tmp_path / "cache.log", "cache", "serve", "--cache-dir", str(tmp_path / "c"), "--port", str(port)
    )
    try:
        serving.wait_listening(60)
        addr = f"127.0.0.1:{port}"
        async with (
            CacheClient(addr, options=INTERNAL_CHANNEL_OPTIONS) as putting,
            CacheClient(addr, options=INTERNAL_CHANNEL_OPTIONS) as getting,
        ):
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


@pytest.fixture
def stack(tmp_path, request):
    # A drain timeout of its own: long enough for a park to fail before the parking time passes (30 s)
    started = Stack(tmp_path, getattr(request, "param", DRAIN_TIMEOUT_S))
    yield started
    for serving in (started.cache, started.executor):
        serving.process.send_signal(signal.SIGCONT)
    started.close()


async def _drain_with_stopped(stack, stopped, names: list[str], within_s: float) -> tuple[dict, float]:
    """Ends a turn of each of `names`, SIGSTOPs `stopped` (a service of the stack), SIGTERMs the planner and
    waits up to `within_s` for it to exit 0: its `drained` event, none parked, and the seconds it took."""
    async with PlannerClient(stack.planner_addr) as client:
        for name in names:
            await client.generate_all(turn(name, PROMPT))
    stopped.process.send_signal(signal.SIGSTOP)
    began = time.monotonic()
    stack.planner.process.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(stack.planner.process.wait, within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the planner still drains {time.monotonic() - began:.0f} s after SIGTERM")
    took = time.monotonic() - began
    assert code == 0, stack.planner.log_path.read_text()
    [drained] = [e for e in stack.planner.events() if e["event"] == "drained"]
    assert drained["parked"] == 0, drained
    return drained, took


@pytest.mark.parametrize("stack", [CONNECT_TIMEOUT_S + HUNG_BOUND_S], indirect=True)
async def test_a_drain_behind_a_hung_cache_stops_parking_after_the_first_failure(stack):
    names = [f"hung-{i}" for i in range(4)]
    # Each park used to wait out its connect timeout: 4 conversations took 80 s.
    drained, took = await _drain_with_stopped(
        stack, stack.cache, names, CONNECT_TIMEOUT_S + HUNG_BOUND_S + 10
    )
    first, *rest = drained["not_parked"]
    assert "UNAVAILABLE" in first and "unreachable" in first, first
    assert len(rest) == len(names) - 1, drained
    assert all("not tried: the cache service did not answer its health check" in r for r in rest), rest
    print(f"drain behind a hung cache: the planner exited {took:.1f} s after SIGTERM")


async def test_a_drain_behind_a_hung_executor_parks_no_longer_than_its_parking_time(stack):
    names = [f"stuck-{i}" for i in range(4)]
    # Nothing runs: parking starts at once, and gets PARKING_MIN_S (more than the drain timeout). The first park
    # used to wait for the keepalive to give up on the executor (10-20 s), and the other conversations, their KV
    # forgotten with it, went unreported.
    drained, took = await _drain_with_stopped(stack, stack.executor, names, PARKING_MIN_S + 10)
    first, *rest = drained["not_parked"]
    parking = f"the drain's parking time of {PARKING_MIN_S:g} s"
    assert first == f"default/stuck-0: not parked within {parking}", first
    assert rest == [f"default/{name}: not tried: {parking} passed" for name in names[1:]], rest
    print(f"drain behind a hung executor: the planner exited {took:.1f} s after SIGTERM")
