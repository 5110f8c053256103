"""The planner's link to a group of executors that split one model's layers: one executor to the engine.

Every stage gets the same plan and applies it the same way (slots, pages and rows are the planner's choice), so
their tables stay in step without talking; the hidden states pass stage to stage over torch.distributed, and
the last stage's output carries the tokens. A stage lost is the group lost: its stream's end ends the group's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from planner_svc.link import ExecutorLink, GrpcLink, LinkLost
from protos import executor_pb2
from protos.layer_split import check_stages
from protos.rpc import ChannelSecurity

T = TypeVar("T")

# Fields every stage must describe alike: the rows, the pages' shape, the model, the recurrent-state slots.
SHARED_FIELDS = (
    "model_fingerprint",
    "vocab_size",
    "max_seq_len",
    "num_layers",
    "page_size",
    "buckets",
    "slots",
    "row_columns",
    "block_span",
    "dtype",
    "state_slots",
)


def differences(
    first: executor_pb2.ExecutorDescription, other: executor_pb2.ExecutorDescription, names: Sequence[str]
) -> list[str]:
    """'name first -> other' for each of `names` the two describe apart."""
    return [
        f"{name} {getattr(first, name)!r} -> {getattr(other, name)!r}"
        for name in names
        if getattr(first, name) != getattr(other, name)
    ]


def describe_group(stages: Sequence[executor_pb2.ExecutorDescription]) -> executor_pb2.ExecutorDescription:
    """The group as one executor: the stages must agree on SHARED_FIELDS and hold [0, num_layers) in rank
    order; the pool is the smallest stage's (a page number is valid on every stage); the end-of-sequence
    token is the last stage's (it samples). ValueError saying what differs otherwise."""
    first = stages[0]
    for rank, stage in enumerate(stages[1:], start=1):
        if stage.stage_group != first.stage_group:
            raise ValueError(
                f"stage {rank} joined another torch.distributed group than stage 0 (stage_group "
                f"{stage.stage_group!r}, not {first.stage_group!r}): list the stages of one group together"
            )
        if stage.snapshots != first.snapshots:  # a park gathers every stage's pages: one without fails it
            has = {True: "a cache service (--cache)", False: "no cache service (no --cache)"}
            raise ValueError(
                f"stage {rank} has {has[stage.snapshots]}, stage 0 {has[first.snapshots]}: every stage of a "
                "group parks its own pages, so every stage needs one or none"
            )
        for name in SHARED_FIELDS:
            if getattr(stage, name) != getattr(first, name):
                raise ValueError(
                    f"stage {rank} has {name} {getattr(stage, name)!r}, stage 0 {getattr(first, name)!r}"
                )
    check_stages([(s.layer_begin, s.layer_end) for s in stages], first.num_layers)
    group = executor_pb2.ExecutorDescription()
    group.CopyFrom(stages[-1])
    group.pool_pages = min(s.pool_pages for s in stages)
    group.layer_begin, group.layer_end = 0, first.num_layers
    group.device = ",".join(s.device for s in stages)
    return group


def merge_outputs(outputs: Sequence[executor_pb2.StepOutput]) -> executor_pb2.StepOutput:
    """One step's outputs of every stage as the group's: the last stage's (its tokens, log-probabilities),
    every stage's row-check mismatches, the longest device wait."""
    seqs = {o.seq for o in outputs}
    if len(seqs) != 1:
        raise LinkLost(f"the stages answered different steps {sorted(seqs)}: the group is out of step")
    merged = executor_pb2.StepOutput()
    merged.CopyFrom(outputs[-1])  # the tokens, and what else the sampler wrote (log-probabilities)
    merged.row_mismatches = sum(o.row_mismatches for o in outputs)
    merged.device_wait_us = max(o.device_wait_us for o in outputs)
    return merged


async def _all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Every stage's answer; the first failure raises once all have ended (a restore still writing pages on
    one stage must not outlive the group's answer: the planner frees them)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


async def _all_or_fail_fast(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Every stage's answer; the first failure raises at once and cancels the rest (a step stream lost on
    one stage is the group's: the others may never answer)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


class GroupLink:
    """An ExecutorLink over the stages of a layer split, in rank order (the first holds the embedding, the
    last the head). Parks run one at a time: the stages hand their pages to the first in that order."""

    def __init__(self, stages: Sequence[ExecutorLink]) -> None:
        if len(stages) < 2:
            raise ValueError("a stage group needs at least two executors")
        self.stages = list(stages)
        self.address = ",".join(s.address for s in stages)
        self._parks = asyncio.Lock()

    @classmethod
    def over(cls, addresses: Sequence[str], security: ChannelSecurity | None = None) -> GroupLink:
        return cls([GrpcLink(address, security) for address in addresses])

    async def describe(self) -> executor_pb2.ExecutorDescription:
        return describe_group(await _all_or_fail_fast([s.describe() for s in self.stages]))

    async def open(self) -> None:
        await _all([s.open() for s in self.stages])

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        await _all_or_fail_fast([s.send(plan) for s in self.stages])

    async def recv(self) -> executor_pb2.StepOutput:
        return merge_outputs(await _all_or_fail_fast([s.recv() for s in self.stages]))

    async def until_ended(self) -> str:
        """Once any stage's stream ends: that stage's reason (the group is lost with it)."""
        waits = [asyncio.ensure_future(s.until_ended()) for s in self.stages]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        rank = next(i for i, wait in enumerate(waits) if wait in done)
        return f"stage {rank} ({self.stages[rank].address}): {waits[rank].result()}"

    async def park(self, request: executor_pb2.ParkPagesRequest) -> executor_pb2.ParkPagesReply:
        async with self._parks:
            replies = await _all([s.park(request) for s in self.stages])
        return replies[0]  # the first stage put the snapshot: its size is the whole's

    async def restore(self, request: executor_pb2.RestorePagesRequest) -> executor_pb2.RestorePagesReply:
        """Each stage reads its own layers of the snapshot (a refusal by any, its restore guard's included,
        refuses the group's restore: the planner frees the pages)."""
        return (await _all([s.restore(request) for s in self.stages]))[0]

    async def prepare_grammar(self, grammar: executor_pb2.Grammar) -> None:
        await _all([s.prepare_grammar(grammar) for s in self.stages])

    async def close(self) -> None:
        await _all([s.close() for s in self.stages])
