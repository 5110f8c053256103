"""Parking conversations in the cache service through their executor, restoring them, relieving KV pressure."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from planner_svc.conversations import Conversation
from planner_svc.engine import Engine
from planner_svc.link import LinkError
from planner_svc.retention import Retention
from protos import cache_pb2, cache_pb2_grpc, executor_pb2
from protos.rpc import CHANNEL_OPTIONS
from protos.wire import pack_i32, unpack_i32

log = structlog.get_logger("deltaserve.planner.parking")


class ParkError(Exception):
    """A park that cannot be done; `code` is the gRPC status for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Parking:
    def __init__(self, cache_address: str | None):
        self.cache_address = cache_address
        self._channel = (
            grpc.aio.insecure_channel(cache_address, options=CHANNEL_OPTIONS) if cache_address else None
        )
        self._cache = cache_pb2_grpc.CacheStub(self._channel) if self._channel else None
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._relieving: set[Engine] = set()

    def lock(self, conversation: Conversation) -> asyncio.Lock:
        """Held while a conversation is mounted, parked or restored, so those never interleave."""
        return self._locks.setdefault(conversation.key, asyncio.Lock())

    async def park(self, engine: Engine, conversation: Conversation) -> executor_pb2.ParkPagesReply:
        """Move its pages to the cache; the caller holds the conversation's lock."""
        if conversation.busy:
            raise ParkError(
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
            checkpoints=[
                executor_pb2.ConversationCheckpoint(
                    position=p, pinned=p == retention.pinned, root=p == retention.root
                )
                for p in retention.positions
            ],
        )
        try:
            reply = await engine.link.park(request)
        except grpc.aio.AioRpcError as error:
            raise ParkError(error.code(), f"parking failed: {error.details()}") from error
        except LinkError as error:
            raise ParkError(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from error
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

    async def restore(self, engine: Engine, conversation: Conversation) -> str | None:
        """Bring a parked conversation's pages back; the caller holds its lock.

        Returns None when there was nothing to restore, "restored", or why the conversation falls back
        to reading its prompt again (never silently)."""
        tokens = (
            len(conversation.tokens) if conversation.parked else await self._snapshot_tokens(conversation)
        )
        if not tokens:
            return None
        page_size = engine.scheduler.config.page_size
        pages = engine.scheduler.take_pages(-(-tokens // page_size))
        if pages is None:
            return self._fall_back(conversation, "the pool has no room for the snapshot now")
        try:
            reply = await engine.link.restore(
                executor_pb2.RestorePagesRequest(
                    conversation_id=conversation.conversation_id,
                    tenant=conversation.tenant,
                    pages=pack_i32(pages),
                )
            )
        except (grpc.aio.AioRpcError, LinkError) as error:
            engine.scheduler.return_pages(pages)  # partly written at worst: nobody reads them
            reason = (
                f"{error.code().name}: {error.details()}"
                if isinstance(error, grpc.aio.AioRpcError)
                else str(error)
            )
            return self._fall_back(conversation, f"snapshot refused: {reason}")
        conversation.tokens = unpack_i32(reply.token_ids).tolist()
        conversation.retention = Retention(conversation.retention.config)
        for checkpoint in sorted(reply.checkpoints, key=lambda c: c.position):
            conversation.retention.add(checkpoint.position, root=checkpoint.root, pinned=checkpoint.pinned)
        conversation.pages, conversation.parked = pages, False
        log.info("conversation restored", conversation=conversation.conversation_id, tokens=tokens)
        return "restored"

    def _fall_back(self, conversation: Conversation, reason: str) -> str:
        log.warning(
            "conversation will read its prompt again",
            conversation=conversation.conversation_id,
            reason=reason,
        )
        conversation.forget()  # holds no pages here
        return f"none ({reason})"

    async def _snapshot_tokens(self, conversation: Conversation) -> int:
        """Tokens of the conversation's snapshot in the cache (after a planner restart), 0 if none."""
        if self._cache is None:
            return 0
        try:
            reply = await self._cache.List(
                cache_pb2.ListRequest(
                    tenant=conversation.tenant, conversation_id=conversation.conversation_id
                ),
                timeout=10,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("cache not reachable; the prompt is read in full", error=error.details())
            return 0
        return max((s.num_tokens for s in reply.snapshots), default=0)

    def relieve(self, engine: Engine) -> None:
        """KV pressure: park the coldest idle conversation (or drop its pages without a cache), once at a time."""
        if engine in self._relieving or engine.scheduler.conversations is None:
            return
        conversation = engine.scheduler.conversations.coldest_idle()
        if conversation is None:
            return
        self._relieving.add(engine)
        asyncio.get_running_loop().create_task(self._relieve(engine, conversation))

    async def _relieve(self, engine: Engine, conversation: Conversation) -> None:
        try:
            async with self.lock(conversation):
                if conversation.busy or not conversation.pages:
                    return
                try:
                    await self.park(engine, conversation)
                except ParkError as error:
                    log.warning(
                        "KV pressure: dropping a conversation's pages; its next turn reads again",
                        conversation=conversation.conversation_id,
                        park_error=str(error),
                    )
                    engine.scheduler.return_pages(conversation.forget())
                    engine.wake()
        finally:
            self._relieving.discard(engine)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
