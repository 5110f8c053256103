"""The planner's link to one executor: a gRPC step stream (bench/in_process.py has one in this process)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Protocol

import grpc

from protos import executor_pb2, executor_pb2_grpc
from protos.rpc import INTERNAL_CHANNEL_OPTIONS, PLANNER_ID_METADATA, ChannelSecurity, open_channel

PLANNER_ID = uuid.uuid4().hex  # this planner process's, sent with each Steps stream it opens


class LinkError(Exception):
    """What a link cannot do (the benchmarks' in-process link has no cache)."""


class StepRefused(Exception):
    """The executor refused a plan (INVALID_ARGUMENT): a planner defect; the executor lives. The refused plan
    is the oldest in flight: the call's status comes only after every output before it was read."""


class LinkLost(ConnectionError):
    """The step stream ended or broke: the executor is gone (or hung), with the reason in words."""


def _reason(error: grpc.aio.AioRpcError) -> str:
    """A status in words, without the debug_error_string a person cannot use."""
    return f"{error.code().name}: {error.details() or 'no details'}"


class ExecutorLink(Protocol):
    address: str

    async def describe(self) -> executor_pb2.ExecutorDescription: ...

    async def open(self) -> None: ...

    async def send(self, plan: executor_pb2.StepPlan) -> None: ...

    async def recv(self) -> executor_pb2.StepOutput: ...

    async def until_ended(self) -> str: ...

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply: ...

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply: ...

    async def prepare_grammar(self, grammar: executor_pb2.Grammar) -> None: ...

    async def close(self) -> None: ...


class GrpcLink:
    """One bidirectional Steps stream; plans are written without waiting for earlier outputs."""

    def __init__(self, address: str, security: ChannelSecurity | None = None):
        self.address = address
        self._channel = open_channel(
            address, security, options=INTERNAL_CHANNEL_OPTIONS
        )  # TLS when configured
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None  # the step stream, once open

    async def describe(self) -> executor_pb2.ExecutorDescription:
        return await self._stub.Describe(executor_pb2.DescribeRequest(), wait_for_ready=True)

    async def open(self) -> None:
        """Open the step stream; a stream still open (after a loss or a refusal) is cancelled first, and should
        that cancel not reach the executor, the new stream (carrying this planner's id) replaces it there."""
        if self._call is not None:
            self._call.cancel()
        self._call = self._stub.Steps(metadata=((PLANNER_ID_METADATA, PLANNER_ID),))

    def _stream(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            raise RuntimeError(f"executor {self.address}: the step stream is used before open()")
        return self._call

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        try:
            await self._stream().write(plan)
        except grpc.aio.AioRpcError as error:
            raise self._ended(error) from None
        except (asyncio.InvalidStateError, grpc.aio.UsageError):
            # Written after the call finished: its status says why.
            call = self._stream()
            code, details = await call.code(), await call.details()
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                raise StepRefused(details or "plan refused") from None
            raise LinkLost(f"stream ended: {code.name}: {details}") from None

    async def recv(self) -> executor_pb2.StepOutput:
        try:
            output = await self._stream().read()
        except grpc.aio.AioRpcError as error:
            raise self._ended(error) from None
        if output is grpc.aio.EOF:
            raise LinkLost("the executor closed the step stream")
        return output

    async def until_ended(self) -> str:
        """Returns once the step stream ends (the executor died or closed it), with why; it reads nothing,
        so the engine awaits it while idle and cancels it when it has a step to send."""
        call = self._stream()
        return f"stream ended: {(await call.code()).name}: {await call.details()}"

    @staticmethod
    def _ended(error: grpc.aio.AioRpcError) -> Exception:
        if error.code() is grpc.StatusCode.INVALID_ARGUMENT:
            return StepRefused(error.details() or "plan refused")
        return LinkLost(f"stream ended: {_reason(error)}")

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        return await self._stub.Park(request)

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        return await self._stub.Restore(request)

    async def prepare_grammar(self, grammar: executor_pb2.Grammar) -> None:
        """Once the executor has compiled `grammar`; ValueError where it cannot. Other errors pass: the plan
        that writes the grammar compiles it then (an executor lost meanwhile shows on the step stream)."""
        try:
            await self._stub.PrepareGrammar(grammar)
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(error.details() or "the grammar cannot be compiled") from None

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        await self._channel.close()
