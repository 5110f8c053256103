"""The client commands: generate, park, resume, conversations and delete against a planner; cache ls, rm,
stat."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from cache_svc.client import CacheClient
from deltaserve.aio import until_stopped
from deltaserve.logs import get_logger
from deltaserve.trust import client_security
from planner_svc.client import (
    FINISH_REASONS,
    Deleted,
    GenerateOptions,
    Generation,
    Parked,
    PlannerClient,
    Resumed,
)
from protos import client_pb2
from protos.wire import unpack_i32

EXIT_INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C
TTFT_SHOWN_S = 1.0  # `generate` prints the time to the first token when it is longer

T = TypeVar("T")
ConversationAnswer = TypeVar("ConversationAnswer", Parked, Resumed, Deleted)
log = get_logger("deltaserve.commands")


# ---- calls, errors, output ----


async def _call(
    work: Awaitable[T], stop: asyncio.Event, unreachable: Callable[[grpc.aio.AioRpcError], str | None]
) -> tuple[None, T] | tuple[int, None]:
    """(None, result) when the call finished; (exit code, None) when it failed (said on stderr) or was
    interrupted. `unreachable` words an error that means nothing answered, else None."""
    try:
        outcome = await until_stopped(work, stop)
    except grpc.aio.AioRpcError as error:
        print(unreachable(error) or f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1, None
    if not outcome[0]:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED, None
    return None, outcome[1]


def _planner_unreachable(client: PlannerClient) -> Callable[[grpc.aio.AioRpcError], str | None]:
    def word(error: grpc.aio.AioRpcError) -> str | None:
        # UNAVAILABLE from a planner that answered is its own (e.g. the cache behind it is down).
        if error.code() != grpc.StatusCode.UNAVAILABLE or client.connected():
            return None
        return (
            f"error: cannot reach the planner at {client.addr} (is it running? `deltaserve up` starts one)"
            f"\n  {error.details()}"
        )

    return word


def _cache_unreachable(addr: str) -> Callable[[grpc.aio.AioRpcError], str | None]:
    def word(error: grpc.aio.AioRpcError) -> str | None:
        if error.code() != grpc.StatusCode.UNAVAILABLE:  # the cache service never answers UNAVAILABLE
            return None
        return (
            f"error: cannot reach the cache service at {addr} (is it running? `deltaserve up` and "
            f"`deltaserve cache serve` start one)\n  {error.details()}"
        )

    return word


def _tenant(args: argparse.Namespace) -> str:
    """The tenant a client command acts for, in words: the one named, the API key's, or default."""
    return args.tenant or ("the API key's" if args.api_key else "default")


def _print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False))


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [list(map(str, headers)), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _size(size_bytes: int) -> str:
    """1536 -> '1.5 KiB'."""
    value, unit = float(size_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{size_bytes} B" if unit == "B" else f"{value:.1f} {unit}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _local_time(unix_ns: int) -> str:
    return datetime.datetime.fromtimestamp(unix_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


# ---- generate ----


def _request_options(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(
        text=args.text,
        chat=args.chat,
        chat_template_kwargs=args.chat_template_kwargs,
        token_ids=args.token_ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        logit_bias=dict(args.logit_bias or ()),
        stop=args.stop or (),
        stop_token_ids=args.stop_token_ids or (),
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        n=args.n,
        logprobs=args.logprobs,
        top_logprobs=args.top_logprobs,
        response_format=args.json_schema or ({"type": "json_object"} if args.json_object else None),
        request_id=args.request_id or "",
        conversation_id=args.conversation or "",
        tenant=args.tenant,
        shared_prefix=args.shared_prefix,
    )


def generation_json(generation: Generation) -> dict[str, Any]:
    """A Generation as JSON: its fields (the pin's only where a shared prefix was asked for), the logprobs as
    lists of {token_id, token, logprob, top}."""
    left_out = {"logprobs"} | ({"pinned_prefix", "pin_note"} if generation.pinned_prefix is None else set())
    value = {
        f.name: getattr(generation, f.name) for f in dataclasses.fields(generation) if f.name not in left_out
    }
    if generation.logprobs:
        value["logprobs"] = [
            {
                "token_id": entry.chosen.token_id,
                "token": entry.chosen.token,
                "logprob": entry.chosen.logprob,
                "top": [{"token_id": t.token_id, "token": t.token, "logprob": t.logprob} for t in entry.top],
            }
            for entry in generation.logprobs
        ]
    return value


def reuse_line(response: client_pb2.GenerateResponse) -> str:
    """What a conversation's turn reused, from its last response: 'reused N of M prompt tokens (...)'."""
    details = f"checkpoint: {response.checkpoint}"
    if response.diverged_at >= 0:
        details += f"; the prompt differs from the kept history at token {response.diverged_at}"
    if response.HasField("pinned_prefix"):
        details += f"; pinned prefix: {response.pinned_prefix} tokens"
        if response.pin_note:
            details += f" ({response.pin_note})"
    return f"reused {response.reused_tokens} of {response.prompt_tokens} prompt tokens ({details})"


async def _stream_text(client: PlannerClient, options: GenerateOptions) -> client_pb2.GenerateResponse | None:
    """Writes the text as it comes; returns the last response (None if the stream ended without one). A first
    token later than TTFT_SHOWN_S (a long prompt on a CPU) is timed on stderr."""
    generated = 0
    last = None
    began = time.perf_counter()
    async for response in client.generate(options):
        if last is None and (waited := time.perf_counter() - began) > TTFT_SHOWN_S:
            print(
                f"first token after {waited:.1f} s ({response.prompt_tokens} prompt tokens)", file=sys.stderr
            )
        sys.stdout.write(response.text)
        sys.stdout.flush()
        generated += len(unpack_i32(response.token_ids))
        last = response
        if response.finish_reason:
            log.debug(
                "finished",
                request_id=response.request_id,
                tokens=generated,
                finish_reason=FINISH_REASONS[response.finish_reason],
            )
    sys.stdout.write("\n")
    sys.stdout.flush()
    return last


async def generate(args: argparse.Namespace, stop: asyncio.Event) -> int:
    options = _request_options(args)
    async with PlannerClient(args.addr, client_security(args)) as client:
        if args.json:
            outcome = await _call(client.generate_choices(options), stop, _planner_unreachable(client))
            code = outcome[0]
            if outcome[0] is None:
                choices = [generation_json(generation) for generation in outcome[1]]
                _print_json(choices[0] if len(choices) == 1 else choices)
        else:
            code, last = await _call(_stream_text(client, options), stop, _planner_unreachable(client))
            if code is None and args.conversation and last is not None:
                print(reuse_line(last), file=sys.stderr)
    return code or 0


# ---- conversations on the planner ----


async def _on_conversation(
    args: argparse.Namespace,
    stop: asyncio.Event,
    call: Callable[[PlannerClient], Awaitable[ConversationAnswer]],
    said: Callable[[ConversationAnswer], str],
) -> int:
    """One call on the conversation `args` names; its answer as JSON (with the id and tenant), else as `said`."""
    async with PlannerClient(args.addr, client_security(args)) as client:
        outcome = await _call(call(client), stop, _planner_unreachable(client))
    if outcome[0] is not None:
        return outcome[0]
    answer = outcome[1]
    if args.json:
        _print_json(
            {"conversation_id": args.conversation_id, "tenant": _tenant(args), **dataclasses.asdict(answer)}
        )
    else:
        print(said(answer))
    return 0


async def park(args: argparse.Namespace, stop: asyncio.Event) -> int:
    def said(parked: Parked) -> str:
        if not parked.bytes:
            return f"{args.conversation_id} holds no pages in the pool (already parked, or no turn has ended yet)"
        held = f"{_count(parked.tokens, 'token')}, {_size(parked.bytes)}"
        return f"parked {args.conversation_id}: {held} in the cache"

    return await _on_conversation(
        args, stop, lambda client: client.park(args.conversation_id, args.tenant), said
    )


async def resume(args: argparse.Namespace, stop: asyncio.Event) -> int:
    def said(resumed: Resumed) -> str:
        checkpoints = ", ".join(map(str, resumed.checkpoints)) or "none"
        return (
            f"resumed {args.conversation_id}: {_count(resumed.tokens, 'token')}, checkpoints at {checkpoints}"
        )

    return await _on_conversation(
        args, stop, lambda client: client.resume(args.conversation_id, args.tenant), said
    )


async def conversations(args: argparse.Namespace, stop: asyncio.Event) -> int:
    async with PlannerClient(args.addr, client_security(args)) as client:
        outcome = await _call(client.conversations(args.tenant), stop, _planner_unreachable(client))
    if outcome[0] is not None:
        return outcome[0]
    listed = outcome[1]
    if args.json:
        _print_json([dataclasses.asdict(conversation) for conversation in listed])
    elif not listed:
        print(f"no conversations (tenant {_tenant(args)})")
    else:
        _print_table(
            ("CONVERSATION", "TOKENS", "PAGES", "PARKED", "PINNED", "CHECKPOINTS"),
            [
                (
                    c.conversation_id,
                    c.tokens,
                    c.pages,
                    "yes" if c.parked else "no",
                    c.pinned_prefix or "-",
                    ",".join(map(str, c.checkpoints)) or "-",
                )
                for c in listed
            ],
        )
    return 0


async def delete(args: argparse.Namespace, stop: asyncio.Event) -> int:
    def said(deleted: Deleted) -> str:
        snapshot = f", its snapshot ({_size(deleted.snapshot_bytes)})" if deleted.snapshot_bytes else ""
        held = f"{_count(deleted.tokens, 'token')}, {_count(deleted.pages, 'page')}"
        return f"deleted {args.conversation_id}: {held}{snapshot}"

    return await _on_conversation(
        args, stop, lambda client: client.delete_conversation(args.conversation_id, args.tenant), said
    )


# ---- snapshots in the cache service ----


async def cache_ls(args: argparse.Namespace, stop: asyncio.Event) -> int:
    async with CacheClient(args.addr, client_security(args)) as cache:
        listing = cache.list(args.tenant, include_quarantined=args.all)
        outcome = await _call(listing, stop, _cache_unreachable(args.addr))
    if outcome[0] is not None:
        return outcome[0]
    snapshots = outcome[1]
    if args.json:
        _print_json(snapshots)
    elif not snapshots:
        print(f"no snapshots (tenant {_tenant(args)})")
    else:
        _print_table(
            ("CONVERSATION", "TOKENS", "SIZE", "PINNED", "LAST USED", "STATE"),
            [
                (
                    s["conversation_id"],
                    s["num_tokens"],
                    _size(s["size_bytes"]),
                    "yes" if s["pinned"] else "no",
                    _local_time(s["last_used_unix_ns"]) if s["last_used_unix_ns"] else "-",
                    f"quarantined: {s['quarantined']}" if s["quarantined"] else "ok",
                )
                for s in snapshots
            ],
        )
    return 0


async def cache_rm(args: argparse.Namespace, stop: asyncio.Event) -> int:
    async with CacheClient(args.addr, client_security(args)) as cache:
        outcome = await _call(
            cache.delete(args.tenant, args.conversation_id), stop, _cache_unreachable(args.addr)
        )
    if outcome[0] is not None:
        return outcome[0]
    deleted = outcome[1]
    if args.json:
        _print_json({"conversation_id": args.conversation_id, "tenant": _tenant(args), **deleted})
    else:
        print(f"deleted the snapshot of {args.conversation_id} ({_size(deleted['size_bytes'])})")
    return 0


async def cache_stat(args: argparse.Namespace, stop: asyncio.Event) -> int:
    async with CacheClient(args.addr, client_security(args)) as cache:
        outcome = await _call(cache.stat(args.tenant), stop, _cache_unreachable(args.addr))
    if outcome[0] is not None:
        return outcome[0]
    stat = outcome[1]
    if args.json:
        _print_json({"tenant": _tenant(args), **stat})
    else:
        print(
            f"cache: {_count(stat['count'], 'snapshot')}, {_size(stat['size_bytes'])} of "
            f"{_size(stat['budget_bytes'])} ({_size(stat['pinned_bytes'])} pinned)"
        )
        print(
            f"tenant {_tenant(args)}: {_count(stat['tenant_count'], 'snapshot')}, "
            f"{_size(stat['tenant_size_bytes'])}"
        )
    return 0
