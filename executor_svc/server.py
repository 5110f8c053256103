"""The executor's gRPC service: Describe, Park, Restore, and the Steps stream launched on the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass

import grpc
import structlog
from prometheus_client import CollectorRegistry

from executor_svc.config import DEFAULT_SHARD_LAYERS
from executor_svc.control_writes import grammar_text
from executor_svc.executor_metrics import register_executor_metrics
from executor_svc.launched_step import LaunchedStep
from executor_svc.plan import PlanError
from executor_svc.runner import StepRunner
from executor_svc.snapshots import SnapshotRefused, Snapshots
from executor_svc.stage import StageLost, stream_tag
from executor_svc.step_loop import StepLauncher, collect_when_ready, failed_launch
from protos import executor_pb2, executor_pb2_grpc
from protos.layer_split import EXIT_GROUP_LOST
from protos.rpc import (
    PLANNER_ID_METADATA,
    ChannelSecurity,
    ServerSecurity,
    StartedServer,
    start_server,
)

log = structlog.get_logger("deltaserve.executor.server")

EXIT_DELAY_S = 0.2  # time for the stream's status to reach the planner before the stage exits
PLANS_IN_FLIGHT = 2  # the step running and the next one (DESIGN §3)
# A refused plan's stream ends once the planner's next plan is read, or after this long: a write that races
# the end of the call fails in gRPC's core as INTERNAL, which would read as a lost executor (every request cut).
REFUSAL_GRACE_S = 1.0
REPLACE_WAIT_S = 5.0  # how long a replaced stream may take to end before its call is cancelled
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name


class StreamReplaced(Exception):
    """Put in a Steps stream's queue of launched steps: a newer stream of its planner replaces it."""


@dataclass(slots=True)
class _OpenStream:
    planner: str  # the id of the planner that opened it ("": none given)
    task: asyncio.Task  # the call's, cancelled if it does not end once replaced
    # Its plans' launches in order, StreamReplaced, or None at the end of its plans.
    launched: asyncio.Queue[asyncio.Future[LaunchedStep] | StreamReplaced | None]
    closed: asyncio.Event  # set once its cleanup ran


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Plans launch in order on the event loop as soon as they are read; each output is collected, in order,
    once its step's tokens are back (polled on the loop), so step N+1 launches while step N runs.

    On a GPU one thread does the steps: a thread hop costs more (60-110 µs measured on the H200's host) than
    the launch itself, which is Python that a second thread would only contend with for the GIL. On the CPU
    a step computes as it launches, on a worker thread, queued there as soon as its plan is read
    (`StepLauncher`). Park and Restore copy pages on a worker thread of their own (DESIGN §3).
    """

    def __init__(
        self,
        runner: StepRunner,
        *,
        cache: str | None = None,
        shard_layers: int = DEFAULT_SHARD_LAYERS,
        cache_channel: ChannelSecurity | None = None,
    ) -> None:
        self._runner = runner
        self._compute = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cpu-steps", initializer=runner.bind_thread
        )
        self._copies = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="page-copies", initializer=runner.bind_thread
        )
        self._stream: _OpenStream | None = None  # the Steps stream being served
        self.snapshots = Snapshots(runner, self._copies, cache, shard_layers, cache_channel)
        if runner.model.stage.split:
            runner.model.stage.watch(_exit_group_lost)

    async def Describe(
        self, request: executor_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ExecutorDescription:
        described = self._runner.describe()
        described.snapshots = self.snapshots.enabled
        return described

    async def Steps(
        self, request_iterator: AsyncIterator[executor_pb2.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.StepOutput]:
        planner = dict(context.invocation_metadata() or ()).get(PLANNER_ID_METADATA, "")
        while (open_stream := self._stream) is not None:
            if not planner or planner != open_stream.planner:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "another Steps stream is already open, from another planner",
                )
            # Its planner gave up on it (a hang, say) and its cancel never arrived: the newer stream wins. The
            # old one ends with ABORTED once its current step is collected (cancelled, if that takes long).
            log.warning("a newer Steps stream of the same planner replaces the open one", peer=context.peer())
            open_stream.launched.put_nowait(StreamReplaced())
            try:
                await asyncio.wait_for(open_stream.closed.wait(), REPLACE_WAIT_S)
            except TimeoutError:
                open_stream.task.cancel()
                await open_stream.closed.wait()
        task = asyncio.current_task()
        assert task is not None  # grpc.aio serves each call in a task of its own
        stream = self._stream = _OpenStream(planner, task, asyncio.Queue(), asyncio.Event())
        peer = context.peer()  # read while the call lives: the finally may run after the server stopped
        try:
            steps = self._serve_steps(request_iterator, stream.launched, context, peer, planner)
            async with contextlib.aclosing(steps) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self._stream = None
            stream.closed.set()
            log.info("steps stream closed", peer=peer)

    async def _serve_steps(
        self,
        request_iterator: AsyncIterator[executor_pb2.StepPlan],
        launched: asyncio.Queue[asyncio.Future[LaunchedStep] | StreamReplaced | None],
        context: grpc.aio.ServicerContext,
        peer: str,
        planner: str,
    ) -> AsyncGenerator[executor_pb2.StepOutput, None]:
        self._runner.bind_thread()  # this thread launches the steps
        # A stream starts from zero tables, as after a restart: the planner that opens it again (after a
        # loss or a refused plan) writes every row whole. Behind any step still running from the last one.
        await asyncio.get_running_loop().run_in_executor(self._compute, self._open_stream, planner)
        in_flight = asyncio.Semaphore(PLANS_IN_FLIGHT)
        launcher = StepLauncher(self._runner, self._compute)

        async def launch_plans() -> None:
            # Launches plan N+1 while step N runs; a plan is read once fewer than two await their output.
            try:
                async for plan in request_iterator:
                    await in_flight.acquire()
                    try:
                        launched.put_nowait(await launcher.launch(plan))
                    except Exception as err:  # its grammar failed to compile: nothing behind it launches
                        launched.put_nowait(failed_launch(err))
                        return
            finally:
                launched.put_nowait(None)

        reader = asyncio.create_task(launch_plans())
        log.info("steps stream opened", peer=peer)
        try:
            while (launch := await launched.get()) is not None:
                try:
                    if isinstance(launch, StreamReplaced):
                        raise launch
                    output = await collect_when_ready(self._runner, await launch)
                except PlanError as err:
                    log.warning("plan refused", error=str(err))
                    # With two plans in flight the planner writes no more once this one is read: it reads.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(launched.get(), REFUSAL_GRACE_S)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                except StreamReplaced:
                    await context.abort(
                        grpc.StatusCode.ABORTED, "a newer Steps stream of the same planner replaced this one"
                    )
                except (
                    StageLost
                ) as err:  # the group is lost with the stage: this one exits, to restart with it
                    asyncio.get_running_loop().call_later(EXIT_DELAY_S, _exit_group_lost, str(err))
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"stage group lost: {err}")
                except Exception as err:  # a step that failed on the device: none behind it runs
                    log.exception("step failed")
                    await context.abort(grpc.StatusCode.INTERNAL, f"step failed: {type(err).__name__}: {err}")
                in_flight.release()
                yield output
            await reader  # surfaces a broken request stream
        finally:
            # Steps launched and not collected finish on the device; their outputs are dropped.
            reader.cancel()
            launcher.forget_launched()

    def _open_stream(self, planner: str) -> None:
        """On the thread that runs the steps, behind those of the last stream: zero tables, and the stream's
        tag in the transfers' headers of a split (a stage that ran a step another never read fails the group)."""
        self._runner.store.reset()
        self._runner.model.stage.stream = stream_tag(planner)

    async def PrepareGrammar(
        self, request: executor_pb2.Grammar, context: grpc.aio.ServicerContext
    ) -> executor_pb2.GrammarPrepared:
        grammar = grammar_text(request)
        try:
            if grammar is None:
                raise PlanError("PrepareGrammar: the grammar is empty (neither json_object nor json_schema)")
            await self._runner.grammars.compile_ahead([grammar])
        except PlanError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return executor_pb2.GrammarPrepared()

    async def Park(
        self, request: executor_pb2.ParkPagesRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ParkPagesReply:
        return await _answer("park", request.conversation_id, self.snapshots.park(request), context)

    async def Restore(
        self, request: executor_pb2.RestorePagesRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.RestorePagesReply:
        return await _answer("restore", request.conversation_id, self.snapshots.restore(request), context)


def _exit_group_lost(why: str) -> None:
    """A stage of a lost group exits (status EXIT_GROUP_LOST): a process group cannot take a restarted stage
    back, so the whole group restarts."""
    log.error("stage group lost; exiting", error=why)
    os._exit(EXIT_GROUP_LOST)


async def _answer(what: str, conversation_id: str, call: Awaitable, context: grpc.aio.ServicerContext):
    """The reply of a Park or Restore, or its refusal as a gRPC status with a log line."""
    try:
        return await call
    except SnapshotRefused as err:
        log.warning(f"{what} refused", conversation_id=conversation_id, code=err.code.name, error=str(err))
        await context.abort(err.code, str(err))
    except StageLost as err:  # a park's transfer with a stage gone: this one exits, to restart with its group
        log.error(f"{what} failed: stage group lost", conversation_id=conversation_id, error=str(err))
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"stage group lost: {err}")
    except Exception as err:
        log.exception(f"{what} failed", conversation_id=conversation_id)
        await context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(err).__name__}: {err}")


async def start_executor_server(
    runner: StepRunner,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    cache: str | None = None,
    shard_layers: int = DEFAULT_SHARD_LAYERS,
    security: ServerSecurity | None = None,
    cache_channel: ChannelSecurity | None = None,
    metrics: CollectorRegistry | None = None,
) -> StartedServer[ExecutorServicer]:
    """Serve Executor, grpc.health.v1 (SERVING) and reflection on host:port (0 = any free port).

    `cache` and `shard_layers` are ExecutorConfig's: the cache service Park and Restore use (None
    refuses them) and the layers per snapshot shard. `security`: TLS on its port and the keys it takes (the
    service keys alone: its callers are the planners; mTLS checks them too where --tls-client-ca is given);
    `cache_channel`: how it reaches the cache (TLS, the service key); `metrics`: the registry its step times
    are read into when scraped (executor_metrics.py).
    """
    servicer = ExecutorServicer(runner, cache=cache, shard_layers=shard_layers, cache_channel=cache_channel)
    if metrics is not None:
        register_executor_metrics(metrics, runner)
    return await start_server(
        servicer,
        executor_pb2_grpc.add_ExecutorServicer_to_server,
        (SERVICE_NAME,),
        host,
        port,
        security=security,
    )
