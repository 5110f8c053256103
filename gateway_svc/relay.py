"""The gateway's side of the planner's gRPC API: a request's choices run as Generate calls (their responses
merged in arrival order), the caller's key forwarded with each call, and every call cancelled (the planner
aborts the request and frees its pages) when the HTTP client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

import grpc
from starlette.requests import Request

from gateway_svc.http_errors import ApiError
from gateway_svc.translate import Choice
from planner_svc.client import PlannerClient
from protos import client_pb2

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection: logged, never read
# A batch's choices in flight at once: a quarter of the planner's default waiting queue (--max-waiting 1024, which
# counts choices), so a batch never fills it alone; wider than the widest decode bucket, so a batch still decodes
# as one.
BATCH_IN_FLIGHT = 256


class ModelCatalog:
    """The planner's model, kept from its last answer: it does not change while the planner runs, and a
    request's `model` is checked against it (the request's own call then checks the caller's key)."""

    def __init__(self, planner: PlannerClient) -> None:
        self.planner = planner
        self._info: client_pb2.ModelInfo | None = None

    async def ask(self, key: str | None) -> client_pb2.ModelInfo:
        """The planner's answer to this caller (it checks the key: an answer kept from another caller's
        would let anyone list the model), kept for check()."""
        self._info = await rpc(self.planner.model_info(key))
        return self._info

    async def check(self, model: str, key: str | None) -> str:
        """The served model's name; 404 when the request names another (asked again first: a planner
        restarted with another model answers for it)."""
        info = self._info or await self.ask(key)
        if model != info.name:
            info = await self.ask(key)
        if model != info.name:
            raise unknown_model(model, info.name)
        return info.name


def unknown_model(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"the model {model!r} does not exist; this server serves {served!r} (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


async def rpc(call: Awaitable[T]) -> T:
    """A unary call's result; its gRPC status as an ApiError."""
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        raise ApiError.from_rpc(error) from None


async def _until_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read before: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; when the client goes away first, `work` is cancelled (its calls with it) and the
    answer is a 499 nobody reads."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ApiError(CLIENT_CLOSED, "the client closed the connection")
        return task.result()
    finally:
        for pending in (task, watch):
            pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


Response = tuple[int, client_pb2.GenerateResponse]  # (the choice's index in the answer, one of its responses)


async def _one(planner: PlannerClient, choice: Choice, key: str | None) -> AsyncGenerator[Response, None]:
    """One prompt's Generate call (its n choices); its status (and a request the client refuses to build) as
    ApiError."""
    try:
        async with contextlib.aclosing(planner.generate(choice.options, key)) as stream:
            async for response in stream:
                yield choice.index + response.index, response
    except grpc.aio.AioRpcError as error:
        raise ApiError.from_rpc(error) from None
    except UnicodeEncodeError:  # JSON's \ud800 escapes: a string protobuf cannot encode
        raise ApiError(
            400, "the request's text has a lone surrogate (\\ud800-\\udfff): not Unicode text"
        ) from None
    except ValueError as error:  # build_generate_request: a malformed chat or shared prefix
        raise ApiError(400, str(error)) from None


async def responses(
    planner: PlannerClient, choices: list[Choice], key: str | None
) -> AsyncGenerator[Response, None]:
    """The responses of every prompt's choices as they arrive, as many calls at once as hold BATCH_IN_FLIGHT
    choices, one at least (a batch of more choices than the planner's waiting queue holds would fill it alone,
    and be refused on every retry). Closing it early (or an error in one call) cancels every call still running."""
    streams = [_one(planner, choice, key) for choice in choices]
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[tuple[Response | None, BaseException | None]] = asyncio.Queue()
    in_flight = asyncio.Semaphore(max(1, BATCH_IN_FLIGHT // max(choice.options.n for choice in choices)))

    async def pump(stream: AsyncGenerator[Response, None]) -> None:
        try:
            async with in_flight:
                async for item in stream:
                    queue.put_nowait((item, None))
        except Exception as error:
            queue.put_nowait((None, error))
        else:
            queue.put_nowait((None, None))  # this choice ended

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            arrived, error = await queue.get()
            if error is not None:
                raise error
            if arrived is None:
                running -= 1
            else:
                yield arrived
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def arrived_together(stream: AsyncGenerator[T, None], first: list[T]) -> AsyncGenerator[list[T], None]:
    """`first` (what was taken from `stream` before), then the rest of `stream`, grouped: each list holds what
    had arrived by the time the previous one was taken. Under load a stream's responses queue up here, and the
    caller sends each group in one write instead of one write each. Closing it closes `stream` (cancelling its
    calls); an error in `stream` is raised after the responses that came before it."""
    # each entry: a response, or (at the end) the error the stream ended with or None
    arrived: asyncio.Queue[tuple[bool, T | BaseException | None]] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in stream:
                arrived.put_nowait((False, item))
        except Exception as error:
            arrived.put_nowait((True, error))
        else:
            arrived.put_nowait((True, None))

    task = asyncio.create_task(pump())
    try:
        group: list[T] = list(first)
        while True:
            ended, item = await arrived.get() if not group else (False, None)
            while not ended:
                if item is not None:
                    group.append(item)  # type: ignore[arg-type]
                if arrived.empty():
                    break
                ended, item = arrived.get_nowait()
            if group:
                yield group
                group = []
            if ended:
                if isinstance(item, BaseException):
                    raise item
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
