"""Errors as OpenAI's error object, with the HTTP status that matches the planner's gRPC status."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from protos.rpc import NEVER_FITS_METADATA

# gRPC status -> HTTP status; anything else is 500
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,  # a tenant's key naming another tenant (the body's `tenant`)
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,  # a turn already runs on the conversation
    # the queue full, or no state slot will come back (400 if it can never fit: from_rpc)
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,  # draining, no executor, a cut request
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# the gateway's own answers (no gRPC status behind them) -> the gRPC status name `code` says, as the planner's
GATEWAY_CODE = {
    400: "invalid_argument",
    401: "unauthenticated",
    404: "not_found",
    405: "unimplemented",
    413: "resource_exhausted",
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",  # a method the path does not take
    413: "invalid_request_error",  # a body over the gateway's bound
    409: "conflict_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
RETRY_AFTER_S = 1  # sent with 429 and 503: the queue drains and executors come back within seconds


class ApiError(Exception):
    """An answer other than 200: the HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or GATEWAY_CODE.get(status)

    @classmethod
    def from_rpc(cls, error: grpc.aio.AioRpcError) -> ApiError:
        code = error.code()
        status = HTTP_STATUS.get(code, 500)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and any(
            key == NEVER_FITS_METADATA for key, _ in error.trailing_metadata() or ()
        ):  # larger than the pool: a retry cannot help, and a 429 is retried by OpenAI's client
            status = 400
        return cls(status, error.details() or code.name, code=code.name.lower())

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPE.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _location(loc: tuple) -> str:
    """('body', 'messages', 0, 'content') -> 'messages.0.content'."""
    return ".".join(str(part) for part in loc if part != "body") or "body"


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app answers is OpenAI's error object: ours, FastAPI's validation (a 400, as OpenAI
    answers a malformed body, not 422) and Starlette's (404 for an unknown path, 405)."""

    async def api_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, ApiError)
        return error.response()

    async def invalid_body(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # its loc is ("body", character offset): no field to name
            at = first.get("loc", ("body", "?"))[-1]
            return ApiError(400, f"the body is not valid JSON (at character {at})").response()
        where = _location(tuple(first.get("loc", ())))
        if where == "body" and "application/json" not in request.headers.get("content-type", ""):
            return ApiError(400, "the body must be a JSON object sent as application/json").response()
        return ApiError(400, f"{where}: {first.get('msg', 'invalid')}", param=where).response()

    async def http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException)
        return ApiError(error.status_code, str(error.detail)).response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(HTTPException, http_error)
