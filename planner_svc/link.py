"""The planner's link to one executor: a gRPC step stream (bench/in_process.py has one in this process)."""

from __future__ import annotations

from typing import Protocol

import grpc

from protos import executor_pb2, executor_pb2_grpc
from protos.rpc import ChannelSecurity, open_channel


class LinkError(Exception):
    """What a link cannot do (the benchmarks' in-process link has no cache)."""


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

    def __init__(self, address: str, security: ChannelSecurity | None = None):
        self.address = address
        self._channel = open_channel(address, security)  # TLS when configured
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None  # the step stream, once open

    async def describe(self) -> executor_pb2.ExecutorDescription:
        return await self._stub.Describe(executor_pb2.DescribeRequest(), wait_for_ready=True)

    async def open(self) -> None:
        self._call = self._stub.Steps()

    def _stream(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            raise RuntimeError(f"executor {self.address}: the step stream is used before open()")
        return self._call

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        await self._stream().write(plan)

    async def recv(self) -> executor_pb2.StepOutput:
        output = await self._stream().read()
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
