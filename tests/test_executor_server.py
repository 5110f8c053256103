"""The executor's gRPC service in-process on port 0: Describe, pipelined Steps, refusals, health."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from executor_svc.server import SERVICE_NAME, start_executor_server
from planner_svc.link import GrpcLink, LinkLost, StepRefused
from protos import executor_pb2, executor_pb2_grpc
from protos.rpc import PLANNER_ID_METADATA
from protos.wire import pack_i32
from tests.runner_script import scripted_plans, tiny_model, tiny_runner, without_timing

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest_asyncio.fixture(loop_scope="session")
async def served(model):
    runner = tiny_runner(model)
    server = await start_executor_server(runner, port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield runner, channel, f"127.0.0.1:{server.port}"
    await channel.close()
    await server.stop(None)


async def test_describe(served):
    runner, channel, _ = served
    described = await executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest())
    assert described == runner.describe()
    assert described.model_name == "tiny-llama"


async def test_pipelined_plans_get_their_outputs_in_order(served, model):
    _, channel, _ = served
    plans = scripted_plans([2, 0, 1, 0])
    direct = tiny_runner(model)
    expected = [direct.run(plan) for plan in plans]

    call = executor_pb2_grpc.ExecutorStub(channel).Steps()
    for plan in plans[:3]:  # three written before any output is read
        await call.write(plan)
    outputs = [await call.read() for _ in range(3)]
    for plan in plans[3:]:  # then one in, one out
        await call.write(plan)
        outputs.append(await call.read())
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert [o.seq for o in outputs] == [p.seq for p in plans]
    assert without_timing(outputs) == without_timing(expected)
    assert await call.code() == grpc.StatusCode.OK


async def test_a_bad_plan_ends_the_stream_with_invalid_argument(served):
    runner, channel, _ = served
    stub = executor_pb2_grpc.ExecutorStub(channel)
    plans = scripted_plans([1, 2])
    call = stub.Steps()
    await call.write(plans[0])
    assert (await call.read()).seq == plans[0].seq
    rows = runner.store.rows.clone()
    await call.write(executor_pb2.StepPlan(seq=2, bucket=2, slots=pack_i32([1, 11])))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call.read()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "slot 11 is outside [0, 9)" in refused.value.details()
    assert (runner.store.rows == rows).all()

    # A new stream picks up where the good plans left off.
    call = stub.Steps()
    for plan in plans[1:3]:
        await call.write(plan)
    assert [(await call.read()).seq for _ in range(2)] == [p.seq for p in plans[1:3]]
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_a_new_stream_holds_no_decode_step_of_the_last(served):
    """A stream starts from zero tables, as after a restart: a bare steady plan first is refused there as it
    is by a fresh executor, not run over zeroed rows with the last stream's slots."""
    runner, channel, _ = served
    stub = executor_pb2_grpc.ExecutorStub(channel)
    call = stub.Steps()
    for plan in scripted_plans([1, 2])[:4]:  # the prompts, then decode steps of bucket 2
        await call.write(plan)
        await call.read()
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    call = stub.Steps()
    await call.write(executor_pb2.StepPlan(seq=1, bucket=2))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call.read()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "differs from the rows held (no decode step yet)" in refused.value.details()
    assert runner.store.bucket == 0 and not runner.store.step_slots.any()


async def test_a_second_stream_is_refused_while_one_is_open(served):
    _, channel, _ = served
    stub = executor_pb2_grpc.ExecutorStub(channel)
    first = stub.Steps()
    await first.write(scripted_plans([1])[0])
    await first.read()  # the first stream is open on the server now
    second = stub.Steps()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await second.read()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await first.done_writing()
    assert await first.code() == grpc.StatusCode.OK


async def test_health_says_serving_and_reflection_lists_the_services(served):
    _, channel, _ = served
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listed = {s.name for s in (await call.read()).list_services_response.service}
    await call.done_writing()
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= listed


async def test_a_newer_stream_of_the_same_planner_replaces_a_stale_one(served, model):
    """The planner gave up on a stream whose cancel never reached the executor (after a hang, say): its newer
    stream (GrpcLink sends the planner's id) takes over from zero tables, the stale one ends ABORTED; a
    stream of another planner, or of none named, is still refused."""
    _, channel, address = served
    plans = scripted_plans([1, 2])
    direct = tiny_runner(model)
    expected = without_timing([direct.run(plan) for plan in plans[:3]])
    stale, newer = GrpcLink(address), GrpcLink(address)  # two links of one planner process
    try:
        await stale.open()
        await stale.send(plans[0])
        await stale.recv()
        await newer.open()
        for plan in plans[1:3]:  # the first decode step writes its rows whole
            await newer.send(plan)
        assert without_timing([await newer.recv() for _ in range(2)]) == expected[1:]
        with pytest.raises(LinkLost, match="ABORTED: a newer Steps stream of the same planner replaced"):
            await stale.recv()
        stub = executor_pb2_grpc.ExecutorStub(channel)
        for metadata in (((PLANNER_ID_METADATA, "another-planner"),), ()):
            other = stub.Steps(metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await other.read()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "another Steps stream is already open, from another planner" in refused.value.details()
        await newer.send(plans[3])
        assert without_timing([await newer.recv()]) == without_timing([direct.run(plans[3])])
    finally:
        await stale.close()
        await newer.close()


async def test_a_refusal_reaches_the_planner_as_a_refusal_not_a_loss(served):
    """The planner writes its next plan as soon as it reads the output before a refused one: the executor ends
    the call only once that plan is read (a write racing the end fails in gRPC's core as INTERNAL, read as a
    lost executor), so the refusal comes on the next read. Once the call has ended, a write says so too."""
    _, _, address = served
    plans = scripted_plans([1, 2])
    bad = executor_pb2.StepPlan(seq=plans[1].seq, bucket=2, slots=pack_i32([1, 11]))
    link = GrpcLink(address)
    await link.open()
    try:
        for _ in range(3):  # the race was lost ~99% of the time
            await link.send(plans[0])
            await link.send(bad)
            assert (await link.recv()).seq == plans[0].seq  # the step before it ran
            await link.send(plans[2])  # at once, as the engine does
            with pytest.raises(StepRefused, match="slot 11 is outside"):
                await link.recv()
            await link.open()
        await link.send(plans[0])
        await link.send(bad)
        assert (await link.recv()).seq == plans[0].seq
        assert "INVALID_ARGUMENT" in await link.until_ended()  # after the grace: no plan came
        with pytest.raises(StepRefused, match="slot 11 is outside"):
            await link.send(plans[2])
    finally:
        await link.close()
