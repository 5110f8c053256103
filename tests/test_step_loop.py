"""The step launcher on the CPU: a stream's steps queue on the compute thread as their plans are read, in
order, and nothing runs after a launch that failed."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator

import pytest

from executor_svc.plan import PlanError
from executor_svc.step_loop import StepLauncher, StepSkipped, collect_when_ready
from protos import executor_pb2
from tests.runner_script import scripted_plans, tiny_model, tiny_runner, without_timing


@pytest.fixture
def compute():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


@contextlib.contextmanager
def held(compute: concurrent.futures.Executor) -> Iterator[None]:
    """The compute thread kept busy until the block ends."""
    release = threading.Event()
    compute.submit(release.wait, 30)
    try:
        yield
    finally:
        release.set()


async def test_steps_queue_behind_the_running_one_in_order(compute):
    model = tiny_model()
    plans = scripted_plans([1, 2])
    reference = tiny_runner(model)
    expected = [reference.run(plan) for plan in plans]
    runner = tiny_runner(model)
    launcher = StepLauncher(runner, compute)
    with held(compute):
        # Every launch returns while the thread is still busy: none waits for the one before it to finish.
        launches = [await launcher.launch(plan) for plan in plans]
        assert not any(launch.done() for launch in launches)
    outputs = [await collect_when_ready(runner, await launch) for launch in launches]
    assert without_timing(outputs) == without_timing(expected)


async def test_nothing_runs_after_a_launch_that_failed(compute):
    model = tiny_model()
    plans = scripted_plans([1, 2])
    reference = tiny_runner(model)
    expected = [reference.run(plan) for plan in plans[:3]]
    runner = tiny_runner(model)
    launcher = StepLauncher(runner, compute)
    bad = executor_pb2.StepPlan(seq=plans[1].seq, bucket=3)  # no bucket of 3
    with held(compute):
        launches = [await launcher.launch(plan) for plan in (plans[0], bad, plans[1])]
    assert (await launches[0]).seq == plans[0].seq
    with pytest.raises(PlanError, match="bucket"):
        await launches[1]
    with pytest.raises(StepSkipped, match=f"step {plans[1].seq} not run"):
        await launches[2]
    launcher.forget_launched()
    compute.submit(lambda: None).result()  # behind the forget
    # Neither the refused plan nor the one skipped changed anything: the script goes on as if they never came.
    outputs = [runner.run(plan) for plan in plans[1:3]]
    assert without_timing([expected[0], *outputs]) == without_timing(expected)
