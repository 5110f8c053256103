"""The planner's link to one executor: a gRPC step stream, or the runner called in this process."""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from typing import Protocol

import grpc

from protos import executor_pb2, executor_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class LinkError(Exception):
    """What a link cannot do (the in-process link has no cache)."""


class ExecutorLink(Protocol):
    address: str

    async def describe(self) -> executor_pb2.ExecutorDescription: ...

    async def open(self) -> None: ...

    async def send(self, plan: executor_pb2.StepPlan) -> None: ...

    async def recv(self) -> executor_pb2.StepOutput: ...

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply: ...

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply: ...

    async def close(self) -> None: ...


class GrpcLink:
    """One bidirectional Steps stream; plans are written without waiting for earlier outputs."""

    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._call = None

    async def describe(self) -> executor_pb2.ExecutorDescription:
        return await self._stub.Describe(executor_pb2.DescribeRequest(), wait_for_ready=True)

    async def open(self) -> None:
        self._call = self._stub.Steps()

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        await self._call.write(plan)

    async def recv(self) -> executor_pb2.StepOutput:
        output = await self._call.read()
        if output is grpc.aio.EOF:
            raise ConnectionError(f"executor {self.address} closed the step stream")
        return output

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        return await self._stub.Park(request)

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        return await self._stub.Restore(request)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        await self._channel.close()


class InProcessLink:
    """Runs plans on the runner's own thread in this process: the same steps without the gRPC hop."""

    def __init__(self, runner):
        self.address = "in-process"
        self._runner = runner
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="executor", initializer=runner.bind_thread
        )
        self._pending: deque[asyncio.Future] = deque()

    async def describe(self) -> executor_pb2.ExecutorDescription:
        return self._runner.describe()

    async def open(self) -> None:
        pass

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        loop = asyncio.get_running_loop()
        self._pending.append(loop.run_in_executor(self._thread, self._runner.launch, plan))

    async def recv(self) -> executor_pb2.StepOutput:
        from executor_svc.runner import collect_when_ready  # the executor's side, here in-process

        return await collect_when_ready(self._runner, await self._pending.popleft())

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        raise LinkError("the in-process link has no cache service: parking needs a gRPC executor")

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        raise LinkError("the in-process link has no cache service: restoring needs a gRPC executor")

    async def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
