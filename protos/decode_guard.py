"""Requests that do not parse (a string field that is not UTF-8) get INVALID_ARGUMENT naming the field.

Protobuf refuses a `string` field whose bytes are not UTF-8 while gRPC deserializes the request, before any
servicer runs; gRPC then answers UNKNOWN "Unexpected DecodeError" and logs a traceback. `guarded` wraps a
generated `add_..._to_server` so that each method's deserializer hands back an `Undecodable` instead, and
the method answers INVALID_ARGUMENT with what `undecodable_field` found. The proto stays as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError


class Undecodable:
    """What the guarded deserializer returns for bytes that do not parse."""

    def __init__(self, reason: str):
        self.reason = reason


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise DecodeError("truncated varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def undecodable_field(data: bytes, descriptor: Descriptor, path: str = "") -> str | None:
    """The first string field (dotted path, [i] for repeated) whose bytes are not UTF-8, with where; None
    when every string is UTF-8."""
    counts: dict[int, int] = {}
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, at = _varint(data, at)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            length, at = _varint(data, at)
            value, at = data[at : at + length], at + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = f"{path}{field.name}"
            if field.is_repeated:
                index = counts[number] = counts.get(number, -1) + 1
                name += f"[{index}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError as error:
                    return (
                        f"{name} is not valid UTF-8 (byte 0x{value[error.start]:02x} at offset {error.start})"
                    )
            elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                found = undecodable_field(value, field.message_type, f"{name}.")
                if found is not None:
                    return found
        else:
            raise DecodeError(f"wire type {wire} of field {number}")
    return None


def _deserializer(parse: Callable[[bytes], Any], descriptor: Descriptor) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as error:
            try:
                found = undecodable_field(data, descriptor)
            except DecodeError:
                found = None
            return Undecodable(found or f"the request does not parse: {error}")

    return deserialize


def _guard(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    if handler is None or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer
    descriptor = getattr(parse, "__self__", None)
    descriptor = getattr(descriptor, "DESCRIPTOR", None)
    if descriptor is None:
        return handler
    changes: dict[str, Any] = {"request_deserializer": _deserializer(parse, descriptor)}
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            return await unary(request, context)

        changes["unary_unary"] = unary_unary
    elif handler.unary_stream is not None:
        stream = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            async for response in stream(request, context):
                yield response

        changes["unary_stream"] = unary_stream
    else:
        return handler
    return handler._replace(**changes)


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self._inner = inner

    def service(self, handler_call_details):
        return _guard(self._inner.service(handler_call_details))


class _GuardedServer:
    """What the generated `add_..._to_server` sees: the server, with every handler guarded on the way in."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(service, {k: _guard(v) for k, v in handlers.items()})


def guarded(add_to_server: Callable[[Any, Any], None]) -> Callable[[Any, grpc.aio.Server], None]:
    """`add_to_server` whose methods answer INVALID_ARGUMENT for a request that does not parse."""

    def add(servicer: Any, server: grpc.aio.Server) -> None:
        add_to_server(servicer, _GuardedServer(server))

    return add
