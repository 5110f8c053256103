"""A per-step timeline of bench/decode.py's rounds (`--timeline PATH`): when the planner sent each plan and
received its output, when the executor launched it (host time) and when the GPU ran it (CUDA events around the
launch), joined by step. Every time is perf_counter's clock (CLOCK_MONOTONIC, the same in every process of the
machine); the GPU's are placed on it from a reference event recorded on an idle GPU.

What a round's summary says:
- `prefill_done_ms`: when the GPU finished the last step that read prompts, from the round's first GPU work;
- `prefill_launch_ms`: the host time of each prefill step's launch (a GPU with nothing queued waits that long);
- `gpu_gap_ms`: the GPU's idle time between steps, before and after the last prefill step;
- `output_to_commit_ms`: from the executor handing a step's output to gRPC to the planner receiving it (the wire,
  and the planner's event loop busy elsewhere), median and largest;
- `clients_ms`: the round's wall outside the steps, from the clients' first request to the planner's first plan
  (the request's way in, intake and admission included) and from the planner's last output received to the
  clients' last token (the clients' clock is the same).
"""

from __future__ import annotations

import statistics
import time

import torch

from executor_svc.launched_step import LaunchedStep
from executor_svc.runner import StepRunner
from protos import executor_pb2


class ExecutorTimeline:
    """Notes each launch of `runner` (host times and two CUDA events around it) and its collection. Wraps the
    runner's own launch and collect, on the instance: the executor's server calls them as it always does."""

    def __init__(self, runner: StepRunner) -> None:
        self._cuda = runner.device.type == "cuda"
        self._records: list[dict] = []
        self._events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        if self._cuda:
            torch.cuda.synchronize(runner.device)
            self._reference = torch.cuda.Event(enable_timing=True)
            self._reference.record()
            self._reference_at = time.perf_counter()
        launch, collect = runner.launch, runner.collect

        def timed_launch(plan: executor_pb2.StepPlan) -> LaunchedStep:
            began = time.perf_counter()
            before = after = None
            if self._cuda:
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record()
            step = launch(plan)
            if before is not None and after is not None:
                after.record()
                self._events[plan.seq] = (before, after)
            self._records.append(
                {
                    "seq": plan.seq,
                    "prefill_chunks": len(plan.prefill),
                    "bucket": plan.bucket,
                    "launch": [began, time.perf_counter()],
                }
            )
            return step

        def timed_collect(step: LaunchedStep) -> executor_pb2.StepOutput:
            output = collect(step)
            for record in reversed(self._records):
                if record["seq"] == step.seq:
                    record["collected"] = time.perf_counter()
                    break
            return output

        runner.launch = timed_launch  # type: ignore[method-assign]
        runner.collect = timed_collect  # type: ignore[method-assign]

    def take(self) -> list[dict]:
        """The steps noted since the last take, their GPU spans placed on the host clock (each step has run)."""
        records, self._records = self._records, []
        for record in records:
            events = self._events.pop(record["seq"], None)
            if events is not None:
                events[1].synchronize()
                record["gpu"] = [
                    self._reference_at + self._reference.elapsed_time(event) / 1e3 for event in events
                ]
        return records


class PlannerTimeline:
    """What the planner's link sent and received, by step (RecordingLink calls sent and received)."""

    def __init__(self) -> None:
        self._records: dict[int, dict] = {}

    def sent(self, plan: executor_pb2.StepPlan) -> None:
        self._records[plan.seq] = {
            "seq": plan.seq,
            "prefill_tokens": sum(len(chunk.token_ids) // 4 for chunk in plan.prefill),
            "sent": time.perf_counter(),
        }

    def received(self, output: executor_pb2.StepOutput) -> None:
        if output.seq in self._records:
            self._records[output.seq]["received"] = time.perf_counter()

    def take(self) -> list[dict]:
        records, self._records = list(self._records.values()), {}
        return records


def joined(planner: list[dict], executor: list[dict]) -> list[dict]:
    """One record a step, in step order: the planner's and the executor's notes of it."""
    by_seq = {record["seq"]: dict(record) for record in planner}
    for record in executor:
        by_seq.setdefault(record["seq"], {"seq": record["seq"]}).update(record)
    return [by_seq[seq] for seq in sorted(by_seq)]


def summary(steps: list[dict], requests: tuple[float, float] | None = None) -> dict:
    """The round's figures (the module's docstring says what each is), in milliseconds; those of the GPU's spans
    only where there are spans (CUDA). `requests`: when the clients sent their first request and got their last
    token."""
    prefills = [step for step in steps if step.get("prefill_chunks")]
    wire = sorted(
        step["received"] - step["collected"] for step in steps if "received" in step and "collected" in step
    )
    figures: dict = {
        "prefill_steps": len(prefills),
        "prefill_launch_ms": [
            round((s["launch"][1] - s["launch"][0]) * 1e3, 2) for s in prefills if "launch" in s
        ],
        "output_to_commit_ms": (
            {"p50": round(statistics.median(wire) * 1e3, 3), "max": round(wire[-1] * 1e3, 3)}
            if wire
            else None
        ),
    }
    sent = [step["sent"] for step in steps if "sent" in step]
    received = [step["received"] for step in steps if "received" in step]
    if requests is not None and sent and received:
        figures["clients_ms"] = {
            "before_first_plan": round((min(sent) - requests[0]) * 1e3, 2),
            "after_last_output": round((requests[1] - max(received)) * 1e3, 2),
        }
    ran = [step for step in steps if "gpu" in step]
    if not ran:
        return figures
    start = ran[0]["gpu"][0]
    prefill_end = max((step["gpu"][1] for step in ran if step.get("prefill_chunks")), default=start)
    gaps_before = gaps_after = 0.0
    for previous, step in zip(ran, ran[1:]):
        gap = max(step["gpu"][0] - previous["gpu"][1], 0.0)
        if step["gpu"][0] <= prefill_end:
            gaps_before += gap
        else:
            gaps_after += gap
    figures["prefill_done_ms"] = round((prefill_end - start) * 1e3, 2)
    figures["gpu_gap_ms"] = {
        "until_prefill_done": round(gaps_before * 1e3, 2),
        "after": round(gaps_after * 1e3, 2),
    }
    return figures


def in_ms(steps: list[dict]) -> list[dict]:
    """The steps with their times in milliseconds from the round's first (for the --timeline file)."""
    times = ("sent", "received", "collected")
    spans = ("launch", "gpu")
    origin = min(
        [step[key] for step in steps for key in times if key in step]
        + [step[key][0] for step in steps for key in spans if key in step],
        default=0.0,
    )
    ms = lambda t: round((t - origin) * 1e3, 3)  # noqa: E731
    return [
        {
            **step,
            **{key: ms(step[key]) for key in times if key in step},
            **{key: [ms(t) for t in step[key]] for key in spans if key in step},
        }
        for step in steps
    ]
