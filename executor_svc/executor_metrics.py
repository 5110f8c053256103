"""The executor's Prometheus metrics, read from what the runner already sums (RunnerTimes) when scraped:
nothing is added to a step's path."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import SummaryMetricFamily
from prometheus_client.registry import Collector


class _StepTimes(Collector):
    def __init__(self, runner) -> None:
        self.runner = runner

    def collect(self):
        t = self.runner.times  # summed by the step thread; read whole here, a step's worth out at most
        host_us = t.apply_us + t.prefill_us + t.plan_us + t.launch_us + t.sync_us
        yield SummaryMetricFamily(
            "deltaserve_executor_step_seconds",
            "host seconds of each decode step, from its plan's arrival to its tokens read back (apply, "
            "prefill launches, planning, graph launch, wait for the device)",
            count_value=t.steps,
            sum_value=host_us / 1e6,
        )


def register_executor_metrics(registry: CollectorRegistry, runner) -> None:
    registry.register(_StepTimes(runner))
