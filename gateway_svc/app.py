"""The OpenAI-compatible routes: chat and text completions (streamed as server-sent events or whole),
models (listed, or one by name), deleting a conversation, health; FastAPI serves their OpenAPI schema at
/openapi.json (and /docs)."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway_svc import openai_replies
from gateway_svc.body_limit import BodyLimit
from gateway_svc.http_errors import ApiError, install_error_handlers
from gateway_svc.http_metrics import Count, CountResponses
from gateway_svc.openai_replies import ChoiceState, ChunkWriter, Kind
from gateway_svc.openai_schema import ChatCompletionBody, CompletionBody, GenerationBody
from gateway_svc.reasoning import REASONING_FIELDS
from gateway_svc.relay import (
    ModelCatalog,
    arrived_together,
    responses,
    rpc,
    unknown_model,
    unless_disconnected,
)
from gateway_svc.translate import BadField, Choice, UnsupportedField, chat_choices, completion_choices
from planner_svc.client import PlannerClient
from protos import client_pb2
from protos.auth import MAX_KEY_CHARS

log = structlog.get_logger("deltaserve.gateway")

VERSION = "0.1.0"
_PRINTABLE = re.compile(r"[ -~]*")
_HEADER_VALUE = re.compile(r"[!-~](?:[ -~]*[!-~])?")
UNUSED_LOGGED, UNUSED_NAME_CHARS = 8, 64  # the unused fields a request's log line names, and their length
router = APIRouter()
_bearer = HTTPBearer(auto_error=False, description="an API key of the planner's --api-keys file")
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
ConversationHeader = Annotated[
    str | None,
    Header(
        alias="X-Conversation-Id",
        description="the conversation to continue (the same as the body's conversation_id)",
    ),
]


class Gateway:
    """What the routes share: the planner client and its model."""

    def __init__(self, planner: PlannerClient, reasoning_field: str | None) -> None:
        self.planner = planner
        self.reasoning_field = reasoning_field  # where a chat's thought goes, apart from its content
        self.models = ModelCatalog(planner)
        self.started = int(time.time())


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _key(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    """The bearer key; a 401 for one that cannot be a key (gRPC metadata is printable ASCII)."""
    if credentials is None:
        return None
    if len(credentials.credentials) > MAX_KEY_CHARS:
        raise ApiError(
            401,
            f"the API key has {len(credentials.credentials)} characters; no key has more than {MAX_KEY_CHARS}",
        )
    if not _PRINTABLE.fullmatch(credentials.credentials):
        raise ApiError(401, "the API key has characters no key has (printable ASCII only)")
    return credentials.credentials


def _conversation_header(conversation: str) -> dict[str, str] | None:
    """X-Conversation-Id echoing the conversation, where its id can be a header value (printable ASCII, no
    space at either end); any other id is in the body's `deltaserve` object only."""
    return {"X-Conversation-Id": conversation} if _HEADER_VALUE.fullmatch(conversation) else None


def _log_unused(body: GenerationBody) -> None:
    """The body's fields this server does not use (unknown, or translate.UNSUPPORTED's set to a value that asks
    for nothing; the others were a 400), once the planner has answered (the caller's key good: the names are
    the client's), at most UNUSED_LOGGED of them, each cut to UNUSED_NAME_CHARS, with their count."""
    if body.model_extra:
        names = sorted(body.model_extra)
        logged = [name[:UNUSED_NAME_CHARS] for name in names[:UNUSED_LOGGED]]
        log.info("fields not used", fields=logged, count=len(names))


def _plan(make, body: GenerationBody, conversation_header: str | None, request_id: str) -> list[Choice]:
    try:
        return make(body, conversation_header, request_id)
    except (UnsupportedField, BadField) as error:
        raise ApiError(400, str(error), param=error.param) from None


async def _answer(
    request: Request,
    kind: Kind,
    body: GenerationBody,
    credentials: HTTPAuthorizationCredentials | None,
    conversation_header: str | None,
) -> Any:
    gateway = _gateway(request)
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    make = chat_choices if kind == "chat" else completion_choices
    choices = _plan(make, body, conversation_header, response_id)  # a field it cannot honour: a 400
    key = _key(credentials)
    model = await gateway.models.check(body.model, key)
    conversation = choices[0].options.conversation_id
    headers = _conversation_header(conversation)
    reasoning_field = gateway.reasoning_field if kind == "chat" else None
    include_reasoning = not (isinstance(body, ChatCompletionBody) and body.include_reasoning is False)
    states = {
        index: ChoiceState(
            index,
            c.prompt,
            tool_spec=c.tool_spec,
            streamed=bool(body.stream),
            reasoning_field=reasoning_field,
            include_reasoning=include_reasoning,
        )
        for c in choices
        for index in c.indices()
    }
    stream = responses(gateway.planner, choices, key)
    created = int(time.time())
    if not body.stream:

        async def gather() -> None:
            async with contextlib.aclosing(stream):
                async for index, response in stream:
                    states[index].add(response)

        await unless_disconnected(request, gather())
        _log_unused(body)
        reply = openai_replies.completion(
            kind,
            response_id,
            created,
            model,
            list(states.values()),
            conversation,
            bool(body.return_token_ids),
            choices[0].options.logprobs,
        )
        return JSONResponse(reply, headers=headers)
    writer = ChunkWriter(
        kind,
        response_id,
        created,
        model,
        conversation,
        token_ids=bool(body.return_token_ids),
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        with_logprobs=choices[0].options.logprobs,
    )
    # Every prompt's first response before the headers: a request the planner refuses, or one prompt of a batch,
    # gets the answer's HTTP status.
    try:
        firsts = await unless_disconnected(request, _first_of_each(stream, states, len(choices)))
    except BaseException:
        await stream.aclose()
        raise
    _log_unused(body)
    return StreamingResponse(
        _events(writer, stream, firsts, states), media_type="text/event-stream", headers=headers
    )


async def _first_of_each(stream, states: dict[int, ChoiceState], prompts: int) -> list:
    """The responses that arrive until each of the `prompts` prompts has answered once."""
    arrived: list = []
    answered: set[int] = set()
    while len(answered) < prompts:
        item = await anext(stream, None)
        if item is None:
            break
        arrived.append(item)
        answered.add(states[item[0]].prompt)
    return arrived


async def _events(writer: ChunkWriter, stream, firsts: list, states: dict[int, ChoiceState]):
    """The events of a streamed answer, those of responses that arrived together in one write; the client going
    away cancels this, and with it every call."""
    async with contextlib.aclosing(arrived_together(stream, firsts)) as groups:
        try:
            async for group in groups:
                events = []
                for index, response in group:
                    state = states[index]
                    event = writer.chunk(state, response, state.add(response))
                    if event is not None:
                        events.append(event)
                if events:
                    yield b"".join(events)
        except ApiError as error:
            log.warning("stream failed", status=error.status, error=error.message)
            yield writer.error(error.body())
            yield openai_replies.DONE
            return
    if writer.include_usage:
        yield writer.usage_chunk(list(states.values()))
    yield openai_replies.DONE


@router.post("/v1/chat/completions", summary="a chat completion (OpenAI's), streamed or whole")
async def chat_completions(
    body: ChatCompletionBody,
    request: Request,
    credentials: Bearer,
    x_conversation_id: ConversationHeader = None,
):
    return await _answer(request, "chat", body, credentials, x_conversation_id)


@router.post("/v1/completions", summary="a text completion (OpenAI's legacy API), streamed or whole")
async def completions(
    body: CompletionBody, request: Request, credentials: Bearer, x_conversation_id: ConversationHeader = None
):
    return await _answer(request, "text", body, credentials, x_conversation_id)


def _model_card(info: client_pb2.ModelInfo, created: int) -> dict[str, Any]:
    return {
        "id": info.name,
        "object": "model",
        "created": created,
        "owned_by": "deltaserve",
        "max_model_len": info.max_seq_len,
    }


@router.get("/v1/models", summary="the model this server serves")
async def models(request: Request, credentials: Bearer):
    gateway = _gateway(request)
    info = await gateway.models.ask(_key(credentials))
    return {"object": "list", "data": [_model_card(info, gateway.started)]}


@router.get("/v1/models/{model:path}", summary="the served model by its name (404 for any other name)")
async def model_by_name(model: str, request: Request, credentials: Bearer):
    gateway = _gateway(request)
    info = await gateway.models.ask(_key(credentials))  # each caller's key checked, as for the list
    if model != info.name:
        raise unknown_model(model, info.name)
    return _model_card(info, gateway.started)


@router.delete(
    "/v1/conversations/{conversation_id:path}",
    summary="delete a conversation: its KV pages and checkpoints in the planner, its snapshot in the cache",
)
async def delete_conversation(
    conversation_id: str,
    request: Request,
    credentials: Bearer,
    tenant: Annotated[
        str, Query(description="the owner, as a body's `tenant`: a service key acts for the one it names")
    ] = "",
):
    planner = _gateway(request).planner
    deleted = await rpc(planner.delete_conversation(conversation_id, tenant, _key(credentials)))
    return {
        "id": conversation_id,
        "object": "conversation.deleted",
        "deleted": True,
        openai_replies.EXTENSION: {
            "tokens": deleted.tokens,
            "pages": deleted.pages,
            "snapshot_bytes": deleted.snapshot_bytes,
        },
    }


@router.get("/health", summary="200 while the planner's gRPC health says SERVING, else 503")
async def health(request: Request):
    serving = await _gateway(request).planner.serving()
    return JSONResponse(
        {"status": "serving" if serving else "not_serving"}, status_code=200 if serving else 503
    )


def create_app(
    planner: PlannerClient, count: Count | None = None, *, reasoning_field: str | None = "reasoning"
) -> FastAPI:
    """The gateway's ASGI app over a planner client (the caller opens and closes the client); `count`:
    what each answer's (path, status) is counted with (http_metrics.py); `reasoning_field`: the field a chat
    answer's thought (<think>...</think>) goes in, apart from the content (reasoning.py; None: left in it)."""
    app = FastAPI(
        title="deltaserve",
        version=VERSION,
        description="OpenAI-compatible chat and text completions over deltaserve's planner, with "
        "conversations (conversation_id) and shared prefixes (shared_prefix); see README's HTTP API.",
    )
    if reasoning_field not in (None, *REASONING_FIELDS):
        raise ValueError(f"reasoning_field {reasoning_field!r}: not one of {REASONING_FIELDS} or None")
    app.state.gateway = Gateway(planner, reasoning_field)
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(BodyLimit)
    if count is not None:
        app.add_middleware(CountResponses, count=count)
    return app
