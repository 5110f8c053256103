"""The planner's link to one executor: a gRPC step stream, or the runner called in this process."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from typing import Protocol

import grpc

from protos import executor_pb2, executor_pb2_grpc
from protos.rpc import CHANNEL_OPTIONS


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
    """Launches plans from this process's event loop as the executor does (`launch_step`) and polls their
    outputs there: the executor's own steps without the gRPC hop (the benchmark's baseline for it)."""

    def __init__(self, runner):
        self.address = "in-process"
        self._runner = runner
        self._compute = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cpu-steps", initializer=runner.bind_thread
        )
        self._launched: deque[asyncio.Task] = deque()  # each plan's launch, in order

    async def describe(self) -> executor_pb2.ExecutorDescription:
        return self._runner.describe()

    async def open(self) -> None:
        self._runner.bind_thread()

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        from executor_svc.runner import launch_step  # the executor's side, here in-process

        # Runs at the loop's next turn, ahead of the stream writes this step releases.
        self._launched.append(asyncio.ensure_future(launch_step(self._runner, plan, self._compute)))

    async def recv(self) -> executor_pb2.StepOutput:
        from executor_svc.runner import collect_when_ready

        return await collect_when_ready(self._runner, await self._launched.popleft())

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        raise LinkError("the in-process link has no cache service: parking needs a gRPC executor")

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        raise LinkError("the in-process link has no cache service: restoring needs a gRPC executor")

    async def close(self) -> None:
        for launch in self._launched:
            launch.cancel()
        self._launched.clear()
        self._runner.forget_launched()
        self._compute.shutdown(wait=True, cancel_futures=True)
