"""A layer split's stages kept in step through faults, each stage its own process (gloo) on a tiny random model:
a stage that refuses a park still takes part in its transfer (the first stage answers at once instead of waiting
on it), and a stage that stalls mid-step and resumes never streams wrong tokens."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from cache_svc.server import start_cache_server
from planner_svc.client import GenerateOptions, PlannerClient
from protos import executor_pb2, executor_pb2_grpc
from protos.wire import pack_i32
from tests.split_stages import StageGroup, start_group_planner
from tests.test_faults_layer_split import RANGES, TINY_STAGE_FLAGS, _exited, tiny_checkpoint, until

pytestmark = pytest.mark.asyncio(loop_scope="session")

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
        tmp_path,
        RANGES,
        f"127.0.0.1:{cache.port}",
        flags=("--model", model, *TINY_STAGE_FLAGS),
        without_cache=(1,),
    )
    try:
        group.wait_listening()
        for _ in range(2):  # the second: the first park's transfers left the group in step
            first, later = await asyncio.gather(*(_park(address) for address in group.addresses))
            assert later == grpc.StatusCode.FAILED_PRECONDITION
            assert first == grpc.StatusCode.INTERNAL  # "stages [1] could not read their pages"
        assert [stage.process.poll() for stage in group.stages] == [None, None]
        # And a planner refuses to attach to such a group, saying why.
        with pytest.raises(ValueError, match=r"stage 1 has no cache service \(no --cache\), stage 0 a cache"):
            await start_group_planner(group.addresses, f"127.0.0.1:{cache.port}")
    finally:
        group.stop()
        await cache.stop(None)


async def test_stages_of_two_groups_listed_as_one_are_refused(tmp_path):
    """Two groups' stages cross-wired (A's first with B's last): each would take the other group's hidden
    states, and one request get another's continuation. The stages name the group they joined, and a planner
    refuses the mix, saying so."""
    flags = ("--model", tiny_checkpoint(tmp_path / "tiny", "llama3"), *TINY_STAGE_FLAGS)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    groups = [StageGroup(tmp_path / name, RANGES, flags=flags) for name in ("a", "b")]
    try:
        for group in groups:
            group.wait_listening()
        crossed = [groups[0].addresses[0], groups[1].addresses[1]]
        with pytest.raises(ValueError, match="stage 1 joined another torch.distributed group than stage 0"):
            await start_group_planner(crossed, None)
    finally:
        for group in groups:
            group.stop()


@pytest.mark.parametrize("prompt", [[5], [5, 9, 17, 3, 8, 2]])
async def test_a_stage_stalled_mid_step_then_resumed_loses_its_group_and_streams_no_wrong_token(
    tmp_path, prompt
):
    """Stage 1 frozen (SIGSTOP) while a request's first plan is sent, so stage 0 runs it and stage 1 never reads
    it: the planner times the group out as hung, re-queues the request and reconnects once stage 1 resumes. The
    stages are then a step apart: stage 1's first transfer names the step before its own, so it fails the group
    (both stages exit 3) and the request runs again, on the restarted group, to the same tokens. Without the
    steps named, stage 1 read stage 0's hidden states of that plan as its own: other tokens, 0 row mismatches
    (one token of prompt: the shapes agree), or gloo aborting stage 1 on the size (six) and a request that
    waited for a group that never came back."""
    flags = ("--model", tiny_checkpoint(tmp_path / "tiny", "llama3"), *TINY_STAGE_FLAGS)
    group = StageGroup(tmp_path, RANGES, flags=flags)
    planner = None
    try:
        group.wait_listening()
        stack, planner = await start_group_planner(group.addresses, executor_timeout=2.0)
        async with PlannerClient(stack.addr) as client:
            options = GenerateOptions(token_ids=prompt, max_tokens=12, ignore_eos=True)
            before = (await client.generate_all(options)).token_ids
            stalled = group.stages[1].process.pid
            os.kill(stalled, signal.SIGSTOP)
            request = asyncio.ensure_future(client.generate_all(options))
            await until(lambda: _lost(stack), 15, "the group timed out as hung")
            os.kill(stalled, signal.SIGCONT)
            waited = await until(lambda: _all_exited(group), 30, "both stages' exit")
            print(f"both stages exited {waited:.2f} s after SIGCONT")
            assert [stage.process.returncode for stage in group.stages] == [3, 3]
            assert not request.done()  # re-queued: nothing was streamed
            group.stop()
            group = StageGroup(tmp_path, RANGES, flags=flags, ports=group.ports)
            group.wait_listening()
            assert (await asyncio.wait_for(request, 60)).token_ids == before
            assert stack.engine.row_mismatches == 0
    finally:
        if planner is not None:
            await planner.stop(None)
        group.stop()


async def _lost(stack) -> bool:
    return stack.engine.losses > 0


async def _all_exited(group: StageGroup) -> bool:
    return all([await _exited(stage.process) for stage in group.stages])
