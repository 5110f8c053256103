"""A planned step on the wire (executor.proto's StepPlan), and what a log line says of one."""

from __future__ import annotations

from planner_svc.scheduler import PlannedStep
from protos import executor_pb2
from protos.wire import pack_i32


def to_proto(step: PlannedStep) -> executor_pb2.StepPlan:
    plan = executor_pb2.StepPlan(seq=step.seq, bucket=step.bucket, steps=step.steps if step.steps > 1 else 0)
    delta = step.delta
    if delta.slots:
        plan.slots = delta.slots
    if delta.row_runs:
        plan.row_runs = delta.row_runs
    if step.sampler is not None:
        for name, data in step.sampler.pack().items():
            if isinstance(data, bytes):
                setattr(plan, name, data)
            else:
                getattr(plan, name).extend(data)
    for chunk in step.prefill:
        plan.prefill.add(
            token_ids=chunk.token_ids,
            start=chunk.start,
            pages=chunk.pages,
            sample_slot=chunk.sample_slot,
            state_slot=chunk.state_slot,
        )
    plan.mirror = step.mirror  # empty: unset
    plan.state_copies = pack_i32(step.state_copies)
    return plan


def plan_summary(plan: executor_pb2.StepPlan) -> dict[str, int]:
    """What a log line says about a plan: its numbers and sizes, not its bytes."""
    return {
        "seq": plan.seq,
        "bucket": plan.bucket,
        "slots_bytes": len(plan.slots),
        "row_runs_bytes": len(plan.row_runs),
        "sampler_slots_bytes": len(plan.sampler_slots),
        "prefill_chunks": len(plan.prefill),
        "prefill_tokens": sum(len(chunk.token_ids) // 4 for chunk in plan.prefill),
        "bytes": plan.ByteSize(),
    }
