"""A runner's steps driven from the event loop: launched inline on a GPU or queued on the compute thread on
the CPU, collected by polling their read-back event between turns of the loop."""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import Executor

from executor_svc.launched_step import LaunchedStep
from executor_svc.runner import StepRunner
from protos import executor_pb2


class StepSkipped(Exception):
    """A step queued behind one whose launch failed: it never ran."""


class StepLauncher:
    """Launches one stream's plans in the order they are read. On a GPU the launch only queues work, inline
    here: a hop to another thread costs more than the launch. On the CPU the step computes as it launches, so
    it runs on `compute` (one thread, steps in order) and the loop stays free meanwhile; so does a stage of a
    layer split, whose transfers with the stages beside it block. A CPU step is queued as soon as its plan is
    read, behind the step running: the thread goes from one step to the next without waiting for the loop to
    hand it the next plan (that hand-over left the cores idle ~3 ms of a 16 ms token on two cores, measured).
    Once a launch fails, those queued behind it raise StepSkipped: nothing runs after a refused plan. A plan's
    new grammars are compiled first, on their own thread, the loop collecting earlier steps meanwhile."""

    def __init__(self, runner: StepRunner, compute: Executor) -> None:
        self._runner = runner
        self._compute = compute
        self._inline = runner.device.type == "cuda" and not runner.model.stage.split
        self._order = asyncio.Lock()  # launches queue in the order launch() is called, grammar waits or not
        self._failed = False  # on the thread that launches
        self._stopped = False  # on the loop: a grammar failed to compile, nothing behind it launches

    async def launch(self, plan: executor_pb2.StepPlan) -> asyncio.Future[LaunchedStep]:
        """The plan's launch: its step, or the exception its launch raised, once it has launched."""
        async with self._order:
            if self._stopped:
                return failed_launch(StepSkipped(f"step {plan.seq} not run: a grammar before it failed"))
            if plan.control_grammar:
                try:
                    await self._runner.grammars.before_launch(plan)
                except BaseException:
                    self._stopped = True
                    raise
            if not self._inline:
                queued = asyncio.get_running_loop().run_in_executor(self._compute, self._launch, plan)
                queued.add_done_callback(_retrieved)
                return queued
            try:
                return _succeeded_launch(self._launch(plan))
            except Exception as err:
                return failed_launch(err)

    def forget_launched(self) -> None:
        """The stream ended: its launched steps will never be collected. Behind the CPU steps still queued."""
        if self._inline:
            self._runner.forget_launched()
        else:
            self._compute.submit(self._runner.forget_launched)

    def _launch(self, plan: executor_pb2.StepPlan) -> LaunchedStep:
        if self._failed:
            raise StepSkipped(f"step {plan.seq} not run: a step before it failed to launch")
        try:
            return self._runner.launch(plan)
        except BaseException:
            self._failed = True
            raise


def _succeeded_launch(step: LaunchedStep) -> asyncio.Future[LaunchedStep]:
    launched: asyncio.Future[LaunchedStep] = asyncio.get_running_loop().create_future()
    launched.set_result(step)
    return launched


def failed_launch(error: BaseException) -> asyncio.Future[LaunchedStep]:
    """A launch that raised `error`, as a future; seen or not, it logs nothing when dropped."""
    launched: asyncio.Future[LaunchedStep] = asyncio.get_running_loop().create_future()
    launched.set_exception(error)
    launched.add_done_callback(_retrieved)
    return launched


def _retrieved(launch: asyncio.Future[LaunchedStep]) -> None:
    """Marks a launch's exception seen: the steps queued behind a failure, or behind the end of their stream,
    are never awaited, and asyncio would log each as an exception never retrieved."""
    if not launch.cancelled():
        launch.exception()


# While the loop polls it holds the GIL but for its instants in epoll, and a thread waiting for the GIL (gRPC's
# poller, bringing the next plan) only forces a switch after the switch interval: 5 ms by default.
POLLING_SWITCH_INTERVAL_S = 50e-6


async def collect_when_ready(runner: StepRunner, step: LaunchedStep) -> executor_pb2.StepOutput:
    """A launched step's output once its tokens are back. The wait polls the step's event between turns of
    the event loop, so the loop keeps reading and launching the next plans meanwhile; a thread that blocked
    on the event would cost a hop back to the loop (60-110 µs measured on the H200's host) on every step."""
    if step.done is not None:
        if sys.getswitchinterval() > POLLING_SWITCH_INTERVAL_S:
            sys.setswitchinterval(POLLING_SWITCH_INTERVAL_S)
        while not step.done.query():
            await asyncio.sleep(0)
    return runner.collect(step)
