"""The planner's client API over gRPC: Generate, Abort, conversations (park, resume, list, delete), model and
server info, health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import grpc
import structlog
from prometheus_client import CollectorRegistry

from planner_svc.config import PlannerConfig
from planner_svc.conversations import Mount
from planner_svc.engine import Engine
from planner_svc.engine_build import build_engine, release_attached
from planner_svc.group_link import GroupLink
from planner_svc.intake import Intake, model_eos_ids
from planner_svc.link import ExecutorLink, GrpcLink
from planner_svc.metrics import PlannerMetrics
from planner_svc.parking import ConversationError
from planner_svc.planned import CapacityError
from planner_svc.refusals import Refusals
from planner_svc.requests import Finish, Request
from planner_svc.responses import ResponseStreams
from planner_svc.tokenizer import planner_tokenizer
from planner_svc.turns import Turns
from planner_svc.validation import MAX_CHOICES, InvalidRequest, check_named
from planner_svc.waiting_room import TenantShare, WaitingRoom
from protos import client_pb2, client_pb2_grpc, executor_pb2
from protos.auth import TenantMismatch, request_tenant, tenant_of
from protos.decode_guard import guarded
from protos.rpc import (
    NEVER_FITS_METADATA,
    ChannelSecurity,
    ServerSecurity,
    StartedServer,
    log_access,
    start_server,
)

log = structlog.get_logger("deltaserve.planner")

VERSION = "0.1.0"
SERVICE_NAME = client_pb2.DESCRIPTOR.services_by_name["Planner"].full_name


async def _check_named(context: grpc.aio.ServicerContext, field: str, value: str) -> None:
    try:
        check_named(field, value)
    except InvalidRequest as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


class PlannerServicer(client_pb2_grpc.PlannerServicer):
    def __init__(
        self,
        engines: list[Engine],
        descriptions: list[executor_pb2.ExecutorDescription],
        tokenizer,
        turns: Turns,
        config: PlannerConfig | None = None,
    ):
        config = config or PlannerConfig()
        self.engines = engines
        self.max_waiting = config.max_waiting  # choices waiting for admission, all engines together
        self.max_waiting_per_tenant = config.max_waiting_per_tenant  # of those, one tenant's at most; 0: none
        # Choices past that check in no scheduler's queue yet (being prepared, n > 1's later ones): counted too.
        self.room = WaitingRoom()
        self.turns = turns
        self.description = descriptions[0]
        self.model_name = config.served_model_name or self.description.model_name  # as the API names it
        self.tokenizer = tokenizer
        # The model's end-of-sequence id where the executor names it: tokenizer versions differ on it
        # (transformers 5.17 on the GPU machine did not report <|im_end|> for SmolLM2's GGUF; requests
        # ran past their end).
        described = self.description
        self.eos_token_ids = model_eos_ids(described, tokenizer.eos_token_id)
        # Request ids are unique per tenant (its key's): another tenant's ids are none of a caller's business.
        self._requests: dict[tuple[str, str], tuple[Request, Engine]] = {}  # (tenant, request id)
        self._request_ids: set[tuple[str, str]] = set()  # taken from the first await of a Generate to its end
        # Aborted while still starting (tokenizing, waiting for its conversation, restoring): ended at admission.
        self._early_aborts: set[tuple[str, str]] = set()
        vocab, context = described.vocab_size, described.max_seq_len
        self.intake = Intake(tokenizer, self.eos_token_ids, vocab, context, config.default_max_tokens)
        self.running_requests = self._requests  # what a drain waits for (drain.py)
        self.draining: str | None = None  # set by a drain: new requests are refused with it
        self.cut: dict[tuple[str, str], str] = {}  # (tenant, request id) -> why a drain cut it
        self.responses = ResponseStreams(tokenizer, self.cut)
        self.metrics: PlannerMetrics | None = None  # set when the process serves metrics
        self.refusals = Refusals(lambda: self.metrics)  # Generate's refusals before admission: counted

    async def Generate(self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            if self.draining:
                await self.refusals.refuse(context, grpc.StatusCode.UNAVAILABLE, self.draining)
            try:  # ids are unique per tenant only: the tenant beside the id on every line of the request
                taken = (tenant_of(request.tenant), request_id)
            except TenantMismatch as error:
                await self.refusals.refuse(context, grpc.StatusCode.PERMISSION_DENIED, str(error))
            structlog.contextvars.bind_contextvars(tenant=taken[0])
            if taken in self._request_ids:
                message = f"request id {request_id!r} is already running"
                await self.refusals.refuse(context, grpc.StatusCode.ALREADY_EXISTS, message)
            self._request_ids.add(taken)  # before the first await: a second one is refused above
            try:
                async with contextlib.aclosing(self._generate(request, taken, context)) as stream:
                    async for response in stream:
                        yield response
            finally:
                self._request_ids.discard(taken)
                self._early_aborts.discard(taken)
        finally:
            structlog.contextvars.unbind_contextvars("request_id", "tenant")

    def _share(self, tenant: str) -> TenantShare | None:
        """The tenant's share of the waiting room, with its choices queued now (None: shares are off)."""
        if not self.max_waiting_per_tenant:
            return None
        queued = sum(r.tenant == tenant for engine in self.engines for r in engine.scheduler.waiting)
        return TenantShare(tenant, queued, self.max_waiting_per_tenant)

    async def _generate(
        self, request: client_pb2.GenerateRequest, taken: tuple[str, str], context: grpc.aio.ServicerContext
    ):
        tenant, request_id = taken
        mount = Mount()
        clock = self.metrics.request() if self.metrics is not None else None  # from the request's arrival
        try:
            # A request queues its n choices (an n out of range counts as one: intake refuses it).
            choices = request.n if 1 <= request.n <= MAX_CHOICES else 1
            queued = sum(len(engine.scheduler.waiting) for engine in self.engines)
            # No await before the room is taken: requests arriving together cannot all pass the check. A turn
            # waiting for its conversation's lock counts as well (it waits to be queued, and any number may pile
            # up on one lock).
            held = self.room.enter(choices, queued, self.max_waiting, self._share(tenant))
            try:
                req = await self.intake.prepare(request, request_id)
                if request.conversation_id:
                    engine, queue, mount = await self.turns.start(
                        req, await self._owner(req, request, context), request.conversation_id
                    )
                else:
                    await self._owner(req, request, context)
                    engine = self.turns.least_loaded()
                    await self.turns.prepare(engine, req)
                    queue = engine.submit(req)
                held.let_go()  # the first choice is in a scheduler's waiting queue now, counted there
            except BaseException:  # refused or cancelled: none of its choices will be queued
                held.close()
                raise
        except ValueError as error:  # refused before admission: counted by code
            await self.refusals.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except CapacityError as error:
            never = () if error.retryable else ((NEVER_FITS_METADATA, "1"),)
            await self.refusals.refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), never)
        except ConnectionError as error:
            await self.refusals.refuse(context, grpc.StatusCode.UNAVAILABLE, str(error))
        except ConversationError as error:
            await self.refusals.refuse(context, error.code, str(error))
        self._requests[(req.tenant, request_id)] = (req, engine)
        log.info("request queued", prompt_tokens=req.prompt_len, max_tokens=req.max_tokens)
        if (req.tenant, request_id) in self._early_aborts:
            for choice in (req, *req.choices):
                engine.abort(choice)
        reason = "error"  # a status other than OK; a client gone is an abort
        try:
            if request.n > 1:
                stream = self.responses.choices(req, engine, queue, context, request.n, held)
            else:
                stream = self.responses.one(req, engine, queue, context, mount)
            async for response in stream:
                if clock is not None:
                    clock.sent(response)
                yield response
            reason = (req.finish or Finish.ABORT).value
        except (GeneratorExit, asyncio.CancelledError):
            reason = "abort"
            raise
        finally:
            held.close()  # later choices never queued (the first aborted, the client gone, an error)
            if req.refused:  # refused while it waited: never admitted (its later choices never queued)
                self.refusals.from_queue(req.refused)
            elif clock is not None:
                clock.ended(req, mount, reason)
            self._requests.pop((req.tenant, request_id), None)
            if req.finish is None:  # the client went away: free its pages and slot
                engine.abort(req)
                log.info("client disconnected; request aborted")

    @property
    def starting(self) -> int:
        """Choices past the --max-waiting check in no scheduler's waiting queue yet."""
        return self.room.held

    @staticmethod
    async def _owner(
        req: Request, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> str:
        """The request's tenant (its key's; protos/auth.py), set on it: prefix pages are shared within it."""
        req.tenant = await request_tenant(context, request.tenant)
        return req.tenant

    async def Abort(self, request: client_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        await _check_named(context, "request_id", request.request_id)
        # Within the caller's tenant only: another tenant's request of the same id is not the caller's.
        key = (await request_tenant(context, request.tenant), request.request_id)
        found = self._requests.get(key)
        if found is None:
            starting = key in self._request_ids  # its id taken, not yet admitted: ended when it is
            if starting:
                self._early_aborts.add(key)
            return client_pb2.AbortResponse(aborted=starting)
        req, engine = found
        aborted = [engine.abort(choice) for choice in (req, *req.choices)]
        return client_pb2.AbortResponse(aborted=any(aborted))

    async def Park(self, request: client_pb2.ParkRequest, context: grpc.aio.ServicerContext):
        await _check_named(context, "conversation_id", request.conversation_id)
        try:
            reply, conversation = await self.turns.park(
                await request_tenant(context, request.tenant), request.conversation_id
            )
        except ConversationError as error:
            if error.code != grpc.StatusCode.NOT_FOUND:
                log.warning("park refused", conversation=request.conversation_id, error=str(error))
            await context.abort(error.code, str(error))
        return client_pb2.ParkResponse(bytes=reply.bytes, tokens=len(conversation.tokens))

    async def Resume(self, request: client_pb2.ResumeRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.draining)
        await _check_named(context, "conversation_id", request.conversation_id)
        try:
            conversation = await self.turns.resume(
                await request_tenant(context, request.tenant), request.conversation_id
            )
        except ConversationError as error:
            await context.abort(error.code, str(error))
        return client_pb2.ResumeResponse(
            tokens=len(conversation.tokens), checkpoints=conversation.retention.positions
        )

    async def ListConversations(
        self, request: client_pb2.ListConversationsRequest, context: grpc.aio.ServicerContext
    ):
        tenant = await request_tenant(context, request.tenant)
        for engine in self.engines:  # a snapshot evicted or deleted in the cache is not parked
            await self.turns.parking.follow_cache(tenant, engine.conversations.of_tenant(tenant))
        listed = [
            client_pb2.Conversation(
                conversation_id=c.conversation_id,
                tokens=len(c.tokens),
                checkpoints=c.retention.positions,
                parked=c.parked,
                pages=len(c.pages),
                pinned_prefix=c.retention.pinned or 0,
            )
            for engine in self.engines
            for c in engine.conversations.of_tenant(tenant)
            if c.tokens or c.busy
        ]
        return client_pb2.ListConversationsResponse(conversations=listed)

    async def DeleteConversation(
        self, request: client_pb2.DeleteConversationRequest, context: grpc.aio.ServicerContext
    ):
        if self.draining:  # the drain parks what the pool holds: a delete would race it
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.draining)
        await _check_named(context, "conversation_id", request.conversation_id)
        try:
            return await self.turns.delete(
                await request_tenant(context, request.tenant), request.conversation_id
            )
        except ConversationError as error:
            await context.abort(error.code, str(error))

    async def GetModelInfo(self, request: client_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext):
        d = self.description
        return client_pb2.ModelInfo(
            name=self.model_name,
            vocab_size=d.vocab_size,
            max_seq_len=d.max_seq_len,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else -1,
            dtype=d.dtype,
        )

    async def GetServerInfo(self, request: client_pb2.ServerInfoRequest, context: grpc.aio.ServicerContext):
        d = self.description
        schedulers = [e.scheduler for e in self.engines]
        return client_pb2.ServerInfo(
            version=VERSION,
            page_size=d.page_size,
            pool_pages=sum(s.pages.total for s in schedulers),
            free_pages=sum(s.pages.free_count for s in schedulers),
            slots=sum(s.slots.num_slots - 1 for s in schedulers),
            free_slots=sum(s.slots.free_count for s in schedulers),
            buckets=list(d.buckets),
            running=sum(s.running for s in schedulers),
            waiting=sum(len(s.waiting) for s in schedulers),
            steps=sum(e.steps for e in self.engines),
            device=d.device,
            state_slots=sum(s.states.total for s in schedulers),
            free_state_slots=sum(s.states.free_count for s in schedulers),
        )


def _follow_executors(started: StartedServer[PlannerServicer], engines: list[Engine]) -> None:
    """Health says NOT_SERVING while no executor serves, SERVING again once one is back (not while draining)."""
    health_updates: set[asyncio.Task] = set()

    def changed() -> None:
        serving = any(e.serving for e in engines) and started.servicer.draining is None
        task = asyncio.get_running_loop().create_task(started.set_serving(serving))
        health_updates.add(task)
        task.add_done_callback(health_updates.discard)

    for engine in engines:
        engine.on_health = changed


async def start_planner_server(
    config: PlannerConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    links: list[ExecutorLink] | None = None,
    *,
    security: ServerSecurity | None = None,
    executor_channel: ChannelSecurity | None = None,
    cache_channel: ChannelSecurity | None = None,
    metrics: CollectorRegistry | None = None,
) -> StartedServer[PlannerServicer]:
    """Attach to the executors (waiting until they answer), then serve the client API.

    Stopping the returned server stops the engines and closes the cache channel; a start that fails or is
    cancelled part way (a stop signal while an executor does not answer) closes what it had opened.
    `security`: TLS and API keys of the client API; `executor_channel` and `cache_channel`: how it reaches the
    executors (TLS) and the cache (TLS, and the service key). `metrics`: the registry its metrics are recorded
    in (planner_svc/metrics.py).
    """
    if links is None:
        if not config.executors and not config.executor_groups:
            raise ValueError("the planner needs at least one executor address or stage group")
        links = [GrpcLink(address, executor_channel) for address in config.executors]
        links += [GroupLink.over(group, executor_channel) for group in config.executor_groups]
    descriptions = []
    opened: list[Engine] = []  # the engines started (or starting)
    turns: Turns | None = None
    try:
        for link in links:
            log.info("waiting for executor", executor=link.address)
            descriptions.append(await _describe(link))
        fingerprints = {d.model_fingerprint for d in descriptions}
        if len(fingerprints) > 1:
            raise ValueError(f"the executors serve different models: {sorted(fingerprints)}")
        tokenizer = await asyncio.to_thread(planner_tokenizer, config.model, config.chat_template)
        built = [build_engine(d, link, config) for d, link in zip(descriptions, links)]
        turns = Turns(built, config.cache, cache_channel)
        for engine in built:
            opened.append(engine)
            await engine.start()
        servicer = PlannerServicer(built, descriptions, tokenizer, turns, config)
        if metrics is not None:
            servicer.metrics = PlannerMetrics(metrics)
            servicer.metrics.follow(lambda: [engine.scheduler for engine in built])
    except BaseException:  # a stop signal (a cancel) or a mistake part way: nothing opened is left behind
        await release_attached(links, opened, None if turns is None else turns.parking)
        raise
    started = await start_server(
        servicer,
        guarded(client_pb2_grpc.add_PlannerServicer_to_server),  # invalid UTF-8: INVALID_ARGUMENT
        (SERVICE_NAME,),
        host,
        port,
        on_stop=[*(engine.stop for engine in built), turns.parking.close],  # run should it fail too
        security=security,
        on_refused=servicer.refusals.key_refused,  # a key refused never reaches Generate: counted here
    )
    log_access(log, security)
    _follow_executors(started, built)
    log.info(
        "planner listening", address=f"{host}:{started.port}", executors=[link.address for link in links]
    )
    return started


async def _describe(link: ExecutorLink) -> executor_pb2.ExecutorDescription:
    try:
        return await link.describe()
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.UNAUTHENTICATED:
            raise
        raise ValueError(  # a start-up mistake, said in one line (the CLI's)
            f"executor {link.address} refused this planner: {error.details()}; give --executor-api-key, a "
            "service key (a `* ` line) of the executor's --api-keys"
        ) from None
