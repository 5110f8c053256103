"""API keys: the key file (pure), the server interceptor that maps a caller's key to its tenant, and the
client side that sends a key.

A key file holds lines `<key> <tenant>` (`#` starts a comment; blank lines are skipped). The tenant `*`
names the *service identity*: a key the planner and the executors use to reach the cache, allowed to act
for the tenant a request names. Any other key acts for its own tenant only: a request that names another
tenant is refused (PERMISSION_DENIED), so a tenant key cannot impersonate anyone.

Keys are held as sha256 digests and looked up by digest (the lookup's timing depends on the digest, not
on how much of a key matched); they are never logged and no error repeats one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass

import grpc

DEFAULT_TENANT = "default"
SERVICE = "*"  # the tenant column of a service key
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # answer without a key
# longest a key may be: gRPC refuses metadata past 16 KiB (at times past 8 KiB); HTTP carries the same key
MAX_KEY_CHARS = 1024
REFUSED_DRAIN_S = 30.0  # at most this long spent reading the rest of a refused client stream
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and line, never a key."""


class TenantMismatch(PermissionError):
    """A tenant key used for a request that names another tenant."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from: a tenant's key, or the service identity (tenant None)."""

    tenant: str | None

    @property
    def service(self) -> bool:
        return self.tenant is None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """Keys (as sha256 digests) to callers."""

    def __init__(self, callers: dict[bytes, Caller], source: str = "") -> None:
        self._callers = callers
        self.source = source

    def __len__(self) -> int:
        return len(self._callers)

    @property
    def tenants(self) -> int:
        return len({c.tenant for c in self._callers.values() if not c.service})

    def caller(self, key: str) -> Caller | None:
        return self._callers.get(_digest(key))

    def services(self) -> ApiKeys:
        """The service keys alone: what an executor takes (its callers are planners, never tenants)."""
        return ApiKeys({d: c for d, c in self._callers.items() if c.service}, self.source)


def parse_keys(text: str, source: str = "the key file") -> ApiKeys:
    """The keys of a key file's text; KeyFileError naming the first malformed line."""
    callers: dict[bytes, Caller] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source}, line {number}"
        if len(fields) != 2:
            raise KeyFileError(f"{where}: expected `<key> <tenant>`, found {len(fields)} fields")
        key, tenant = fields
        if not 16 <= len(key) <= MAX_KEY_CHARS:
            raise KeyFileError(f"{where}: the key has {len(key)} characters; a key has 16 to {MAX_KEY_CHARS}")
        if not key.isascii() or not key.isprintable():  # gRPC metadata and HTTP headers carry no other
            raise KeyFileError(f"{where}: the key has characters a key cannot send (printable ASCII only)")
        if tenant != SERVICE and not _TENANT_NAME.fullmatch(tenant):
            raise KeyFileError(
                f"{where}: tenant {tenant[:64]!r} is not a name (letters, digits, . _ @ -) or {SERVICE}"
            )
        digest = _digest(key)
        if digest in callers:
            raise KeyFileError(f"{where}: the key is listed twice")
        callers[digest] = Caller(None if tenant == SERVICE else tenant)
    if not callers:
        raise KeyFileError(f"{source}: no keys")
    return ApiKeys(callers, source)


def load_keys(path: str) -> ApiKeys:
    try:
        with open(path, encoding="utf-8-sig") as file:  # an editor's byte-order mark is not the first key's
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise KeyFileError(f"cannot read the key file {path}: {error}") from error
    return parse_keys(text, path)


def bearer_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key of an `authorization: Bearer <key>` entry, if any."""
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str):
            scheme, _, key = value.partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                return key.strip()
    return None


# ---- the caller of the request being served, and its tenant ----

_caller: ContextVar[Caller | None] = ContextVar("deltaserve_caller", default=None)


def tenant_of(requested: str) -> str:
    """The tenant a request acts for: the key's tenant; what the request names when the caller is the
    service identity or the API is open (no keys); DEFAULT_TENANT when it names none.

    A tenant key whose request names another tenant: TenantMismatch.
    """
    caller = _caller.get()
    if caller is None or caller.service:
        return requested or DEFAULT_TENANT
    if requested and requested != caller.tenant:
        raise TenantMismatch("the request names a tenant other than its API key's")
    return caller.tenant  # type: ignore[return-value]


def key_tenant() -> str | None:
    """The tenant of the current request's key; None when the API is open or the caller is the service."""
    caller = _caller.get()
    return None if caller is None else caller.tenant


def as_caller(caller: Caller | None) -> None:
    """Sets the caller of the current task (tests; the interceptor does it for a served request)."""
    _caller.set(caller)


async def drain_refused(requests: AsyncIterator) -> None:
    """Reads (and drops) the rest of a refused client stream before its status goes out: a status sent while
    the client still writes large messages reaches it as INTERNAL "Internal error from Core", not as itself."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REFUSED_DRAIN_S):
            async for _ in requests:
                pass


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED. A client stream (a cache Put of a
    snapshot) is drained first; a two-way stream is not, as its client writes on until it hears back."""

    async def unary(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def client_stream(requests, context: grpc.aio.ServicerContext):
        await drain_refused(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (an async generator: abort raises first)

    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, streaming),
        (True, False): (grpc.stream_unary_rpc_method_handler, client_stream),
        (True, True): (grpc.stream_stream_rpc_method_handler, streaming),
    }
    make, behavior = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


Refused = Callable[[str, str], None]  # (the method, why), for a call refused UNAUTHENTICATED: never the key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call with no key or an unknown one (health and reflection stay open), told to
    `on_refused` (the service counts and logs it: the refusal never reaches its handler); otherwise the call is
    served with its caller set (tenant_of reads it).

    The caller is set in the call's own task: grpc.aio runs the interceptors and then the handler in it.
    """

    def __init__(self, keys: ApiKeys, on_refused: Refused | None = None) -> None:
        self.keys = keys
        self.on_refused = on_refused

    def _refuse(self, handler: grpc.RpcMethodHandler, method: str, why: str) -> grpc.RpcMethodHandler:
        if self.on_refused is not None:
            self.on_refused(method, why)
        return _refusal(handler, why)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        key = bearer_key(handler_call_details.invocation_metadata)
        if key is None:
            return self._refuse(handler, method, "no API key: send `authorization: Bearer <key>` metadata")
        caller = self.keys.caller(key)
        if caller is None:
            return self._refuse(handler, method, "unknown API key")
        _caller.set(caller)
        return handler


class _Keyed:
    def __init__(self, key: str) -> None:
        self._entry = ("authorization", f"Bearer {key}")

    def _with_key(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return details._replace(metadata=metadata)


class _UnaryUnary(_Keyed, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_key(client_call_details), request)


class _UnaryStream(_Keyed, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_key(client_call_details), request)


class _StreamUnary(_Keyed, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_key(client_call_details), request_iterator)


class _StreamStream(_Keyed, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_key(client_call_details), request_iterator)


def bearer_interceptors(key: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add `authorization: Bearer <key>` to every call of a channel (grpc.aio
    files an interceptor under one call kind only: one each)."""
    return [kind(key) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


async def request_tenant(context: grpc.aio.ServicerContext, requested: str) -> str:
    """tenant_of for a servicer: a tenant key naming another tenant ends the call with PERMISSION_DENIED."""
    try:
        return tenant_of(requested)
    except TenantMismatch as error:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        raise  # abort raises; this line is for the type checker
