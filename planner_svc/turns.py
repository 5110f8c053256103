"""A conversation's turns: which executor group serves it, mounting its checkpoint (or restoring its
snapshot first), one turn at a time under its turn lock, parking, deleting and relieving KV pressure."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog

from planner_svc.conversations import Conversation, Mount
from planner_svc.engine import Engine
from planner_svc.parking import ConversationError, Parking, Restore, RestoreOutcome
from planner_svc.requests import Request
from planner_svc.sampler_state import grammar_message
from planner_svc.streaming import TokenEvent
from protos import client_pb2, executor_pb2
from protos.rpc import ChannelSecurity

log = structlog.get_logger("deltaserve.planner.turns")

TURN_END_PATIENCE_S = 10.0  # how long a new turn waits for the previous one's last step to commit


class Turns:
    def __init__(
        self, engines: list[Engine], cache_address: str | None, cache_channel: ChannelSecurity | None = None
    ):
        self.engines = engines
        self.parking = Parking(cache_address, self.make_room, cache_channel)  # its restores make room here
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._latest: dict[tuple[str, str], Request] = {}  # the latest turn of each conversation
        self._relieving: set[Engine] = set()
        for engine in engines:
            engine.on_blocked = self.relieve

    def lock(self, conversation: Conversation) -> asyncio.Lock:
        """Held while a conversation is mounted, parked or restored, so those never interleave."""
        return self._locks.setdefault(conversation.key, asyncio.Lock())

    @contextlib.asynccontextmanager
    async def _locked(
        self, tenant: str, conversation_id: str, *, opens: Engine | None
    ) -> AsyncIterator[tuple[Engine, Conversation, bool]]:
        """The conversation's engine, the conversation (opened on `opens` where no engine holds it; None:
        NOT_FOUND) and whether this call opened it, its lock held; found again where a call that had opened it,
        or a delete, removed it while this waited: nothing may run on a conversation no longer registered (its
        pages would be nobody's). One this call opened and left holding nothing leaves no trace, its lock
        neither."""
        while True:
            engine, conversation = self.find(tenant, conversation_id)
            opened = conversation is None
            if engine is None or conversation is None:
                if opens is None:
                    raise ConversationError(grpc.StatusCode.NOT_FOUND, f"no conversation {conversation_id!r}")
                self._sweep(opens)
                engine, conversation = opens, opens.conversations.open(tenant, conversation_id)
            async with self.lock(conversation):
                if engine.conversations.get(tenant, conversation_id) is conversation:
                    try:
                        yield engine, conversation, opened
                    finally:
                        if opened and not (
                            conversation.tokens
                            or conversation.pages
                            or conversation.parked
                            or conversation.busy
                        ):
                            self._unregister(engine, conversation)
                    return

    def _sweep(self, engine: Engine) -> None:
        """Once the engine holds many records, drop those keeping nothing (Conversations.emptied), so that
        conversations emptied under pressure or by the cache's evictions, each with its last turn's ids, do not
        pile up for good; their next turn reads the whole prompt, as it would have. One whose lock is held is
        left: a turn or a delete works on it."""
        conversations = engine.conversations
        if not conversations.due_for_sweep():
            return
        for conversation in conversations.emptied():
            lock = self._locks.get(conversation.key)
            if lock is None or not lock.locked():
                self._unregister(engine, conversation)
        conversations.swept()

    def _unregister(self, engine: Engine, conversation: Conversation) -> None:
        """Drop every record of the conversation here (a waiter on its lock finds it gone: `_locked`)."""
        engine.conversations.remove(conversation)
        self._locks.pop(conversation.key, None)
        self._latest.pop(conversation.key, None)

    # ---- routing ----

    @staticmethod
    async def prepare(engine: Engine, request: Request) -> None:
        """Structured output: the engine's executor compiles the request's grammar before any step writes it,
        so that no step waits for the compile (ValueError where it cannot be compiled). One that does not
        answer within the step watchdog's time leaves it to the plan."""
        if request.grammar is None:
            return
        try:
            grammar = grammar_message(request.grammar)
            await asyncio.wait_for(engine.link.prepare_grammar(grammar), engine.executor_timeout)
        except TimeoutError:
            log.warning("the executor did not compile a grammar in time", executor=engine.link.address)
        except ValueError as error:
            raise ValueError(f"response_format: refused by the executor: {error}") from None

    def least_loaded(self) -> Engine:
        """The serving engine with the fewest requests (a lost one only when none serves: it refuses)."""
        serving = [e for e in self.engines if e.serving] or self.engines
        return min(serving, key=lambda e: e.load)

    def find(self, tenant: str, conversation_id: str) -> tuple[Engine | None, Conversation | None]:
        """The engine holding the conversation, if any holds it."""
        for engine in self.engines:
            conversation = engine.conversations.get(tenant, conversation_id)
            if conversation is not None:
                return engine, conversation
        return None, None

    # ---- turns ----

    async def start(
        self, req: Request, tenant: str, conversation_id: str
    ) -> tuple[Engine, asyncio.Queue[TokenEvent], Mount]:
        """Mount the conversation's best checkpoint for `req` (restoring it first if parked) and submit it.

        Raises ConversationError (a turn already running, or the previous one not ending), ValueError and
        CapacityError for a request the scheduler refuses, ConnectionError for a lost executor. A refused turn
        leaves its conversation as it found it (restored, where it was parked and the restore went through)
        and no conversation it opened."""
        # Routed once: its executor compiles the grammar before anything is opened (a refusal leaves no trace)
        engine = self.find(tenant, conversation_id)[0] or self.least_loaded()
        await self.prepare(engine, req)
        async with self._locked(tenant, conversation_id, opens=engine) as (engine, conversation, _):
            outcome = await self._ready(engine, conversation, req)
            # Queued before it mounts, with no await between (nothing is planned for it unmounted): a refusal
            # (the executor lost while this awaited, or the scheduler's) then leaves the conversation untouched,
            # where after the mount its pages would sit in a request that never runs and it would stay busy.
            queue = engine.submit(req)
            mount = self._mount(engine, conversation, req, outcome)
            self._latest[conversation.key] = req
        return engine, queue, mount

    async def _ready(self, engine: Engine, conversation: Conversation, req: Request) -> RestoreOutcome | None:
        """The previous turn ended, `req` checked, the conversation restored where it holds no pages (its
        outcome; None where it holds them)."""
        await self._previous_turn_done(engine, conversation)
        engine.scheduler.check(req)  # refuse bad input before touching the conversation
        return await self.parking.restore(engine, conversation) if not conversation.pages else None

    @staticmethod
    def _mount(
        engine: Engine, conversation: Conversation, req: Request, outcome: RestoreOutcome | None
    ) -> Mount:
        mount, release = engine.conversations.mount(
            conversation, req.prompt_ids, outcome is not None and outcome.restored
        )
        engine.scheduler.return_pages(release)
        if outcome is not None and outcome.status is Restore.FELL_BACK:
            mount.checkpoint = outcome.note
        req.pages, req.reused, req.prefilled, req.conversation = (
            mount.pages,
            mount.reused,
            mount.reused,
            conversation,
        )
        req.state_source = mount.state_slot
        return mount

    async def _previous_turn_done(self, engine: Engine, conversation: Conversation) -> None:
        """A turn whose answer was sent still owns the pages until its last step commits (one step
        later): the next turn waits for that. A turn still streaming is a conflict."""
        previous = self._latest.get(conversation.key)
        if conversation.busy and (previous is None or previous.finish is None):
            raise ConversationError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"conversation {conversation.conversation_id!r} is already running a turn",
            )
        try:
            await asyncio.wait_for(engine.turn_ended(conversation), TURN_END_PATIENCE_S)
        except TimeoutError:
            raise ConversationError(
                grpc.StatusCode.UNAVAILABLE,
                f"conversation {conversation.conversation_id!r}: the previous turn did not end",
            ) from None

    # ---- parking ----

    async def park(
        self, tenant: str, conversation_id: str
    ) -> tuple[executor_pb2.ParkPagesReply, Conversation]:
        """Move an idle conversation's pages to the cache (ConversationError: NOT_FOUND, FAILED_PRECONDITION,
        the cache's status)."""
        async with self._locked(tenant, conversation_id, opens=None) as (engine, conversation, _):
            await self._previous_turn_done(engine, conversation)
            return await self.parking.park(engine, conversation), conversation

    async def resume(self, tenant: str, conversation_id: str) -> Conversation:
        """Restore a parked conversation's pages (ConversationError: NOT_FOUND with nothing to restore,
        FAILED_PRECONDITION while a turn runs on it, DATA_LOSS for a snapshot that failed its checks,
        UNAVAILABLE for any other refusal)."""
        opens = self.least_loaded()  # where no engine holds it (the planner restarted): restored there
        async with self._locked(tenant, conversation_id, opens=opens) as (engine, conversation, _):
            await self._previous_turn_done(engine, conversation)
            outcome = await self.parking.restore(engine, conversation) if not conversation.pages else None
            if outcome is None or outcome.restored:
                return conversation
        if outcome.status is Restore.NOTHING or outcome.missing:
            raise ConversationError(grpc.StatusCode.NOT_FOUND, f"no parked conversation {conversation_id!r}")
        raise ConversationError(
            grpc.StatusCode.DATA_LOSS if outcome.data_loss else grpc.StatusCode.UNAVAILABLE,
            f"conversation {conversation_id!r} was not restored: {outcome.note}",
        )

    async def delete(self, tenant: str, conversation_id: str) -> client_pb2.DeleteConversationResponse:
        """Forget the conversation: its snapshot deleted from the cache first (a cache that cannot be asked
        leaves the planner's record as it was; a retry converges), then its pages and state copies back to the
        pools and every record of it dropped. A turn that has answered is waited for, as by park.
        ConversationError: FAILED_PRECONDITION while a turn streams on it or its pages are being parked,
        NOT_FOUND where neither the planner nor the cache holds it (nothing changes), the cache's status. A
        record the planner holds is always dropped, also one holding no tokens (its KV dropped under pressure
        or lost with an executor, a restore fell back)."""
        # Where no engine holds it (the planner restarted), its snapshot alone is deleted
        opens = self.least_loaded()
        async with self._locked(tenant, conversation_id, opens=opens) as (engine, conversation, opened):
            try:
                await self._previous_turn_done(engine, conversation)
            except ConversationError as error:
                if error.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                raise ConversationError(error.code, f"{error}; abort it first") from None
            if conversation.parking:  # a park whose caller gave up: its executor still writes the snapshot
                raise ConversationError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"conversation {conversation_id!r} is being parked; delete it once that ends",
                )
            snapshot_bytes = await self.parking.delete_snapshot(tenant, conversation_id)
            if snapshot_bytes is None and opened:
                raise ConversationError(grpc.StatusCode.NOT_FOUND, f"no conversation {conversation_id!r}")
            # Its full pages stay in the prefix index, free, until a prompt of its tenant takes them back or the
            # pool evicts them: a prefix other conversations of the tenant share (a system prompt) stays reusable.
            pool = engine.scheduler.pages
            free_before, tokens = pool.free_count, len(conversation.tokens)
            engine.scheduler.return_pages(conversation.forget())  # its state copies go back to their pool
            deleted = client_pb2.DeleteConversationResponse(  # the pages freed: not those still shared
                tokens=tokens, pages=pool.free_count - free_before, snapshot_bytes=snapshot_bytes or 0
            )
            self._unregister(engine, conversation)
            engine.wake()
        log.info("conversation deleted", conversation=conversation_id, pages=deleted.pages)
        return deleted

    # ---- KV pressure ----

    def relieve(self, engine: Engine) -> None:
        """KV pressure: park the coldest idle conversation (or drop its pages without a cache), once at a time;
        with none idle, a waiting turn may give its mount back (`_unmount`). A head waiting for a state slot is
        not KV pressure: it waits for one to come back, unless none ever will (`_relieve_states`); only a turn
        bringing its own slot that waits where admission scans (StatePressure.passing), nothing running, waits
        for pages."""
        scheduler = engine.scheduler
        if engine in self._relieving or scheduler.conversations is None:
            return
        waiting = scheduler.waiting
        if waiting and scheduler.pressure.starved(waiting[0]):
            if scheduler.pressure.stuck(waiting, scheduler.stalled) is not None:
                self._relieving.add(engine)
                asyncio.get_running_loop().create_task(self._relieve_states(engine))
                return
            if not (scheduler.stalled and scheduler.pressure.passing(waiting)):
                return  # dropping pages would drop what pins hold (without a cache), and free no state slot
        conversation = scheduler.conversations.coldest_idle()
        if conversation is None:
            self._unmount(engine)
            return
        self._relieving.add(engine)
        asyncio.get_running_loop().create_task(self._relieve(engine, conversation))

    @staticmethod
    def _unmount(engine: Engine) -> None:
        """Turns waiting with their conversations' pages mounted may each wait for pages another holds, with
        nothing running to free any: then the coldest behind the head gives them back (its conversation forgets
        them; it reads its whole prompt), until the head fits."""
        scheduler, conversations = engine.scheduler, engine.conversations
        if not scheduler.stalled or any(c.parking for c in conversations.every()):
            return  # pages come back on their own
        mounted = [r for r in list(scheduler.waiting)[1:] if r.conversation is not None and r.pages]
        if not mounted:
            return
        request = min(mounted, key=lambda r: r.conversation.last_used if r.conversation else 0)
        assert request.conversation is not None
        pages, request.pages = request.pages, []
        request.reused = request.prefilled = request.state_source = 0  # its checkpoint's copy goes back too
        scheduler.return_pages(pages + request.conversation.forget())
        log.warning(
            "KV pressure: a waiting turn gives back its conversation's pages and reads its whole prompt",
            conversation=request.conversation.conversation_id,
            pages=len(pages),
        )
        # Called from the engine's loop, which clears its wake-up as it goes idle next: wake it after that.
        asyncio.get_running_loop().call_soon(engine.wake)

    async def _relieve_states(self, engine: Engine) -> None:
        """No state slot will come back as things stand (StatePressure.stuck: pins' copies hold the others, which
        pressure never takes back): park the coldest idle conversation holding copies, its pin in its snapshot,
        as KV pressure parks one, the next coldest where its park fails (its snapshot over the cache's budget);
        where none can be parked (no cache), the queue's head is refused (RESOURCE_EXHAUSTED, saying what it
        needs) rather than a pin dropped."""
        scheduler = engine.scheduler
        tried: set[tuple[str, str]] = set()
        try:
            # Asked again after each park (awaited): a slot may have come back another way meanwhile.
            while (why := scheduler.pressure.stuck(scheduler.waiting, scheduler.stalled)) is not None:
                holder = (
                    engine.conversations.coldest_idle(with_states=True, excluding=tried)
                    if self.parking.cache_address
                    else None
                )
                if holder is None:
                    break
                tried.add(holder.key)
                await self._park_or_drop(engine, holder, drop=False)
            if why is not None:
                log.warning("state pressure: a request is refused rather than a pin dropped", reason=why)
                engine.refuse(scheduler.waiting[0], "RESOURCE_EXHAUSTED", why)
        finally:
            self._relieving.discard(engine)

    async def _relieve(self, engine: Engine, conversation: Conversation) -> None:
        try:
            await self._park_or_drop(engine, conversation)
        finally:
            self._relieving.discard(engine)

    async def make_room(self, engine: Engine, pages: int) -> None:
        """A restore short of `pages`: park the coldest idle conversations, as under KV pressure, until that
        many are free or none is left idle (the restoring conversation holds no pages: never one of them)."""
        conversations = engine.scheduler.conversations
        if conversations is None:
            return
        idle = sum(len(c.pages) for c in conversations.every() if c.pages and c.idle)
        if engine.scheduler.pages.free_count + idle < pages:
            return  # parking every idle one would not make room: none is parked for nothing
        while engine.scheduler.pages.free_count < pages:
            coldest = conversations.coldest_idle()
            if coldest is None or not await self._park_or_drop(engine, coldest, drop=False):
                return

    async def _park_or_drop(self, engine: Engine, conversation: Conversation, drop: bool = True) -> bool:
        """Park an idle conversation's pages, or (`drop`) drop them where it cannot be parked: its next turn
        reads again. Whether anything was done (a conversation busy or without pages is left alone)."""
        if engine.conversations.get(*conversation.key) is not conversation:
            return True  # deleted since it was picked: nothing of it to park, and no lock to make for it
        async with self.lock(conversation):
            if conversation.busy or not conversation.pages:
                return True  # not this one: the caller picks the next coldest
            try:
                await self.parking.park(engine, conversation)
            except ConversationError as error:
                if (
                    not drop
                ):  # room for a restore or a state slot: another's KV is not traded for a failed park
                    log.warning(
                        "could not park a conversation; it keeps its pages and state copies",
                        conversation=conversation.conversation_id,
                        error=str(error),
                    )
                    return False
                log.warning(
                    "KV pressure: dropping a conversation's pages; its next turn reads again",
                    conversation=conversation.conversation_id,
                    park_error=str(error),
                )
                engine.scheduler.return_pages(conversation.forget())
                engine.wake()
            return True
