"""API keys and TLS at the gRPC floor: the key file, the interceptor (UNAUTHENTICATED, health open, the
caller's tenant), and TLS / mTLS over loopback with certificates made here."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import cache_pb2, cache_pb2_grpc
from protos.auth import (
    Caller,
    KeyFileError,
    TenantMismatch,
    as_caller,
    bearer_key,
    load_keys,
    parse_keys,
    request_tenant,
    tenant_of,
)
from protos.rpc import ChannelSecurity, ServerSecurity, open_channel, start_server
from protos.tls import ClientTLS, ServerTLS, TLSConfigError, server_tls
from tests.certs import make_pki

SERVICE = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name
ALICE, BOB, SERVICE_KEY = "alice-key-0123456789", "bob-key-0123456789ab", "service-key-0123456789"
KEYS = f"# tenants\n{ALICE} alice\n\n{BOB}   bob   # trailing comment\n{SERVICE_KEY} *\n"


def test_a_key_file_maps_keys_to_tenants_and_the_service():
    keys = parse_keys(KEYS)
    assert len(keys) == 3 and keys.tenants == 2
    assert keys.caller(ALICE) == Caller("alice") and keys.caller(BOB) == Caller("bob")
    assert keys.caller(SERVICE_KEY).service
    assert keys.caller("nobody-0123456789") is None and keys.caller("") is None


@pytest.mark.parametrize(
    "text, words",
    [
        ("alice-key-0123456789\n", "line 1: expected `<key> <tenant>`, found 1 fields"),
        ("# c\nalice-key-0123456789 alice extra\n", "line 2: expected"),
        ("short alice\n", "line 1: the key has 5 characters; a key has 16 to 1024"),
        ("k" * 1025 + " alice\n", "line 1: the key has 1025 characters; a key has 16 to 1024"),
        ("alice-key-0123456789 al/ice\n", "line 1: tenant 'al/ice' is not a name"),
        ("alice-key-0123456789 a\nalice-key-0123456789 b\n", "line 2: the key is listed twice"),
        ("# nothing\n\n", "no keys"),
        ("alice-kéy-0123456789 alice\n", "line 1: the key has characters a key cannot send"),
    ],
)
def test_a_malformed_key_file_names_its_line_and_never_the_key(text, words):
    with pytest.raises(KeyFileError, match="keys.txt") as error:
        parse_keys(text, "keys.txt")
    assert words in str(error.value)
    assert "alice-key-0123456789" not in str(error.value)


def test_load_keys_reads_a_file_and_names_one_it_cannot_read(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEYS)
    assert len(load_keys(str(path))) == 3
    with pytest.raises(KeyFileError, match="cannot read the key file"):
        load_keys(str(tmp_path / "missing"))
    path.write_bytes(f"\ufeff{ALICE} alice\n".encode())  # an editor's byte-order mark before the first key
    assert load_keys(str(path)).caller(ALICE) is not None


def test_a_certificate_with_another_certificates_key_is_refused_naming_both(tmp_path):
    pki = make_pki(str(tmp_path))
    ServerTLS(pki.server.cert, pki.server.key).check()
    with pytest.raises(TLSConfigError, match="are not a certificate and its key") as error:
        ServerTLS(pki.server.cert, pki.client.key).check()
    assert pki.server.cert in str(error.value) and pki.client.key in str(error.value)


def test_bearer_key_reads_the_authorization_entry():
    assert bearer_key([("user-agent", "x"), ("authorization", "Bearer k-1")]) == "k-1"
    assert bearer_key([("authorization", "bearer  k-2 ")]) == "k-2"
    assert bearer_key([("authorization", "Basic abc")]) is None
    assert bearer_key([("authorization", "Bearer ")]) is None and bearer_key(None) is None


def test_the_tenant_comes_from_the_key_and_a_service_key_names_it():
    as_caller(None)  # the API is open: what the request says, as before keys
    assert tenant_of("") == "default" and tenant_of("t") == "t"
    as_caller(Caller("alice"))
    assert tenant_of("") == "alice" and tenant_of("alice") == "alice"
    with pytest.raises(TenantMismatch):
        tenant_of("bob")
    as_caller(Caller(None))  # the service identity acts for the tenant a request names
    assert tenant_of("bob") == "bob" and tenant_of("") == "default"
    as_caller(None)


class _Echo(cache_pb2_grpc.CacheServicer):
    """Stat answers the caller's tenant (as its length, in count); Put counts its parts under the tenant."""

    async def Stat(self, request, context):
        tenant = await request_tenant(context, request.tenant)
        return cache_pb2.StatReply(count=len(tenant), tenant_count=int(tenant == "alice"))

    async def Put(self, request_iterator, context):
        parts = [part async for part in request_iterator]
        return cache_pb2.PutReply(key=await request_tenant(context, ""), evicted=len(parts))


async def _serve(security: ServerSecurity):
    return await start_server(
        _Echo(), cache_pb2_grpc.add_CacheServicer_to_server, (SERVICE,), "127.0.0.1", 0, security=security
    )


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def test_no_key_or_an_unknown_key_is_unauthenticated_and_health_stays_open():
    server = await _serve(ServerSecurity(keys=parse_keys(KEYS)))
    address = f"127.0.0.1:{server.port}"
    try:
        for key, words in ((None, "no API key"), ("wrong-key-0123456789", "unknown API key")):
            async with open_channel(address, ChannelSecurity(api_key=key)) as channel:
                assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
                stub = cache_pb2_grpc.CacheStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.Stat(cache_pb2.StatRequest(), timeout=5)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert words in error.value.details() and ALICE not in error.value.details()
                # A client stream is refused the same way, once it has been read to its end (refused at once, a
                # write still going out would fail in the client, which then reports INTERNAL itself)
                call = stub.Put(timeout=5)
                for _ in range(3):
                    await call.write(cache_pb2.SnapshotPart())
                await call.done_writing()
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with open_channel(address, ChannelSecurity(api_key=ALICE)) as channel:
            stub = cache_pb2_grpc.CacheStub(channel)
            assert (await stub.Stat(cache_pb2.StatRequest(), timeout=5)).count == len("alice")
            with pytest.raises(grpc.aio.AioRpcError) as error:  # alice's key cannot act for bob
                await stub.Stat(cache_pb2.StatRequest(tenant="bob"), timeout=5)
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            call = stub.Put(timeout=5)
            for _ in range(3):
                await call.write(cache_pb2.SnapshotPart())
            await call.done_writing()
            reply = await call
            assert (reply.key, reply.evicted) == ("alice", 3)
        async with open_channel(address, ChannelSecurity(api_key=SERVICE_KEY)) as channel:
            reply = await cache_pb2_grpc.CacheStub(channel).Stat(
                cache_pb2.StatRequest(tenant="bob"), timeout=5
            )
            assert reply.count == len("bob")
    finally:
        await server.stop(0)


def test_server_tls_from_flags_needs_both_halves(tmp_path):
    assert server_tls(None, None) is None
    with pytest.raises(TLSConfigError, match="both --tls-cert and --tls-key"):
        server_tls("cert.pem", None)
    with pytest.raises(TLSConfigError, match="--tls-client-ca needs"):
        server_tls(None, None, "ca.pem")
    with pytest.raises(TLSConfigError, match="both its certificate and its key"):
        ClientTLS(cert="c.pem")
    with pytest.raises(TLSConfigError, match="cannot read the TLS key"):
        ServerTLS(str(tmp_path / "no.pem"), str(tmp_path / "no.key")).credentials()


async def test_tls_refuses_plaintext_and_serves_a_client_that_trusts_its_ca(tmp_path):
    pki = make_pki(str(tmp_path))
    server = await _serve(ServerSecurity(tls=ServerTLS(pki.server.cert, pki.server.key)))
    address = f"127.0.0.1:{server.port}"
    try:
        async with open_channel(address) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await _health(plaintext)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        async with open_channel(address, ChannelSecurity(tls=ClientTLS(ca=pki.other_ca.cert))) as untrusting:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await _health(untrusting)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        async with open_channel(address, ChannelSecurity(tls=ClientTLS(ca=pki.ca.cert))) as channel:
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            reply = await cache_pb2_grpc.CacheStub(channel).Stat(cache_pb2.StatRequest(tenant="t"), timeout=5)
            assert reply.count == 1
    finally:
        await server.stop(0)


def test_a_client_ca_that_is_not_one_fails_the_check_naming_it(tmp_path):
    """gRPC would only fail to listen (read as a port taken); the check says which file is wrong."""
    pki = make_pki(str(tmp_path))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("garbage\n")
    ServerTLS(pki.server.cert, pki.server.key, client_ca=pki.ca.cert).check()
    with pytest.raises(
        TLSConfigError, match=f"--tls-client-ca {not_pem} is not a file of PEM CA certificates"
    ):
        ServerTLS(pki.server.cert, pki.server.key, client_ca=str(not_pem)).check()


async def test_mtls_needs_a_client_certificate_signed_by_the_client_ca(tmp_path):
    pki = make_pki(str(tmp_path))
    tls = ServerTLS(pki.server.cert, pki.server.key, client_ca=pki.ca.cert)
    server = await _serve(ServerSecurity(tls=tls, keys=parse_keys(KEYS)))
    address = f"127.0.0.1:{server.port}"
    try:
        async with open_channel(address, ChannelSecurity(tls=ClientTLS(ca=pki.ca.cert))) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await _health(anonymous)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        client = ClientTLS(ca=pki.ca.cert, cert=pki.client.cert, key=pki.client.key)
        async with open_channel(address, ChannelSecurity(tls=client, api_key=ALICE)) as channel:
            reply = await cache_pb2_grpc.CacheStub(channel).Stat(cache_pb2.StatRequest(), timeout=5)
            assert reply.count == len("alice")
    finally:
        await server.stop(0)
