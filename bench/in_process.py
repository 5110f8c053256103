"""The planner's link to a runner in this process: the executor's own steps without the gRPC hop, the
benchmarks' baseline for it (bench/decode.py, bench/serve_cpu.py). No service uses it."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from typing import TYPE_CHECKING

from executor_svc.control_writes import grammar_text
from executor_svc.step_loop import StepLauncher, collect_when_ready
from planner_svc.link import LinkError
from protos import executor_pb2

if TYPE_CHECKING:
    from executor_svc.runner import StepRunner


class InProcessLink:
    """Launches plans from this process's event loop as the executor does (`StepLauncher`) and polls their
    outputs there: the executor's own steps without the gRPC hop (the benchmark's baseline for it)."""

    def __init__(self, runner: StepRunner) -> None:
        self.address = "in-process"
        self._runner = runner
        self._compute = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cpu-steps", initializer=runner.bind_thread
        )
        self._launcher = StepLauncher(runner, self._compute)
        self._launched: deque[asyncio.Task] = deque()  # each plan's launch, in order

    async def describe(self) -> executor_pb2.ExecutorDescription:
        return self._runner.describe()

    async def open(self) -> None:
        """A new stream, as the executor opens one (after a refusal, say): the last one's launches are dropped
        and none of its state carries over."""
        self._runner.bind_thread()
        for launch in self._launched:
            launch.cancel()
        self._launched.clear()
        self._launcher.forget_launched()
        self._launcher = StepLauncher(self._runner, self._compute)

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        # Runs at the loop's next turn, ahead of the stream writes this step releases.
        self._launched.append(asyncio.ensure_future(self._launcher.launch(plan)))

    async def recv(self) -> executor_pb2.StepOutput:
        return await collect_when_ready(self._runner, await (await self._launched.popleft()))

    async def until_ended(self) -> str:
        """A runner in this process does not go away: never returns."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        raise LinkError("the in-process link has no cache service: parking needs a gRPC executor")

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        raise LinkError("the in-process link has no cache service: restoring needs a gRPC executor")

    async def prepare_grammar(self, grammar: executor_pb2.Grammar) -> None:
        text = grammar_text(grammar)
        if text is not None:
            await self._runner.grammars.compile_ahead([text])

    async def close(self) -> None:
        for launch in self._launched:
            launch.cancel()
        self._launched.clear()
        self._runner.forget_launched()
        self._compute.shutdown(wait=True, cancel_futures=True)
