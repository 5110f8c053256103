"""Executor faults over real gRPC, every service its own `deltaserve` process (issue 14, DESIGN §7
invariant 7): SIGKILL mid-generation and SIGSTOP (a hang) end the running streams with a readable
UNAVAILABLE, leak no page, slot or turn, turn health NOT_SERVING within seconds, and once the executor is
back a greedy request answers the same tokens as before. The times measured are printed (`-s`) for
docs/RELIABILITY.md."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from planner_svc.config import PlannerConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server
from protos import client_pb2, client_pb2_grpc
from protos.wire import pack_i32, unpack_i32
from tests.cli_helpers import Serving, free_port

EXECUTOR_TIMEOUT_S = 2.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = 400  # tokens a cut request would run for: it is running when the fault comes


def serve_executor(log: Path, port: int) -> Serving:
    """An executor process on the CPU, small enough for these tests: fp32, 128 pages, buckets 1, 2, 4."""
    return Serving(
        log,
        "executor",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--pool-pages",
        "128",
        "--buckets",
        "1,2,4",
    )


class Faults:
    """A planner and an executor as processes; the executor can be killed, stopped and restarted."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.executor_port, self.planner_port = free_port(), free_port()
        self.starts = 0
        self.executor = self.start_executor()
        self.executor.wait_listening(120)
        self.planner = Serving(
            tmp_path / "planner.log",
            "planner",
            "--executor",
            f"127.0.0.1:{self.executor_port}",
            "--port",
            str(self.planner_port),
            "--executor-timeout",
            str(EXECUTOR_TIMEOUT_S),
        )
        self.planner.wait_listening(120)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.planner_port}")
        self.stub = client_pb2_grpc.PlannerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.pool = ThreadPoolExecutor(4)

    def start_executor(self) -> Serving:
        self.starts += 1
        return serve_executor(self.tmp_path / f"executor{self.starts}.log", self.executor_port)

    def close(self) -> None:
        self.channel.close()
        self.pool.shutdown(cancel_futures=True)
        for serving in (self.planner, self.executor):
            if serving.process.poll() is None:
                os.kill(serving.process.pid, signal.SIGCONT)
                serving.process.kill()
                serving.process.wait(30)

    def status(self) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    def info(self) -> client_pb2.ServerInfo:
        return self.stub.GetServerInfo(client_pb2.ServerInfoRequest(), timeout=10)

    def greedy(self, text: str = "Count to ten:", max_tokens: int = 8, **fields) -> list[int]:
        request = client_pb2.GenerateRequest(text=text, max_tokens=max_tokens, **fields)
        tokens: list[int] = []
        for response in self.stub.Generate(request, timeout=120):
            tokens += unpack_i32(response.token_ids).tolist()
        return tokens

    def streaming(self, first_token: threading.Event, **fields) -> Future:
        """A long request in a thread; its future ends with its RpcError (or its tokens)."""

        def run():
            request = client_pb2.GenerateRequest(
                text="Write a long story about the sea.", max_tokens=LONG, ignore_eos=True, **fields
            )
            tokens: list[int] = []
            try:
                for response in self.stub.Generate(request, timeout=120):
                    tokens += unpack_i32(response.token_ids).tolist()
                    first_token.set()
            except grpc.RpcError as error:
                return error
            return tokens

        return self.pool.submit(run)

    def until_status(self, wanted: int, timeout: float) -> float:
        """Seconds until health says `wanted`."""
        began = time.monotonic()
        while self.status() != wanted:
            assert time.monotonic() - began < timeout, f"health did not turn {wanted} within {timeout} s"
            time.sleep(0.05)
        return time.monotonic() - began

    def until_answered(self, expected: list[int], timeout: float) -> float:
        """Seconds until a greedy request succeeds; it answers `expected`."""
        began = time.monotonic()
        while True:
            try:
                tokens = self.greedy()
                break
            except grpc.RpcError as error:
                assert error.code() is grpc.StatusCode.UNAVAILABLE, error
                assert "debug_error_string" not in error.details(), error.details()
                assert time.monotonic() - began < timeout, "no answer after the executor came back"
                time.sleep(0.1)
        assert tokens == expected
        return time.monotonic() - began


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    started = Faults(tmp_path_factory.mktemp("faults"))
    yield started
    started.close()


def cut_streams(faults: Faults, fault) -> tuple[list[grpc.RpcError], float]:
    """Two long requests (one a conversation's turn) running, then `fault()`: both end with an error."""
    firsts = [threading.Event(), threading.Event()]
    streams = [faults.streaming(firsts[0]), faults.streaming(firsts[1], conversation_id="talk")]
    for first in firsts:
        assert first.wait(60), "no token before the fault"
    fault()
    not_serving_s = faults.until_status(NOT_SERVING, 30)  # from the fault to health NOT_SERVING
    return [stream.result(timeout=60) for stream in streams], not_serving_s


def check_cut(errors, words: str) -> None:
    for error in errors:
        assert isinstance(error, grpc.RpcError), f"the stream was not cut: {error}"
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error
        details = error.details()
        assert "was lost" in details and words in details and "the request was cut after" in details, details
        assert "debug_error_string" not in details and "AioRpcError" not in details, details


def check_nothing_leaked(faults: Faults, before: client_pb2.ServerInfo) -> None:
    """After a loss every page and slot is free: the requests' and the resident conversations' (their KV
    went with the executor); nothing runs or waits."""
    after = faults.info()
    assert (after.free_pages, after.free_slots, after.running, after.waiting) == (
        before.pool_pages,
        before.slots,
        0,
        0,
    )


def test_executor_sigkill_cuts_streams_readably_frees_everything_and_recovers_on_restart(faults):
    baseline = faults.greedy()
    before = faults.info()
    assert faults.status() == SERVING

    def kill():
        faults.executor.process.kill()
        faults.executor.process.wait(10)

    errors, not_serving_s = cut_streams(faults, kill)
    check_cut(errors, "stream ended: UNAVAILABLE")
    check_nothing_leaked(faults, before)
    with pytest.raises(grpc.RpcError) as down:
        faults.greedy()
    assert down.value.code() is grpc.StatusCode.UNAVAILABLE and "reconnecting" in down.value.details()

    restarted = time.monotonic()
    faults.executor = faults.start_executor()
    faults.executor.wait_listening(120)
    listening_s = time.monotonic() - restarted
    answered_s = faults.until_answered(baseline, 60)
    assert faults.status() == SERVING
    # The conversation's KV went with the executor: its next turn reads its prompt again and says why.
    conversation = client_pb2.GenerateRequest(
        text="Write a long story about the sea.", max_tokens=2, conversation_id="talk"
    )
    last = list(faults.stub.Generate(conversation, timeout=60))[-1]
    assert last.reused_tokens == 0 and "lost with executor" in last.checkpoint, last.checkpoint
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # its turn's pages return once its last step commits
        info = faults.info()
        listed = faults.stub.ListConversations(client_pb2.ListConversationsRequest(), timeout=10)
        kept = sum(c.pages for c in listed.conversations)  # the conversation keeps its new turn's KV
        if kept and info.free_pages == before.free_pages - kept and not info.running:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(
            f"pages after the turn: {info.free_pages} free, {kept} kept, {before.free_pages}"
        )
    print(
        f"\nSIGKILL: NOT_SERVING {not_serving_s:.2f} s after the kill; restarted "
        f"executor listening after {listening_s:.2f} s, first answer {answered_s:.2f} s later"
    )


def test_executor_hang_is_caught_by_the_watchdog_and_it_recovers_after_sigcont(faults):
    baseline = faults.greedy()
    before = faults.info()
    pid = faults.executor.process.pid
    errors, not_serving_s = cut_streams(faults, lambda: os.kill(pid, signal.SIGSTOP))
    check_cut(errors, "hung: no output of step")
    assert not_serving_s < EXECUTOR_TIMEOUT_S + 10
    check_nothing_leaked(faults, before)
    os.kill(pid, signal.SIGCONT)
    answered_s = faults.until_answered(baseline, 60)
    assert faults.status() == SERVING
    check_nothing_leaked(faults, before)
    print(
        f"\nSIGSTOP: NOT_SERVING {not_serving_s:.2f} s after the stop (watchdog {EXECUTOR_TIMEOUT_S} s); "
        f"first answer {answered_s:.2f} s after SIGCONT"
    )


def test_an_idle_executors_loss_is_noticed_at_once_and_it_recovers_on_restart(faults):
    baseline = faults.greedy()  # warms up; then nothing runs and no step is in flight
    steps = faults.info().steps
    time.sleep(0.3)
    assert faults.info().steps == steps and faults.status() == SERVING
    faults.executor.process.kill()
    faults.executor.process.wait(10)
    not_serving_s = faults.until_status(NOT_SERVING, 3)  # no step sent: the stream's end says it
    restarted = time.monotonic()
    faults.executor = faults.start_executor()
    faults.executor.wait_listening(120)
    serving_s = faults.until_status(SERVING, 20)
    assert faults.greedy() == baseline
    print(
        f"\nSIGKILL while idle: NOT_SERVING {not_serving_s:.2f} s after the kill; SERVING "
        f"{serving_s:.2f} s after the restarted executor listened ({time.monotonic() - restarted:.2f} s in all)"
    )


class OverstatedVocab(GrpcLink):
    """A link whose executor seems to have a larger vocabulary than it has: the planner then plans a
    prompt the executor refuses (INVALID_ARGUMENT), a planner defect made on purpose."""

    async def describe(self):
        described = await super().describe()
        described.vocab_size += 1000
        return described


def test_a_refused_plan_fails_its_request_with_internal_and_the_engine_serves_everyone_else(tmp_path):
    port = free_port()
    executor = serve_executor(tmp_path / "executor.log", port)
    try:
        executor.wait_listening(120)
        asyncio.run(refused_plan(f"127.0.0.1:{port}"))
    finally:
        executor.process.kill()
        executor.process.wait(30)
    refusals = [e for e in executor.events() if e["event"] == "plan refused"]
    assert len(refusals) == 2 and all("outside the vocabulary" in r["error"] for r in refusals)


async def refused_plan(executor: str) -> None:
    link = OverstatedVocab(executor)
    planner = await start_planner_server(PlannerConfig(executors=[executor]), port=0, links=[link])
    engine = planner.servicer.engines[0]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{planner.port}") as channel:
            stub = client_pb2_grpc.PlannerStub(channel)

            async def generate(max_tokens: int, first: asyncio.Event | None = None, **prompt) -> list[int]:
                request = client_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True, **prompt)
                tokens: list[int] = []
                async for response in stub.Generate(request, timeout=120):
                    tokens += unpack_i32(response.token_ids).tolist()
                    if first is not None:
                        first.set()
                return tokens

            story = {"text": "Write a long story about the sea."}
            alone = await generate(24, **story)
            first = asyncio.Event()
            running = asyncio.create_task(generate(24, first, **story))
            await first.wait()
            vocab = engine.scheduler.config.vocab_size - 1000
            bad = {"token_ids": pack_i32([1, 2, vocab + 10])}
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(4, **bad)
            assert refused.value.code() is grpc.StatusCode.INTERNAL
            details = refused.value.details()
            assert "refused the step" in details and "outside the vocabulary" in details, details
            assert "debug_error_string" not in details
            assert await running == alone  # the request running beside it went on, token for token
            assert await generate(24, **story) == alone  # and the next one is served
            assert engine.serving and engine.losses == 1
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING

            # The refused step's full prompt pages never got their KV: a later prompt with that prefix reads
            # it itself rather than take them from the prefix index (another tenant's pages hash apart).
            prefix, tail = list(range(100, 140)), [300, 301]  # two full pages of 16, and more
            expected = await generate(8, token_ids=pack_i32(prefix + tail), tenant="elsewhere")
            with pytest.raises(grpc.aio.AioRpcError):
                await generate(4, token_ids=pack_i32([*prefix, vocab + 10]))
            assert await generate(8, token_ids=pack_i32(prefix + tail)) == expected
    finally:
        await planner.stop(None)
