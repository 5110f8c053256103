"""Parking conversations in the cache service through their executor, and restoring them."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from cache_svc.client import CacheClient
from planner_svc.conversations import Conversation
from planner_svc.engine import Engine
from planner_svc.link import LinkError
from planner_svc.loans import Loan
from planner_svc.retention import Retention
from protos import cache_pb2, executor_pb2
from protos.rpc import INTERNAL_CHANNEL_OPTIONS, ChannelSecurity
from protos.wire import pack_i32, unpack_i32

log = structlog.get_logger("deltaserve.planner.parking")

CACHE_DELETE_TIMEOUT_S = 10.0  # a cache that does not answer holds the conversation's lock no longer


class ConversationError(Exception):
    """What a call on a conversation (park, resume, delete, a turn's mount) cannot do; `code` is the gRPC status
    for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Restore(enum.Enum):
    NOTHING = "nothing"  # no parked pages and no snapshot in the cache
    RESTORED = "restored"
    FELL_BACK = "fell back"  # the conversation was forgotten: its next turn reads the whole prompt


@dataclass(frozen=True, slots=True)
class RestoreOutcome:
    """What a restore did; for FELL_BACK, why, and whether the snapshot itself was bad (DATA_LOSS)."""

    status: Restore
    reason: str = ""
    data_loss: bool = False  # the cache or the executor found the snapshot corrupt
    missing: bool = False  # the cache has no snapshot (evicted or deleted): nothing was parked after all

    @property
    def restored(self) -> bool:
        return self.status is Restore.RESTORED

    @property
    def note(self) -> str:
        """What a turn reports as its checkpoint when it fell back: 'none (why)'."""
        return f"none ({self.reason})"


NOTHING = RestoreOutcome(Restore.NOTHING)
RESTORED = RestoreOutcome(Restore.RESTORED)


def _service_error(doing: str, error: grpc.aio.AioRpcError, keys: str) -> ConversationError:
    """A call to another service failed: its status for the client, but a refused service key (the
    operator's mistake, not the caller's) as INTERNAL naming the flags that set it."""
    code = error.code()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return ConversationError(
            grpc.StatusCode.INTERNAL, f"{doing}: a service key was refused ({keys}): {error.details()}"
        )
    return ConversationError(code, f"{doing}: {error.details()}")


def _once_answered(rpc: asyncio.Future[Any], then: Callable[[], None]) -> None:
    """`then()` now if the executor answered `rpc`, else when it does (its outcome read: nobody awaits it)."""

    def done(_: object) -> None:
        if not rpc.cancelled():
            rpc.exception()
        then()

    if rpc.done():
        done(rpc)
    else:
        rpc.add_done_callback(done)


class Parking:
    def __init__(
        self,
        cache_address: str | None,
        make_room: Callable[[Engine, int], Awaitable[None]],
        security: ChannelSecurity | None = None,
    ):
        self.cache_address = cache_address
        self._cache = (
            CacheClient(cache_address, security, options=INTERNAL_CHANNEL_OPTIONS) if cache_address else None
        )
        # Frees pages for a restore short of them, as KV pressure does (parks idle conversations; turns.py).
        self._make_room = make_room

    async def park(self, engine: Engine, conversation: Conversation) -> executor_pb2.ParkPagesReply:
        """Move its pages to the cache; the caller holds the conversation's turn lock."""
        if conversation.busy:
            raise ConversationError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"conversation {conversation.conversation_id!r} is running a turn",
            )
        if not conversation.pages:
            return executor_pb2.ParkPagesReply(bytes=0)  # already parked, or nothing read yet
        retention = conversation.retention
        request = executor_pb2.ParkPagesRequest(
            conversation_id=conversation.conversation_id,
            tenant=conversation.tenant,
            token_ids=pack_i32(conversation.tokens),
            pages=pack_i32(conversation.pages),
            state_slots=pack_i32(
                [conversation.states[p] for p in retention.positions if p in conversation.states]
            ),
            checkpoints=[
                cache_pb2.Checkpoint(position=p, pinned=p == retention.pinned, root=p == retention.root)
                for p in retention.positions
            ],
        )
        # The executor reads its pages and state slots until it answers, also when the caller is cancelled:
        # pressure takes none of them back meanwhile, nor, should the executor be lost, a rebuilt pool.
        conversation.parking = True
        loans = engine.scheduler.loans
        loan = loans.lend(list(conversation.pages), list(conversation.states.values()))
        rpc = asyncio.ensure_future(engine.link.park(request))

        def answered() -> None:
            conversation.parking = False
            self._settle(engine, loan)
            # A head starved of a state slot waits for this park's end (StatePressure.stuck), failed or not.
            engine.wake()

        try:
            reply = await asyncio.shield(rpc)
        except grpc.aio.AioRpcError as error:
            raise _service_error(
                "parking failed", error, "the planner's --executor-api-key or the executor's --cache-api-key"
            ) from error
        except LinkError as error:
            raise ConversationError(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from error
        finally:
            _once_answered(rpc, answered)
        if loans.stale(loan):  # its KV was forgotten with the executor: the snapshot is in the cache alone
            log.warning("executor lost while parking", conversation=conversation.conversation_id)
            return reply
        conversation.drop_states(list(conversation.states))  # parked with the pages
        engine.scheduler.return_pages(conversation.pages)
        conversation.pages, conversation.parked = [], True
        engine.wake()
        log.info(
            "conversation parked",
            conversation=conversation.conversation_id,
            bytes=reply.bytes,
            tokens=len(conversation.tokens),
        )
        return reply

    async def restore(self, engine: Engine, conversation: Conversation) -> RestoreOutcome:
        """Bring a parked conversation's pages back; the caller holds its turn lock.

        NOTHING when there was nothing to restore, RESTORED, or FELL_BACK saying why the conversation
        reads its prompt again (never silently). ConversationError (FAILED_PRECONDITION) while a turn runs on
        it: that turn owns its states and pages."""
        if conversation.busy:
            raise ConversationError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"conversation {conversation.conversation_id!r} is running a turn",
            )
        tokens = (
            len(conversation.tokens) if conversation.parked else await self._snapshot_tokens(conversation)
        )
        if not tokens:
            return NOTHING
        need = -(-tokens // engine.scheduler.config.page_size)
        pages = engine.scheduler.take_pages(need)
        if pages is None:
            await self._make_room(engine, need)
            pages = engine.scheduler.take_pages(need)
        if pages is None:
            return self._fall_back(conversation, "the pool has no room for the snapshot now")
        states = self._take_state_slots(engine, conversation)
        if states is None:
            engine.scheduler.return_pages(pages)
            return self._fall_back(conversation, "no state slot is free for the snapshot's states now")
        # Shielded: a caller cancelled (its client gone) gives the pages and slots back only once the executor
        # answered, its copy into them done, so that no request reuses them while the copy writes (lent: nor
        # does one after a rebuild of the pools, should the executor be lost meanwhile).
        loans = engine.scheduler.loans
        loan = loans.lend(pages, states)
        rpc = asyncio.ensure_future(
            engine.link.restore(
                executor_pb2.RestorePagesRequest(
                    conversation_id=conversation.conversation_id,
                    tenant=conversation.tenant,
                    pages=pack_i32(pages),
                    state_slots=pack_i32(states),
                )
            )
        )
        try:
            reply = await asyncio.shield(rpc)
        except (grpc.aio.AioRpcError, LinkError) as error:
            self._give_back(engine, loan)  # partly written at worst: nobody reads them
            if isinstance(error, grpc.aio.AioRpcError):
                data_loss = error.code() == grpc.StatusCode.DATA_LOSS
                reason = f"{error.code().name}: {error.details()}"
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    self._fall_back(conversation, reason)
                    return RestoreOutcome(
                        Restore.FELL_BACK, "snapshot gone (evicted or deleted)", missing=True
                    )
            else:
                data_loss, reason = False, str(error)
            return self._fall_back(conversation, f"snapshot refused: {reason}", data_loss=data_loss)
        except BaseException:  # cancelled, or an unexpected error: the conversation stays as it was
            _once_answered(rpc, lambda: self._give_back(engine, loan))
            raise
        if loans.stale(loan):  # the executor was lost meanwhile: what it wrote may be gone with it
            self._give_back(engine, loan)
            return self._fall_back(conversation, "the executor was lost while the snapshot was restored")
        loans.end(loan)
        # A head starved of a state slot waits for this loan's end (StatePressure.stuck): plan again once the
        # slots are the conversation's (no await below), an unpinned copy that pressure may take among them.
        engine.wake()
        conversation.tokens = unpack_i32(reply.token_ids).tolist()
        conversation.retention = Retention(conversation.retention.config)
        checkpoints = sorted(reply.checkpoints, key=lambda c: c.position)
        if states:  # the newest checkpoints' states came back into the last slots; the others go back
            unused = len(states) - len(checkpoints)
            for slot in states[:unused]:
                engine.scheduler.states.give_back(slot)
            conversation.states = {
                c.position: slot for c, slot in zip(checkpoints, states[unused:], strict=True)
            }
        for checkpoint in checkpoints:
            evicted = conversation.retention.add(
                checkpoint.position, root=checkpoint.root, pinned=checkpoint.pinned
            )
            conversation.drop_states(evicted)
        conversation.pages, conversation.parked = pages, False
        log.info("conversation restored", conversation=conversation.conversation_id, tokens=tokens)
        return RESTORED

    @staticmethod
    def _give_back(engine: Engine, loan: Loan) -> None:
        """The RPC answered: its pages and state slots, unused, back to the pools (those rebuilt since kept them
        for it)."""
        engine.scheduler.loans.end(loan)
        for slot in loan.states:
            engine.scheduler.states.give_back(slot)
        engine.scheduler.return_pages(loan.pages)
        engine.wake()

    @classmethod
    def _settle(cls, engine: Engine, loan: Loan) -> None:
        """A park answered: its pages and slots stay the conversation's, unless the pools were rebuilt since
        (the conversation forgot them): then they go back."""
        if engine.scheduler.loans.stale(loan):
            cls._give_back(engine, loan)
        else:
            engine.scheduler.loans.end(loan)

    @staticmethod
    def _take_state_slots(engine: Engine, conversation: Conversation) -> list[int] | None:
        """A model with recurrent layers: free state slots for the snapshot's states, one per checkpoint parked
        (after a planner restart, as many as a conversation keeps: the cap and a pin; the executor fills the last
        ones, the rest go back), as many as are free (short of them, the executor brings back the pin's and the
        newest others'); None when none is. [] for a model without recurrent layers."""
        states = engine.scheduler.states
        if not states.enabled:
            return []
        conversations = engine.scheduler.conversations
        while not states.free_count and conversations is not None:
            # State-slot pressure, as admission meets it: the least recently used idle conversation gives a copy
            # back (the restoring one holds none), rather than this conversation reading its whole prompt again.
            freed = conversations.drop_state_copy()
            if freed is None:
                break
            engine.scheduler.return_pages(freed)
        retention = conversation.retention
        parked = len(retention.positions) if conversation.parked else retention.config.cap + 1
        want = min(max(parked, 1), states.free_count)
        return [states.take() for _ in range(want)] if want else None

    def _fall_back(
        self, conversation: Conversation, reason: str, *, data_loss: bool = False
    ) -> RestoreOutcome:
        log.warning(
            "conversation will read its prompt again",
            conversation=conversation.conversation_id,
            reason=reason,
        )
        conversation.forget()  # holds no pages here
        return RestoreOutcome(Restore.FELL_BACK, reason, data_loss)

    async def _snapshot_tokens(self, conversation: Conversation) -> int:
        """Tokens of the conversation's snapshot in the cache (after a planner restart), 0 if none."""
        if self._cache is None:
            return 0
        try:
            snapshots = await self._cache.list(conversation.tenant, conversation.conversation_id, timeout=10)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("cache not reachable; the prompt is read in full", error=error.details())
            return 0
        return max((s["num_tokens"] for s in snapshots), default=0)

    async def delete_snapshot(self, tenant: str, conversation_id: str) -> int | None:
        """Delete the conversation's snapshot from the cache: its bytes, or None where the cache has none (or
        there is no cache). ConversationError with the cache's status where it cannot be asked: the snapshot
        may be gone all the same where the cache acted but its answer was lost (DEADLINE_EXCEEDED); a retry
        converges."""
        if self._cache is None:
            return None
        try:
            deleted = await self._cache.delete(tenant, conversation_id, timeout=CACHE_DELETE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise _service_error(
                "deleting the snapshot failed", error, "the planner's --cache-api-key"
            ) from error
        return deleted["size_bytes"]

    async def follow_cache(self, tenant: str, conversations: list[Conversation]) -> None:
        """Drops the parked mark of those whose snapshot the cache no longer has (evicted, deleted,
        quarantined): they are not parked, and their next turn reads the prompt. Unchanged when the
        cache cannot be asked."""
        parked = [c for c in conversations if c.parked and not c.pages and not c.busy]
        if self._cache is None or not parked:
            return
        try:
            snapshots = await self._cache.list(tenant, timeout=5)
        except grpc.aio.AioRpcError as error:
            log.warning("cache not reachable; parked marks unchecked", error=error.details())
            return
        held = {s["conversation_id"] for s in snapshots}
        for conversation in parked:
            if conversation.conversation_id not in held and conversation.parked and not conversation.pages:
                log.info("snapshot gone from the cache", conversation=conversation.conversation_id)
                conversation.forget()

    async def cache_answers(self, timeout: float) -> bool:
        """Whether the cache service's health check says SERVING within `timeout` seconds."""
        if self._cache is None:
            return False
        try:
            await self._cache.wait_ready(timeout)
        except (TimeoutError, grpc.aio.AioRpcError):
            return False
        return True

    async def close(self) -> None:
        if self._cache is not None:
            await self._cache.close()
