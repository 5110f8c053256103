"""The step launcher on the CPU: a stream's steps queue on the compute thread as their plans are read, in order,
and nothing runs after a launch that failed."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from executor_svc.plan import PlanError
from executor_svc.step_loop import StepLauncher, StepSkipped, collect_when_ready
from protos import executor_pb2
from tests.test_runner import scripted_plans, tiny_model, tiny_runner, without_timing


@pytest.fixture
def compute():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


def hold(compute: concurrent.futures.Executor) -> threading.Event:
    """Keeps the compute thread busy until the returned event is set."""
    release = threading.Event()
    compute.submit(release.wait, 30)
    return release


async def test_steps_queue_behind_the_running_one_in_order(compute):
    model = tiny_model()
    plans = scripted_plans([1, 2])
    reference = tiny_runner(model)
    expected = [reference.run(plan) for plan in plans]
    runner = tiny_runner(model)
    launcher = StepLauncher(runner, compute)
    release = hold(compute)
    # Every launch returns while the thread is still busy: none waits for the one before it to finish.
    launches = [await launcher.launch(plan) for plan in plans]
    assert not any(launch.done() for launch in launches)
    release.set()
    outputs = [await collect_when_ready(runner, await launch) for launch in launches]
    assert without_timing(outputs) == without_timing(expected)


async def test_nothing_runs_after_a_launch_that_failed(compute):
    runner = tiny_runner(tiny_model())
    plans = scripted_plans([1, 2])
    launcher = StepLauncher(runner, compute)
    release = hold(compute)
    bad = executor_pb2.StepPlan(seq=plans[1].seq, bucket=3)  # no bucket of 3
    launches = [await launcher.launch(plan) for plan in (plans[0], bad, plans[1])]
    release.set()
    assert (await launches[0]).seq == plans[0].seq
    with pytest.raises(PlanError, match="bucket"):
        await launches[1]
    with pytest.raises(StepSkipped, match=f"step {plans[1].seq} not run"):
        await launches[2]
    # The skipped plan changed nothing: it still runs as the script's next step.
    rows = runner.store.rows.clone()
    launcher.forget_launched()
    assert (runner.store.rows == rows).all()
    assert runner.run(plans[1]).seq == plans[1].seq
