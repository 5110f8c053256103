"""Each request's GenerateResponses from its token events: one choice's text, stop strings and logprobs
(choice_text.py), its last message with the finish and what it reused; for n > 1 the choices merged."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from planner_svc.choice_text import ChoiceText
from planner_svc.choices import merged, other_choices, prompt_read
from planner_svc.conversations import Mount
from planner_svc.engine import Engine
from planner_svc.requests import Finish, Request
from planner_svc.streaming import TokenEvent
from planner_svc.waiting_room import Held
from protos import client_pb2
from protos.wire import pack_i32

log = structlog.get_logger("deltaserve.planner")

_FINISH = {
    Finish.STOP: client_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: client_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: client_pb2.FINISH_REASON_ABORT,
}


class ResponseStreams:
    def __init__(self, tokenizer, cut: dict[tuple[str, str], str]) -> None:
        self.tokenizer = tokenizer
        self.cut = cut  # (tenant, request id) -> why a drain cut it: the stream ends UNAVAILABLE with it

    async def choices(
        self,
        first: Request,
        engine: Engine,
        queue: asyncio.Queue[TokenEvent],
        context: grpc.aio.ServicerContext,
        n: int,
        held: Held,
    ):
        """The n choices of a request, merged; the others start once the first has read the prompt (unless it
        was aborted meanwhile), and join `first.choices` as they do (what an Abort ends besides the first).
        `held` counts them against --max-waiting until they are queued."""

        async def later(other: Request):
            await prompt_read(first)
            if first.finish is Finish.ABORT:
                held.let_go()  # never to be queued
                return
            other.queue_tag = first.queue_tag  # as it is now: an abort ahead of the first may have moved it
            other_queue = engine.submit(other)
            held.let_go()  # counted by the scheduler's waiting queue from here
            first.choices.append(other)
            # each choice reports the request's seed (what repeats it), not its own seed + i
            async for response in self.one(other, engine, other_queue, context, Mount(), first.sampling.seed):
                yield response

        streams = [self.one(first, engine, queue, context, Mount())]
        streams += [later(other) for other in other_choices(first, n)]
        try:
            async for response in merged(streams):
                yield response
        finally:
            for other in first.choices:
                if other.finish is None:
                    engine.abort(other)

    async def one(
        self,
        req: Request,
        engine: Engine,
        queue: asyncio.Queue[TokenEvent],
        context: grpc.aio.ServicerContext,
        mount: Mount,
        seed: int | None = None,
    ):
        """One choice's responses from its token events: text, stop strings, logprobs; the last with its finish
        and what it reused. The first and the last carry the request's `seed` (default: the choice's own)."""
        seed = req.sampling.seed if seed is None else seed
        choice = ChoiceText(self.tokenizer, req.stop_strings, req.min_tokens, req.sampling.top_logprobs)
        first = True
        while True:
            event = await queue.get()
            while event.finish is None and not queue.empty():  # join what piled up into one message
                event.join(queue.get_nowait())
            if event.error is not None:
                await context.abort(grpc.StatusCode[event.code], event.error)
            piece = choice.add(event.token_ids, event.logprobs)
            finish, text = event.finish, piece.text
            if piece.stop_string is not None:  # ends the request now: its pages free at the match
                engine.abort(req, Finish.STOP)
                finish = Finish.STOP
            elif finish is not None:
                text += choice.flush()
            response = client_pb2.GenerateResponse(
                request_id=req.request_id,
                token_ids=pack_i32(piece.token_ids),
                text=text,
                stop_string=piece.stop_string or "",
                logprobs=piece.logprobs,
            )
            if first:
                response.prompt_tokens = req.prompt_len
                response.seed = seed
                response.begins_in_thought = req.begins_in_thought
                first = False
            if finish is Finish.ABORT and (req.tenant, req.request_id) in self.cut:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.cut.pop((req.tenant, req.request_id)))
            if finish is not None:
                response.finish_reason = _FINISH[finish]
                response.prompt_tokens = req.prompt_len
                response.seed = seed
                response.reused_tokens = req.reused
                response.read_tokens = req.prompt_len - req.reused
                response.checkpoint = _mounted(req, mount)
                response.diverged_at = mount.diverged_at
                if req.pin_asked and req.conversation is not None:
                    response.pinned_prefix, response.pin_note = await _pin_report(engine, req)
                log.info(
                    "request finished",
                    finish=finish.value,
                    tokens=len(req.output_ids),
                    reused=req.reused,
                    checkpoint=response.checkpoint,
                )
                yield response
                return
            yield response


async def _pin_report(engine: Engine, req: Request) -> tuple[int, str]:
    """The pin the turn's conversation kept and why not the one asked for, settled at the turn's end: when its
    pages go back, which may be a step after its last token (a stop the planner could not foresee). Every end
    of a request releases it: a commit, an abort, or a recovery (the step watchdog bounds the wait)."""
    await engine.released(req)
    conversation = req.conversation
    assert conversation is not None
    if req.pin_kept and conversation.lost and conversation.retention.pinned != req.pin_kept:
        # an executor lost since the turn ended: the conversation forgot its KV, the pin with it
        return 0, f"the conversation's KV went with its executor after the turn: {conversation.lost}"
    return req.pin_kept, req.pin_note


def _mounted(req: Request, mount: Mount) -> str:
    """What the request reused: its conversation's checkpoint, else shared prefix pages, and why not."""
    if req.reused < mount.reused:  # its mount given back under KV pressure (or the executor lost)
        return f"none ({mount.checkpoint} given up: the prompt was read again)"
    if mount.reused or not req.reused:
        return mount.checkpoint
    return "prefix" if mount.checkpoint == "none" else f"prefix, {mount.checkpoint}"
