"""Faults of issue 14 (cases 6 and 7) over real gRPC, with cache, executor and planner as separate
`deltaserve` processes on 127.0.0.1: planner SIGTERM drains (cuts what outlives --drain-timeout, parks
every conversation in the KV pool, exits 0) and a restarted planner resumes them with the same tokens;
cache SIGKILL during a park and during a restore; a corrupted snapshot is quarantined; a snapshot over
the whole budget is RESOURCE_EXHAUSTED with sizes; resume of a deleted snapshot is NOT_FOUND. Each case
checks that no page or slot leaked (GetServerInfo). SmolLM2 on the CPU, few and short requests."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from cache_svc.client import CacheClient
from cache_svc.manifest import snapshot_key
from planner_svc.client import GenerateOptions, PlannerClient
from tests.cli_helpers import Serving, deltaserve_json, free_port

DRAIN_TIMEOUT_S = 2.0
PROMPT = [504, 3575, 282, 4649, 314] * 4  # 20 tokens: one whole page of 16 and a part


class Stack:
    """cache, executor and planner, each `deltaserve` in its own process."""

    def __init__(self, root: Path, drain_timeout_s: float = DRAIN_TIMEOUT_S):
        self.root, self.drain_timeout_s = root, drain_timeout_s
        self.cache_dir = root / "snapshots"
        self.ports = {name: free_port() for name in ("cache", "executor", "planner")}
        self.cache_addr = f"127.0.0.1:{self.ports['cache']}"
        self.planner_addr = f"127.0.0.1:{self.ports['planner']}"
        self.started = 0
        self.cache = self.start_cache()
        self.executor = self.spawn(
            "executor",
            "--port",
            str(self.ports["executor"]),
            "--cache",
            self.cache_addr,
            "--device",
            "cpu",
            "--pool-pages",
            "160",
            "--buckets",
            "1,2,4",
            "--max-seq-len",
            "2048",
        )
        self.executor.wait_listening(180)
        self.planner = self.start_planner()

    def spawn(self, name: str, *argv: str) -> Serving:
        self.started += 1
        return Serving(self.root / f"{self.started:02d}-{name}.log", name, *argv)

    def start_cache(self, budget_gib: float = 1.0) -> Serving:
        cache = self.spawn(
            "cache",
            "serve",
            "--cache-dir",
            str(self.cache_dir),
            "--port",
            str(self.ports["cache"]),
            "--cache-budget-gib",
            str(budget_gib),
        )
        cache.wait_listening(60)
        return cache

    def restart_cache(self, budget_gib: float = 1.0) -> None:
        if self.cache.process.poll() is None:
            assert self.cache.stop() == 0
        self.cache = self.start_cache(budget_gib)

    def start_planner(self) -> Serving:
        planner = self.spawn(
            "planner",
            "--port",
            str(self.ports["planner"]),
            "--executor",
            f"127.0.0.1:{self.ports['executor']}",
            "--cache",
            self.cache_addr,
            "--drain-timeout",
            str(self.drain_timeout_s),
            "--no-prefix-cache",  # every page free or a conversation's: what the leak checks count
        )
        planner.wait_listening(60)
        return planner

    def close(self) -> None:
        for serving in (self.planner, self.executor, self.cache):
            if serving.process.poll() is None:
                serving.process.kill()
                serving.process.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    started = Stack(tmp_path_factory.mktemp("faults"))
    yield started
    started.close()


def turn(conversation_id: str, prompt: list[int], max_tokens: int = 4) -> GenerateOptions:
    return GenerateOptions(
        token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, conversation_id=conversation_id
    )


async def reference(client: PlannerClient, prompt: list[int]) -> list[int]:
    """What a never-parked run answers: the whole prompt read, no conversation."""
    return (
        await client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=4, ignore_eos=True))
    ).token_ids


async def expect_status(awaitable, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await awaitable
    assert refused.value.code() == code, refused.value.details()
    for fragment in fragments:
        assert fragment in refused.value.details(), refused.value.details()
    return refused.value.details() or ""


async def assert_nothing_leaked(client: PlannerClient) -> None:
    """Every slot free, and every page either free or held by a conversation."""
    info = await client.server_info()
    held = sum(c.pages for c in await client.conversations())
    assert (info.running, info.waiting, info.free_slots) == (0, 0, info.slots)
    assert info.free_pages + held == info.pool_pages, (info.free_pages, held, info.pool_pages)


async def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def park_when_reachable(client: PlannerClient, conversation_id: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await client.park(conversation_id)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_planner_sigterm_parks_live_conversations_and_a_restart_resumes_them(stack):
    async with PlannerClient(stack.planner_addr) as client:
        firsts = {c: await client.generate_all(turn(c, PROMPT)) for c in ("drain-a", "drain-b", "drain-c")}
        # Far past the drain timeout on any CPU (400 tokens once took ~2 s on a fast one and ended before the cut).
        # A conversation's turn: the cut gives its pages back only when its last step commits, and the drain
        # must still park it.
        cut_prompt = PROMPT + firsts["drain-c"].token_ids + [30, 504]
        long = asyncio.ensure_future(client.generate_all(turn("drain-c", cut_prompt, max_tokens=2000)))

        async def running() -> bool:
            return (await client.server_info()).running > 0

        await wait_for(running)
        stack.planner.process.send_signal(signal.SIGTERM)
        began = time.monotonic()
        await asyncio.sleep(0.3)
        await expect_status(client.generate_all(turn("", PROMPT)), grpc.StatusCode.UNAVAILABLE, "draining")
        await expect_status(
            long, grpc.StatusCode.UNAVAILABLE, "draining", f"after the drain timeout of {DRAIN_TIMEOUT_S:g} s"
        )
    code = await asyncio.to_thread(stack.planner.process.wait, 60)
    drain_s = time.monotonic() - began
    assert code == 0, stack.planner.log_path.read_text()
    assert drain_s < DRAIN_TIMEOUT_S + 10, drain_s
    [drained] = [e for e in stack.planner.events() if e["event"] == "drained"]
    assert (drained["cut"], drained["parked"], drained["not_parked"]) == (1, 3, []), drained
    print(f"drain took {drain_s:.2f} s (drained in {drained['seconds']} s)")

    restarted = time.monotonic()
    stack.planner = stack.start_planner()
    async with PlannerClient(stack.planner_addr) as client:
        for c, first in firsts.items():
            prompt = PROMPT + first.token_ids + [30, 504]
            second = await client.generate_all(turn(c, prompt))
            if c == "drain-a":
                print(f"planner restart to the first resumed answer: {time.monotonic() - restarted:.2f} s")
            cut = c == "drain-c"  # its snapshot holds the cut turn's committed tokens, past its prompt
            assert (
                second.checkpoint.startswith("snapshot@")
                if cut
                else second.checkpoint == f"snapshot@{len(PROMPT)}"
            )
            assert int(second.checkpoint.removeprefix("snapshot@")) >= len(PROMPT), second.checkpoint
            assert second.token_ids == await reference(client, prompt)
        await assert_nothing_leaked(client)


async def test_resume_of_a_deleted_snapshot_is_not_found_and_it_is_no_longer_parked(stack):
    async with PlannerClient(stack.planner_addr) as client, CacheClient(stack.cache_addr) as cache:
        for c in ("gone-a", "gone-b"):
            await client.generate_all(turn(c, PROMPT))
            assert (await client.park(c)).bytes > 0
            await cache.delete("default", c)
        # Resumed straight away: the planner still thought it parked; the cache says it is not there.
        await expect_status(client.resume("gone-a"), grpc.StatusCode.NOT_FOUND, "gone-a")
        # Listed first: the planner's view follows the cache.
        assert not [c for c in await client.conversations() if c.conversation_id == "gone-b"]
        await expect_status(client.resume("gone-b"), grpc.StatusCode.NOT_FOUND, "gone-b")
        again = await client.generate_all(turn("gone-a", PROMPT))
        assert again.checkpoint == "none" and again.read_tokens == len(PROMPT)
        await assert_nothing_leaked(client)


async def test_a_corrupted_snapshot_is_quarantined_listed_and_not_offered_after_a_restart(stack):
    async with PlannerClient(stack.planner_addr) as client:
        first = await client.generate_all(turn("bad", PROMPT))
        await client.park("bad")
        key = snapshot_key("default", "bad")
        assert key in [s["key"] for s in deltaserve_json("cache", "ls", "--addr", stack.cache_addr)]
        directory = stack.cache_dir / "snapshots" / key
        blob = sorted(p for p in directory.iterdir() if p.suffix == ".blob")[-1]
        with open(blob, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0x01]))
        await expect_status(client.resume("bad"), grpc.StatusCode.DATA_LOSS, "checksum mismatch")
        await assert_nothing_leaked(client)
    stack.restart_cache()
    assert key not in [s["key"] for s in deltaserve_json("cache", "ls", "--addr", stack.cache_addr)]
    [aside] = [
        s for s in deltaserve_json("cache", "ls", "--all", "--addr", stack.cache_addr) if s["quarantined"]
    ]
    assert aside["conversation_id"] == "bad" and "checksum mismatch" in aside["quarantined"]
    assert not directory.exists() and any((stack.cache_dir / "quarantine").iterdir())
    assert f"(in {stack.cache_dir / 'quarantine' / key}." in aside["quarantined"]
    async with PlannerClient(stack.planner_addr) as client:
        await expect_status(client.resume("bad"), grpc.StatusCode.NOT_FOUND, "bad")
        prompt = PROMPT + first.token_ids + [30, 504]
        again = await client.generate_all(turn("bad", prompt))
        assert again.checkpoint == "none", again.checkpoint
        assert again.token_ids == await reference(client, prompt)
        await assert_nothing_leaked(client)


async def test_a_snapshot_over_the_whole_budget_is_resource_exhausted_with_sizes(stack):
    stack.restart_cache(budget_gib=0.0001)  # about 107 kB: one SmolLM2 page set is more
    try:
        async with PlannerClient(stack.planner_addr) as client:
            first = await client.generate_all(turn("big", PROMPT))
            await expect_status(
                park_when_reachable(client, "big"),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "exceeds the cache budget of 107374 bytes",
            )
            # Still in the pool: its next turn mounts its checkpoint.
            second = await client.generate_all(turn("big", PROMPT + first.token_ids + [30, 504]))
            assert second.checkpoint == f"checkpoint@{len(PROMPT)}"
            await assert_nothing_leaked(client)
    finally:
        stack.restart_cache()


async def test_cache_sigkill_during_a_park_and_during_a_restore(stack):
    async with PlannerClient(stack.planner_addr) as client:
        first = await client.generate_all(turn("killed", PROMPT))
        # Park: the cache hangs (SIGSTOP) while the park is under way, then dies.
        stack.cache.process.send_signal(signal.SIGSTOP)
        park = asyncio.ensure_future(client.park("killed"))
        await asyncio.sleep(0.5)
        stack.cache.process.kill()
        await asyncio.to_thread(stack.cache.process.wait)
        await expect_status(park, grpc.StatusCode.UNAVAILABLE, "unreachable")
        await assert_nothing_leaked(client)
        stack.restart_cache()
        live = deltaserve_json("cache", "ls", "--addr", stack.cache_addr)
        assert "killed" not in [s["conversation_id"] for s in live]  # nothing half written
        assert not (stack.cache_dir / "snapshots" / snapshot_key("default", "killed")).exists()
        # The conversation kept its pages: parked now (once the executor's channel to the cache has
        # reconnected: it backs off after the refused connections), then the cache dies during the restore.
        assert (await park_when_reachable(client, "killed")).bytes > 0
        stack.cache.process.send_signal(signal.SIGSTOP)
        resume = asyncio.ensure_future(client.resume("killed"))
        await asyncio.sleep(0.5)
        stack.cache.process.kill()
        await asyncio.to_thread(stack.cache.process.wait)
        await expect_status(resume, grpc.StatusCode.UNAVAILABLE, "not restored")
        await assert_nothing_leaked(client)
        stack.restart_cache()
        prompt = PROMPT + first.token_ids + [30, 504]
        again = await client.generate_all(turn("killed", prompt))
        # Resumed from the snapshot, or (the channel to the cache still backing off) read again, saying why.
        read_again = again.checkpoint == "none" or again.checkpoint.startswith(
            "none (snapshot refused: UNAVAILABLE"
        )
        assert again.checkpoint == f"snapshot@{len(PROMPT)}" or read_again, again.checkpoint
        assert again.token_ids == await reference(client, prompt)
        await assert_nothing_leaked(client)
