"""A layer split's stages kept in step through faults, each stage its own process (gloo) on a tiny random model:
a stage that refuses a park still takes part in its transfer (the first stage answers at once instead of waiting
on it), and a stage that stalls mid-step and resumes never streams wrong tokens."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cache_svc.server import start_cache_server
from protos import executor_pb2, executor_pb2_grpc
from protos.wire import pack_i32
from tests.split_stages import StageGroup
from tests.test_faults_layer_split import RANGES, tiny_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="session")

FLAGS = (
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--pool-pages",
    "64",
    "--buckets",
    "1,2,4",
    "--page-size",
    "4",
)
PARK_ANSWER_S = 20.0  # a park's answer, refused or not, well inside the transfers' timeout (120 s)


async def _park(address: str) -> grpc.StatusCode:
    """A park of 5 tokens on pages 1 and 2 straight to one stage, as the planner's group link sends it to each."""
    request = executor_pb2.ParkPagesRequest(
        conversation_id="chat", token_ids=pack_i32([5, 9, 11, 7, 3]), pages=pack_i32([1, 2])
    )
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await executor_pb2_grpc.ExecutorStub(channel).Park(request, timeout=PARK_ANSWER_S)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def test_a_stage_without_a_cache_refuses_a_park_and_leaves_no_stage_waiting(tmp_path):
    """Stage 1 has no --cache: it refuses each park (FAILED_PRECONDITION) and still sends the first stage its
    part (nothing), so the first stage fails the park at once; it used to wait in its receive for 30 min (the
    page group's default timeout), its page-copy thread, and every later park and restore, held up with it."""
    model = tiny_checkpoint(tmp_path / "tiny", "llama3")
    cache = await start_cache_server(str(tmp_path / "cache"), budget_bytes=1 << 30)
    group = StageGroup(
        tmp_path, RANGES, f"127.0.0.1:{cache.port}", flags=("--model", model, *FLAGS), without_cache=(1,)
    )
    try:
        group.wait_listening()
        for _ in range(2):  # the second: the first park's transfers left the group in step
            first, later = await asyncio.gather(*(_park(address) for address in group.addresses))
            assert later == grpc.StatusCode.FAILED_PRECONDITION
            assert first == grpc.StatusCode.INTERNAL  # "stages [1] could not read their pages"
        assert [stage.process.poll() for stage in group.stages] == [None, None]
    finally:
        group.stop()
        await cache.stop(None)
