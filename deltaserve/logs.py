"""Structured logging: JSON lines off a terminal, a console renderer on one, stdlib logs routed through it.

Bind a request's id once with `structlog.contextvars.bound_contextvars(request_id=...)` (or
`bind_contextvars`) and every line logged while handling that request carries it.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

# Libraries whose INFO chatter would drown the services' own lines.
_QUIET_LIBRARIES = ("grpc", "transformers", "urllib3", "filelock", "huggingface_hub", "asyncio")


def _level_number(level: str) -> int:
    number = logging.getLevelName(level.upper())  # a level's name gives its number
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning, error or critical")
    return number


def configure_logging(
    level: str = "info",
    json: bool | None = None,
    *,
    route_transformers: bool = True,
    service: str | None = None,
) -> None:
    """Sends every log line (structlog and stdlib) to stderr, rendered one way.

    json=None picks JSON lines when stderr is not a terminal. `service` (planner, executor, cache, up, http, ...) is
    a field of every line, so the lines of a stack's services stay apart once collected in one place. route_transformers makes transformers'
    own handler step aside so its warnings come through here too; it imports transformers' logging
    module (about a second), which a short-lived client command can skip.
    """
    level_number = _level_number(level)
    if json is None:
        json = not sys.stderr.isatty()
    if json:
        # Progress bars (GGUF de-quantization) would interleave with the JSON lines; tqdm reads
        # TQDM_* defaults when it is first imported.
        os.environ.setdefault("TQDM_DISABLE", "1")

    shared_processors: list = [
        *([_add_service(service)] if service is not None else []),
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[*shared_processors, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        cache_logger_on_first_use=True,
    )
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    final_processors: list[structlog.typing.Processor] = [
        structlog.stdlib.ProcessorFormatter.remove_processors_meta
    ]
    if json:
        # The console renderer prints tracebacks itself; JSON needs them as a string field.
        final_processors.append(structlog.processors.format_exc_info)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared_processors, structlog.stdlib.ExtraAdder()],
        processors=[*final_processors, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level_number)
    if route_transformers:
        _route_transformers_logging()
    for name in _QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(logging.WARNING, level_number))


def _add_service(service: str) -> structlog.typing.Processor:
    def add(logger: object, method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        event.setdefault("service", service)
        return event

    return add


def _route_transformers_logging() -> None:
    """transformers installs a stderr handler of its own and stops propagation; undo both."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
