"""An executor's loss racing what else runs, over real gRPC with a cache service, each interleaving driven by the
test through the planner's link (FaultyLink): a restore still answering when the pools are rebuilt gives back
only what the rebuilt pools kept for it, a plan whose send failed is counted by the recovery (its requests'
pages are not freed into the rebuilt pools later), a request whose recovery raises ends alone with INTERNAL, and a
recovery that raises is logged and the engine serves on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from cache_svc.server import start_cache_server
from executor_svc.config import ExecutorConfig
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig
from planner_svc.link import GrpcLink, LinkError, LinkLost
from planner_svc.parking import ConversationError
from protos import executor_pb2
from tests.conftest import start_stack, stop_stack
from tests.hybrid_model import build_text_model, save_layouts

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [(7 * i) % 500 + 3 for i in range(21)]
OTHER = [(11 * i) % 500 + 5 for i in range(19)]


class FaultyLink(GrpcLink):
    """The real link, with the faults a test injects where it wants them: the step stream lost while the
    engine idles (`lose`, `end_stream`), the engine's reconnect probes unanswered while `back` is clear (it
    stays lost), a restore or park held until the test answers `hold` ("answered": the executor's answer,
    "failed": the link error of an executor gone), the plan `fail_next_send` picks failing to go out (as a
    write racing the stream's end does), the next reopen raising `fail_open`, the executor describing itself
    with the fields of `described_as` changed (one restarted with another model or tables) or refusing as
    `refused_as` says (a group whose stages cannot serve together, as group_link.describe_group refuses)."""

    def __init__(self, address: str):
        super().__init__(address)
        self.holding = asyncio.Event()  # a restore or park is held
        self.hold: asyncio.Future[str] | None = None
        self.fail_send: Callable[[executor_pb2.StepPlan], bool] | None = None
        self.fail_open: Exception | None = None
        self.back = asyncio.Event()
        self.back.set()
        self.described_as: dict[str, object] = {}
        self.refused_as: str | None = None
        self.refusals = 0  # probes refused as `refused_as` says
        self._lost = asyncio.Event()
        self._reopened = asyncio.Event()

    def end_stream(self) -> None:
        """The step stream ends now (the idle engine notices it at once)."""
        self._reopened.clear()
        self._lost.set()

    async def lose(self) -> None:
        """The step stream ends now; returns once the engine has recovered and reopened it."""
        self.end_stream()
        await self.reopened()

    def fail_next_send(self, which: Callable[[executor_pb2.StepPlan], bool]) -> None:
        self._reopened.clear()
        self.fail_send = which

    async def reopened(self) -> None:
        """Once the engine has recovered from the fault and reopened the stream."""
        await self._reopened.wait()

    async def describe(self) -> executor_pb2.ExecutorDescription:
        await self.back.wait()
        if self.refused_as is not None:
            self.refusals += 1
            raise ValueError(self.refused_as)
        described = await super().describe()
        for name, value in self.described_as.items():
            setattr(described, name, value)
        return described

    async def until_ended(self) -> str:
        await self._lost.wait()
        self._lost.clear()
        return "stream ended: UNAVAILABLE: lost on purpose"

    async def open(self) -> None:
        if self.fail_open is not None:
            error, self.fail_open = self.fail_open, None
            raise error
        await super().open()
        self._reopened.set()

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        if self.fail_send is not None and self.fail_send(plan):
            self.fail_send = None
            raise LinkLost("stream ended: INTERNAL: Internal error from Core")
        await super().send(plan)

    async def _held(self) -> None:
        if self.hold is not None:
            self.holding.set()
            answer = await self.hold
            self.hold = None
            if answer == "failed":
                raise LinkError("the executor is gone")

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        await self._held()
        return await super().restore(request)

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        await self._held()
        return await super().park(request)


def executor_config(model_dir: str, cache: str | None = None) -> ExecutorConfig:
    """The tiny hybrid's executor with room for a few conversations; `cache`: its cache service's address."""
    return ExecutorConfig(
        model=model_dir,
        device="cpu",
        dtype="float32",
        pool_pages=32,
        page_size=16,
        buckets=(1, 2),
        state_slots=6,
        cache=cache,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tmp_path_factory):
    from tests.hf_reference import hf_tokenizer

    root = tmp_path_factory.mktemp("loss_races")
    model_dir, _ = save_layouts(build_text_model(), str(root / "model"), hf_tokenizer())
    cache = await start_cache_server(str(root / "cache"), budget_bytes=1 << 30)
    address = f"127.0.0.1:{cache.port}"
    executor = executor_config(model_dir, address)
    stack, servers = await start_stack(
        executor, PlannerConfig(model=model_dir, cache=address), link=FaultyLink
    )
    yield stack
    await stop_stack([*servers, cache])


async def _turn(stack, client: PlannerClient, name: str, prompt: list[int] = PROMPT):
    await client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=3, conversation_id=name))
    await stack.wait_idle()
    (conversation,) = [c for c in stack.scheduler.conversations.every() if c.conversation_id == name]
    return conversation


def _check_pools(stack, held_pages: list[int], held_states: list[int]) -> None:
    """Exactly these pages (once each) and state slots are taken; the rest is free."""
    pages, states = stack.scheduler.pages, stack.scheduler.states
    pages.check()
    states.check()
    assert [pages.refcount(p) for p in held_pages] == [1] * len(held_pages)
    assert pages.free_count == pages.total - len(held_pages)
    assert states.free_count == states.total - len(held_states)


@pytest.mark.parametrize("changed", [{"model_fingerprint": "another"}, {"vocab_size": 4096}])
async def test_an_executor_back_as_another_model_is_not_attached(stack, changed):
    """Its tokens would stream under this model's tokenizer and stop ids: the engine stays lost, saying why,
    until the executor it attached to is back."""
    link, engine = stack.engine.link, stack.engine
    link.described_as = changed
    with capture_logs() as logs:
        link.end_stream()
        while not any(e["event"].startswith("the executor came back as another model") for e in logs):
            await asyncio.sleep(0.05)
        assert not engine.serving
        link.described_as = {}
        await link.reopened()
    assert engine.serving
    (name,) = changed
    assert any(name in change for e in logs if "changed" in e for change in e["changed"])
    async with PlannerClient(stack.addr) as client:
        assert (await client.generate_all(GenerateOptions(token_ids=PROMPT, max_tokens=2))).token_ids


async def test_a_group_back_but_unable_to_serve_says_why_once(stack):
    """A stage restarted without --cache makes its group refuse to serve as one: the planner says so (once,
    while the probes go on each second), where it used to wait silently; it attaches once the group is fixed."""
    link, engine = stack.engine.link, stack.engine
    link.refused_as = "stage 1 has no cache service (no --cache), stage 0 a cache service (--cache)"
    with capture_logs() as logs:
        link.end_stream()
        deadline = asyncio.get_running_loop().time() + 60
        while link.refusals < 3:  # probes 0.1, 0.2, 0.4 s apart, then up to 1 s
            assert asyncio.get_running_loop().time() < deadline, "the planner stopped probing"
            await asyncio.sleep(0.05)
        said = [e for e in logs if e["event"] == "the executor group is back but cannot serve"]
        assert [(e["error"], e["log_level"]) for e in said] == [(link.refused_as, "error")]
        assert not engine.serving
        link.refused_as = None
        await link.reopened()
    assert engine.serving
    async with PlannerClient(stack.addr) as client:
        assert (await client.generate_all(GenerateOptions(token_ids=PROMPT, max_tokens=2))).token_ids


def _forget(stack, *conversations) -> None:
    for conversation in conversations:
        stack.scheduler.return_pages(conversation.forget())
        stack.scheduler.conversations.remove(conversation)


@pytest.mark.parametrize("answer", ["answered", "failed"])
async def test_a_restore_answering_after_the_loss_gives_back_only_what_the_rebuilt_pools_kept(stack, answer):
    link, scheduler = stack.engine.link, stack.scheduler
    async with PlannerClient(stack.addr) as client:
        parked = await _turn(stack, client, "parked")
        assert (await client.park("parked")).bytes > 0
        _check_pools(stack, [], [])
        link.hold = asyncio.get_running_loop().create_future()
        link.holding.clear()
        resume = asyncio.ensure_future(stack.planner.turns.resume(parked.tenant, "parked"))
        await link.holding.wait()  # its pages and state slots taken; the executor has not answered
        lent_pages = [p for p in range(1, scheduler.pages.num_pages) if scheduler.pages.refcount(p)]
        lent_states = scheduler.states.total - scheduler.states.free_count
        assert lent_pages and lent_states
        losses = stack.engine.losses
        await link.lose()
        assert stack.engine.losses == losses + 1 and stack.engine.serving
        # The rebuilt pools keep the loan out: the executor may still write into it.
        assert [scheduler.pages.refcount(p) for p in lent_pages] == [1] * len(lent_pages)
        assert scheduler.states.total - scheduler.states.free_count == lent_states
        other = await _turn(stack, client, "other", OTHER)  # takes pages and state slots of the rebuilt pools
        assert other.pages and other.states and not set(other.pages) & set(lent_pages)
        link.hold.set_result(answer)
        with pytest.raises(ConversationError) as refused:
            await resume
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        reason = "the executor was lost while" if answer == "answered" else "the executor is gone"
        assert reason in str(refused.value), refused.value
        assert not parked.pages and not parked.states
        _check_pools(stack, other.pages, list(other.states.values()))
        # The snapshot is still in the cache: the next resume restores it.
        await client.resume("parked")
        assert parked.pages and parked.states
        _forget(stack, parked, other)
        _check_pools(stack, [], [])


async def test_a_park_answering_after_the_loss_gives_back_what_the_rebuilt_pools_kept(stack):
    """The executor reads the conversation's pages and state slots until it answers: the rebuilt pools keep them
    out meanwhile (a request writing them would corrupt the snapshot), and take them back once it has."""
    link = stack.engine.link
    async with PlannerClient(stack.addr) as client:
        kept = await _turn(stack, client, "kept")
        lent_pages, lent_states = list(kept.pages), list(kept.states.values())
        link.hold = asyncio.get_running_loop().create_future()
        link.holding.clear()
        park = asyncio.ensure_future(stack.planner.turns.park(kept.tenant, "kept"))
        await link.holding.wait()
        await link.lose()
        assert not kept.pages and not kept.states and not kept.tokens  # its KV went with the executor
        _check_pools(stack, lent_pages, lent_states)  # but what the executor reads stays out
        other = await _turn(stack, client, "other", OTHER)
        assert not set(other.pages) & set(lent_pages)
        assert not set(other.states.values()) & set(lent_states)
        link.hold.set_result("answered")
        reply, _ = await park
        assert reply.bytes > 0 and not kept.parked and not kept.parking
        _check_pools(stack, other.pages, list(other.states.values()))
        await client.resume("kept")  # the snapshot the executor wrote is in the cache
        assert kept.pages and kept.states
        _forget(stack, kept, other)
        _check_pools(stack, [], [])


async def test_a_plan_whose_send_failed_is_counted_by_the_recovery(stack):
    """The send of a step carrying a decoding row and a new prompt fails (handled as a loss): the decoding request
    is cut, the new one runs again, and the cut one's pages are freed into the pool they came from, not into the
    rebuilt one when the re-planned step commits (that freed pages twice and stopped the engine)."""
    link, engine = stack.engine.link, stack.engine
    async with PlannerClient(stack.addr) as client:
        alone = await client.generate_all(GenerateOptions(token_ids=OTHER, max_tokens=4, ignore_eos=True))
        losses = engine.losses
        stream = client.generate(GenerateOptions(token_ids=PROMPT, max_tokens=60, ignore_eos=True))
        await stream.__anext__()  # it decodes
        link.fail_next_send(lambda plan: bool(plan.prefill) and plan.bucket > 0)
        late = await client.generate_all(GenerateOptions(token_ids=OTHER, max_tokens=4, ignore_eos=True))
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            async for _ in stream:
                pass
        assert cut.value.code() is grpc.StatusCode.UNAVAILABLE and "was lost" in (cut.value.details() or "")
        assert late.token_ids == alone.token_ids
        await stack.wait_idle()
        assert engine.losses == losses + 1 and engine.serving
        _check_pools(stack, [], [])


async def test_a_request_whose_recovery_raises_ends_with_internal_and_the_engine_serves_on(stack):
    """A planner defect made on purpose: a decoding request's pages are freed behind its back, so cutting it when
    the executor is lost raises. That request alone ends with INTERNAL naming the defect; the engine serves on."""
    link, engine, scheduler = stack.engine.link, stack.engine, stack.scheduler
    async with PlannerClient(stack.addr) as client:
        alone = await client.generate_all(GenerateOptions(token_ids=OTHER, max_tokens=4, ignore_eos=True))
        losses = engine.losses
        stream = client.generate(GenerateOptions(token_ids=PROMPT, max_tokens=60, ignore_eos=True))
        await stream.__anext__()  # it decodes
        (broken,) = scheduler.decoding
        scheduler.pages.free(broken.pages)
        link.fail_next_send(lambda plan: True)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stream:
                pass
        assert failed.value.code() is grpc.StatusCode.INTERNAL
        details = failed.value.details() or ""
        assert "could not recover this request after the executor's loss: ValueError: page" in details, (
            details
        )
        await link.reopened()
        again = await client.generate_all(GenerateOptions(token_ids=OTHER, max_tokens=4, ignore_eos=True))
        assert again.token_ids == alone.token_ids and engine.losses == losses + 1
        await stack.wait_idle()
        _check_pools(stack, [], [])


async def test_a_recovery_that_raises_is_logged_and_the_engine_serves_on(stack):
    link, engine = stack.engine.link, stack.engine
    async with PlannerClient(stack.addr) as client:
        alone = await client.generate_all(GenerateOptions(token_ids=OTHER, max_tokens=4, ignore_eos=True))
        losses = engine.losses
        link.fail_open = RuntimeError("a planner defect, on purpose")
        with capture_logs() as logs:
            await link.lose()  # the first recovery raises when it reopens the stream; the second one ends
        failed = [e for e in logs if e["event"].startswith("recovery failed")]
        assert len(failed) == 1 and failed[0]["log_level"] == "error" and failed[0]["exc_info"], logs
        assert engine.serving and engine.losses == losses + 2
        again = await client.generate_all(GenerateOptions(token_ids=OTHER, max_tokens=4, ignore_eos=True))
        assert again.token_ids == alone.token_ids
        await stack.wait_idle()
        _check_pools(stack, [], [])
