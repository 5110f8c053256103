"""Trust end to end, over real gRPC on loopback: cache, executor and planner with TLS (mTLS between the
services), API keys at the planner and the cache (the planner and the executor reach the cache with the
service key), and two tenants that see nothing of each other, shared prefix pages included."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2

from cache_svc.server import start_cache_server
from executor_svc.config import ExecutorConfig
from planner_svc.client import PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from protos import client_pb2
from protos.auth import parse_keys
from protos.rpc import ChannelSecurity, ServerSecurity, open_channel
from protos.tls import ClientTLS, ServerTLS
from protos.wire import pack_i32
from tests.certs import make_pki
from tests.conftest import SMOL_BUCKETS

pytestmark = pytest.mark.asyncio(loop_scope="session")

ALICE, BOB, SERVICE = "alice-key-0123456789", "bob-key-0123456789ab", "service-key-0123456789"
PROMPT = list(range(200, 240))  # two full pages of 16 and 8 tokens


class Trusted:
    def __init__(self, directory: str) -> None:
        self.pki = make_pki(directory)
        self.directory = directory
        self.servers: list = []

    def client(self, key: str | None, *, tls: bool = True) -> PlannerClient:
        security = ChannelSecurity(tls=ClientTLS(ca=self.pki.ca.cert) if tls else None, api_key=key)
        return PlannerClient(self.addr, security)

    async def start(self, service_key: str = SERVICE) -> None:
        """The stack, its executor reaching the cache with `service_key` (another than the cache's: a stack
        misconfigured by its operator)."""
        from executor_svc.runner import build_runner
        from executor_svc.server import start_executor_server
        from planner_svc.server import start_planner_server

        pki, keys = self.pki, parse_keys(f"{ALICE} alice\n{BOB} bob\n{SERVICE} *\n")
        mutual = ServerTLS(pki.server.cert, pki.server.key, client_ca=pki.ca.cert)  # between the services
        as_service = ClientTLS(ca=pki.ca.cert, cert=pki.server.cert, key=pki.server.key)
        cache = await start_cache_server(
            self.directory, 1 << 30, security=ServerSecurity(tls=mutual, keys=keys)
        )
        self.servers.append(cache)
        cache_addr = f"127.0.0.1:{cache.port}"
        to_cache = ChannelSecurity(tls=as_service, api_key=service_key)
        config = ExecutorConfig(device="cpu", dtype="float32", pool_pages=200, buckets=SMOL_BUCKETS)
        runner = await asyncio.to_thread(build_runner, config)
        executor = await start_executor_server(
            runner, cache=cache_addr, security=ServerSecurity(tls=mutual), cache_channel=to_cache
        )
        self.servers.append(executor)
        planner = await start_planner_server(
            PlannerConfig(
                executors=[f"127.0.0.1:{executor.port}"],
                cache=cache_addr,
                scheduling=SchedulingConfig(prefill_token_budget=512, prefix_cache=True),
            ),
            security=ServerSecurity(tls=ServerTLS(pki.server.cert, pki.server.key), keys=keys),
            executor_channel=ChannelSecurity(tls=as_service),
            cache_channel=to_cache,
        )
        self.servers.append(planner)
        self.addr = f"127.0.0.1:{planner.port}"

    async def stop(self) -> None:
        for server in reversed(self.servers):
            await server.stop(None)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def trusted(tmp_path_factory):
    stack = Trusted(str(tmp_path_factory.mktemp("trust")))
    await stack.start()
    yield stack
    await stack.stop()


async def generate(client: PlannerClient, conversation: str = "", **fields) -> client_pb2.GenerateResponse:
    last = None
    async for response in client._stub.Generate(
        client_pb2.GenerateRequest(
            token_ids=pack_i32(PROMPT), max_tokens=2, conversation_id=conversation, **fields
        ),
        timeout=60,
    ):
        last = response
    assert last is not None
    return last


async def expect(call, code: grpc.StatusCode, words: str = "") -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    assert refused.value.code() == code, refused.value.details()
    assert words in (refused.value.details() or "")


async def test_no_key_or_a_wrong_key_is_unauthenticated_and_health_stays_open(trusted):
    for key, words in ((None, "no API key"), ("wrong-key-0123456789", "unknown API key")):
        async with trusted.client(key) as client:
            await client.wait_ready(10)
            await expect(
                client._stub.GetServerInfo(client_pb2.ServerInfoRequest()),
                grpc.StatusCode.UNAUTHENTICATED,
                words,
            )
            await expect(generate(client), grpc.StatusCode.UNAUTHENTICATED, words)


async def test_a_plaintext_client_is_refused_by_the_tls_planner(trusted):
    async with trusted.client(ALICE, tls=False) as client:
        await expect(
            client._stub.GetServerInfo(client_pb2.ServerInfoRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE
        )
    async with open_channel(trusted.addr) as channel:  # nor health over plaintext
        from grpc_health.v1 import health_pb2_grpc

        await expect(
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5),
            grpc.StatusCode.UNAVAILABLE,
        )


async def test_prefix_pages_are_shared_within_a_tenant_only(trusted):
    async with trusted.client(ALICE) as alice, trusted.client(BOB) as bob:
        first = await generate(alice)
        again = await generate(alice)
        other = await generate(bob)
    assert first.reused_tokens == 0 and again.reused_tokens == 32  # two full pages, one token left to read
    assert other.reused_tokens == 0  # B's identical prompt: none of A's pages


async def test_a_service_key_the_cache_refuses_is_internal_not_the_callers_unauthenticated(tmp_path):
    """The operator's mistake (an executor's --cache-api-key the cache does not hold) is not the tenant's:
    the park fails INTERNAL naming the service's key, where it answered the tenant UNAUTHENTICATED."""
    stack = Trusted(str(tmp_path))
    await stack.start(service_key="not-the-service-key-0123456789")
    try:
        async with stack.client(ALICE) as client:
            await generate(client, "misconfigured")
            await expect(client.park("misconfigured"), grpc.StatusCode.INTERNAL, "--cache-api-key")
    finally:
        await stack.stop()


async def test_a_tenant_cannot_see_park_resume_or_name_anothers_conversation(trusted):
    async with trusted.client(ALICE) as alice, trusted.client(BOB) as bob:
        await generate(alice, "mine")
        listed = await bob._stub.ListConversations(client_pb2.ListConversationsRequest())
        assert "mine" not in [c.conversation_id for c in listed.conversations]
        await expect(
            bob._stub.Park(client_pb2.ParkRequest(conversation_id="mine")), grpc.StatusCode.NOT_FOUND
        )
        await expect(
            bob._stub.Park(client_pb2.ParkRequest(conversation_id="mine", tenant="alice")),
            grpc.StatusCode.PERMISSION_DENIED,
        )
        # alice parks through the executor and the cache (mTLS, the service key) and resumes
        parked = await alice._stub.Park(client_pb2.ParkRequest(conversation_id="mine"))
        assert parked.bytes > 0
        await expect(
            bob._stub.Resume(client_pb2.ResumeRequest(conversation_id="mine")), grpc.StatusCode.NOT_FOUND
        )
        resumed = await alice._stub.Resume(client_pb2.ResumeRequest(conversation_id="mine"))
        assert resumed.tokens == len(PROMPT) + 1
        listed = await alice._stub.ListConversations(client_pb2.ListConversationsRequest())
        assert "mine" in [c.conversation_id for c in listed.conversations]


async def test_a_tenant_deletes_its_own_conversation_only(trusted):
    """Delete scopes by the key's tenant as park does: bob's key finds no conversation of alice's (NOT_FOUND,
    as for an id nobody has) and cannot name her (PERMISSION_DENIED); alice's delete reaches the cache with
    the service key and removes her snapshot."""
    async with trusted.client(ALICE) as alice, trusted.client(BOB) as bob:
        await generate(alice, "deleted")
        assert (await alice._stub.Park(client_pb2.ParkRequest(conversation_id="deleted"))).bytes > 0
        await expect(
            bob.delete_conversation("deleted"), grpc.StatusCode.NOT_FOUND, "no conversation 'deleted'"
        )
        await expect(bob.delete_conversation("deleted", "alice"), grpc.StatusCode.PERMISSION_DENIED)
        assert (await alice.delete_conversation("deleted")).snapshot_bytes > 0
        listed = await alice._stub.ListConversations(client_pb2.ListConversationsRequest())
        assert "deleted" not in [c.conversation_id for c in listed.conversations]
        await expect(
            alice._stub.Resume(client_pb2.ResumeRequest(conversation_id="deleted")), grpc.StatusCode.NOT_FOUND
        )


async def test_request_ids_are_per_tenant_and_abort_finds_the_callers_own(trusted):
    async with trusted.client(ALICE) as alice, trusted.client(BOB) as bob:
        long = client_pb2.GenerateRequest(
            token_ids=pack_i32(PROMPT), max_tokens=400, ignore_eos=True, request_id="shared"
        )
        mine, theirs = alice._stub.Generate(long, timeout=60), bob._stub.Generate(long, timeout=60)
        for call in (mine, theirs):  # the same id from two tenants: both run
            first = await call.read()
            assert first is not grpc.aio.EOF and first.request_id == "shared"
        await expect(generate(alice, request_id="shared"), grpc.StatusCode.ALREADY_EXISTS, "already running")
        await expect(  # a tenant key cannot name the other tenant's requests
            bob._stub.Abort(client_pb2.AbortRequest(request_id="shared", tenant="alice")),
            grpc.StatusCode.PERMISSION_DENIED,
        )
        assert (await bob._stub.Abort(client_pb2.AbortRequest(request_id="shared"))).aborted
        assert [r async for r in theirs][-1].finish_reason == client_pb2.FINISH_REASON_ABORT
        assert (await mine.read()).finish_reason == client_pb2.FINISH_REASON_UNSPECIFIED  # alice's runs on
        assert await alice.abort("shared")
        assert [r async for r in mine][-1].finish_reason == client_pb2.FINISH_REASON_ABORT
        assert not await alice.abort("shared")  # ended: nothing of that id is left to abort
