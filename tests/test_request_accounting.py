"""What the planner and the gateway record of a request over a small keyed stack (SmolLM2 on the CPU, 7 KV
pages of 16 tokens): Generate's refusals before admission counted by status code (a key refused at the
interceptor too), a refused key said at warning level without its value and not once per call, the tenant on
a request's log lines beside its id, and the gateway's unused body fields logged only for a caller the planner
answered, capped."""

from __future__ import annotations

import grpc
import httpx2 as httpx
import pytest
import pytest_asyncio
import structlog
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from executor_svc.config import ExecutorConfig
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig
from planner_svc.metrics import PlannerMetrics
from protos.auth import parse_keys
from protos.rpc import ChannelSecurity, ServerSecurity
from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

ALICE, SERVICE = "alice-accounting-key-0123456789", "service-accounting-key-0123456789"
WRONG = "wrong-accounting-key-0123456789"
SHORT = GenerateOptions(text="Hi", max_tokens=2)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed():
    from gateway_svc.http_server import start_gateway

    stack, servers = await start_stack(
        ExecutorConfig(device="cpu", pool_pages=8, buckets=(1, 2), max_seq_len=512),
        PlannerConfig(),
        ServerSecurity(keys=parse_keys(f"{ALICE} alice\n{SERVICE} *\n")),
    )
    registry = CollectorRegistry()
    stack.planner.metrics = PlannerMetrics(registry)
    gateway = await start_gateway(stack.addr)
    yield stack, registry, f"http://127.0.0.1:{gateway.port}/v1"
    await gateway.stop()
    await stop_stack(servers)


def refused(registry: CollectorRegistry, code: str) -> float | None:
    return registry.get_sample_value("deltaserve_requests_refused_total", {"code": code})


async def _refusal(planner: PlannerClient, options: GenerateOptions, key: str | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await planner.generate_all(options, key)
    return caught.value.code()


async def test_refusals_before_admission_are_counted_by_code(keyed, monkeypatch):
    """None of these reached `ended` (it counts admitted requests): they left no metric at all."""
    stack, registry, _ = keyed
    codes_counted = ("RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "INVALID_ARGUMENT", "PERMISSION_DENIED")
    before = {code: refused(registry, code) or 0.0 for code in codes_counted}
    finished_before = registry.get_sample_value("deltaserve_requests_finished_total", {"reason": "error"})
    async with PlannerClient(stack.addr) as planner:
        codes = [
            await _refusal(planner, GenerateOptions(text="Hi", max_tokens=300), ALICE),  # never fits: 7 pages
            await _refusal(planner, GenerateOptions(text="Hi", max_tokens=2, temperature=-1), ALICE),
            await _refusal(planner, GenerateOptions(text="Hi", max_tokens=2, tenant="bob"), ALICE),
            await _refusal(planner, SHORT, WRONG),  # the interceptor's: Generate never runs
            await _refusal(planner, SHORT, None),
        ]
        monkeypatch.setattr(stack.planner, "max_waiting", 0)  # the waiting queue full
        codes.append(await _refusal(planner, SHORT, ALICE))
        monkeypatch.undo()
        with pytest.raises(grpc.aio.AioRpcError):  # another method's refusal: not a request
            await planner.abort("nothing", key=WRONG)
        await planner.generate_all(SHORT, ALICE)  # admitted: not refused
    S = grpc.StatusCode
    assert codes == [
        S.RESOURCE_EXHAUSTED,
        S.INVALID_ARGUMENT,
        S.PERMISSION_DENIED,
        S.UNAUTHENTICATED,
        S.UNAUTHENTICATED,
        S.RESOURCE_EXHAUSTED,
    ]
    grew = {code: (refused(registry, code) or 0.0) - counted for code, counted in before.items()}
    assert grew == {
        "RESOURCE_EXHAUSTED": 2,
        "UNAUTHENTICATED": 2,
        "INVALID_ARGUMENT": 1,
        "PERMISSION_DENIED": 1,
    }
    assert refused(registry, "UNAVAILABLE") == 0  # labelled before any refusal
    error = registry.get_sample_value("deltaserve_requests_finished_total", {"reason": "error"})
    assert error == finished_before
    await stack.wait_idle()


async def test_a_refused_key_is_a_warning_without_the_key_once_a_while(keyed, monkeypatch):
    from planner_svc import refusals

    stack, *_ = keyed
    monkeypatch.setattr(stack.planner.refusals, "said_at", None)
    monkeypatch.setattr(stack.planner.refusals, "keys_refused", 0)
    with capture_logs() as logs:
        async with PlannerClient(stack.addr) as planner:
            for _ in range(5):
                await _refusal(planner, SHORT, WRONG)
            await _refusal(planner, GenerateOptions(text="Hi", max_tokens=2, tenant="bob"), ALICE)
            monkeypatch.setattr(refusals, "KEY_WARNING_S", 0.0)  # the next one is said, with the count since
            await _refusal(planner, SHORT, None)
    warned = [line for line in logs if line["event"] == "API key refused"]
    assert [(w["log_level"], w["code"], w["refused"]) for w in warned] == [
        ("warning", "UNAUTHENTICATED", 1),
        ("warning", "UNAUTHENTICATED", 6),  # 4 more unknown keys and alice naming bob, unsaid
    ]
    assert warned[0]["why"] == "unknown API key" and "no API key" in warned[1]["why"]
    assert WRONG not in repr(logs) and ALICE not in repr(logs)


async def test_a_requests_log_lines_carry_its_tenant(keyed):
    """Request ids are unique per tenant: two tenants' requests of one id were told apart by nothing."""
    stack, *_ = keyed
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        async with PlannerClient(stack.addr, ChannelSecurity(api_key=SERVICE)) as planner:
            for tenant in ("alice", "bob"):
                options = GenerateOptions(text="Hi", max_tokens=2, request_id="same-id", tenant=tenant)
                await planner.generate_all(options)
    queued = [(line["request_id"], line.get("tenant")) for line in logs if line["event"] == "request queued"]
    assert queued == [("same-id", "alice"), ("same-id", "bob")]
    assert structlog.contextvars.get_contextvars() == {}  # unbound with the request


async def test_unused_fields_are_logged_for_an_answered_caller_only_and_capped(keyed):
    """Logged before any check, the names of a body's unknown fields were the log's, as many and as long as an
    unauthenticated caller liked (a 1 MB body: 1 MB more log)."""
    _, _, base = keyed
    extra = {f"field_{i:02d}_" + "x" * 200: 1 for i in range(20)}
    async with httpx.AsyncClient(timeout=120) as http:
        model = (await http.get(f"{base}/models", headers={"authorization": f"Bearer {ALICE}"})).json()
        body = {"model": model["data"][0]["id"], "prompt": "Hi", "max_tokens": 2, **extra}
        with capture_logs() as logs:
            for stream in (False, True):
                wrong = await http.post(
                    f"{base}/completions",
                    json=body | {"stream": stream},
                    headers={"authorization": f"Bearer {WRONG}"},
                )
                assert wrong.status_code == 401
        assert [line for line in logs if line["event"] == "fields not used"] == []
        for stream in (False, True):
            with capture_logs() as logs:
                answer = await http.post(
                    f"{base}/completions",
                    json=body | {"stream": stream},
                    headers={"authorization": f"Bearer {ALICE}"},
                )
                assert answer.status_code == 200, answer.text
            [line] = [line for line in logs if line["event"] == "fields not used"]
            assert line["count"] == 20 and len(line["fields"]) == 8
            assert line["fields"][0] == ("field_00_" + "x" * 200)[:64]
            assert all(len(name) == 64 for name in line["fields"])
