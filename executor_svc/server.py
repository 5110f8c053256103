"""The executor's gRPC service: Describe, Park, Restore, and the Steps stream run on one GPU-loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Awaitable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_svc.config import DEFAULT_SHARD_LAYERS
from executor_svc.plan_check import PlanError
from executor_svc.runner import StepRunner, collect_when_ready
from executor_svc.snapshots import SnapshotRefused, Snapshots
from protos import executor_pb2, executor_pb2_grpc

log = structlog.get_logger("deltaserve.executor.server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
PLANS_IN_FLIGHT = 2  # the step running and the next one (DESIGN §3)
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name


class _StreamState:
    """Shared by one stream's handler and the GPU loop: once set, the stream's queued plans are skipped."""

    __slots__ = ("stopped",)

    def __init__(self) -> None:
        self.stopped = False


_SKIPPED = object()  # a plan queued behind a failed one, or behind the end of its stream


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Plans launch in order on one worker thread (the GPU loop); each output is collected off that thread
    once its tokens are back, in order, so step N+1 launches while step N runs.

    Park and Restore read and write the pool on that same thread, so they fall in order with the steps.
    """

    def __init__(
        self, runner: StepRunner, *, cache: str | None = None, shard_layers: int = DEFAULT_SHARD_LAYERS
    ) -> None:
        self._runner = runner
        self._gpu_loop = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="gpu-loop", initializer=runner.bind_thread
        )
        self._stream_open = False
        self._snapshots = Snapshots(runner, self._gpu_loop, cache, shard_layers)

    async def Describe(
        self, request: executor_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ExecutorDescription:
        return self._runner.describe()

    def _run_on_gpu_loop(self, stream: _StreamState, plan: executor_pb2.StepPlan):
        """On the GPU-loop thread: launch one plan's step unless its stream has already stopped."""
        if stream.stopped:
            return _SKIPPED
        try:
            return self._runner.launch(plan)
        except BaseException:
            stream.stopped = True  # plans behind a failed one must not run on tables it left
            raise

    async def Steps(
        self, request_iterator: AsyncIterator[executor_pb2.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.StepOutput]:
        if self._stream_open:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another Steps stream is already open")
        self._stream_open = True
        loop = asyncio.get_running_loop()
        stream = _StreamState()
        in_flight = asyncio.Semaphore(PLANS_IN_FLIGHT)
        results: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()

        async def read_plans() -> None:
            # Reads plan N+1 while plan N runs; a plan is submitted once fewer than two await their output.
            try:
                async for plan in request_iterator:
                    await in_flight.acquire()
                    results.put_nowait(
                        loop.run_in_executor(self._gpu_loop, self._run_on_gpu_loop, stream, plan)
                    )
            finally:
                results.put_nowait(None)

        reader = asyncio.create_task(read_plans())
        log.info("steps stream opened", peer=context.peer())
        try:
            while (result := await results.get()) is not None:
                try:
                    output = await collect_when_ready(self._runner, await result)
                except PlanError as err:
                    stream.stopped = True
                    log.warning("plan refused", error=str(err))
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                except Exception as err:
                    stream.stopped = True  # a step that failed on the device: none behind it runs
                    log.exception("step failed")
                    await context.abort(grpc.StatusCode.INTERNAL, f"step failed: {type(err).__name__}: {err}")
                in_flight.release()
                yield output
            await reader  # surfaces a broken request stream
        finally:
            stream.stopped = True
            reader.cancel()
            # A plan not started yet never starts; one running finishes and its result is dropped.
            while not results.empty():
                pending = results.get_nowait()
                if pending is not None:
                    pending.cancel()
            self._stream_open = False
            log.info("steps stream closed", peer=context.peer())

    async def Park(
        self, request: executor_pb2.ParkPagesRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ParkPagesReply:
        return await _answer("park", request.conversation_id, self._snapshots.park(request), context)

    async def Restore(
        self, request: executor_pb2.RestorePagesRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.RestorePagesReply:
        return await _answer("restore", request.conversation_id, self._snapshots.restore(request), context)


async def _answer(what: str, conversation_id: str, call: Awaitable, context: grpc.aio.ServicerContext):
    """The reply of a Park or Restore, or its refusal as a gRPC status with a log line."""
    try:
        return await call
    except SnapshotRefused as err:
        log.warning(f"{what} refused", conversation_id=conversation_id, code=err.code.name, error=str(err))
        await context.abort(err.code, str(err))
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
) -> tuple[grpc.aio.Server, int]:
    """Serve Executor, grpc.health.v1 (SERVING) and reflection on host:port (0 = any free port).

    `cache` and `shard_layers` are ExecutorConfig's: the cache service Park and Restore use (None
    refuses them) and the layers per snapshot shard.
    """
    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer = ExecutorServicer(runner, cache=cache, shard_layers=shard_layers)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
