"""The `deltaserve` command line: its parser (flags with environment fallbacks) and `main`."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Mapping

from deltaserve import aio, commands, configs, serve
from deltaserve.flag_groups import (
    add_cache_store_flags,
    add_client_flags,
    add_executor_key_flag,
    add_global_flags,
    add_model_flags,
    add_planner_flags,
    add_serve_flags,
    add_server_trust_flags,
)
from deltaserve.flags import (
    ENV_PREFIX,
    EPILOG,
    Flags,
    HelpFormatter,
    address,
    addresses,
    cache_choice,
    env_name,
    port,
)
from deltaserve.generate_flags import GENERATE_HELP, add_generate_command, resolve_prompt
from deltaserve.http_flags import add_http_flags, add_http_port_flag
from deltaserve.logs import configure_logging, get_logger
from deltaserve.memory_errors import POOL_FLAGS, memory_detail, out_of_memory
from deltaserve.serve import CACHE_PORT, EXECUTOR_PORT, HTTP_PORT, PLANNER_PORT
from deltaserve.stage_flags import add_executor_group_flag, add_layer_split_flag, add_stage_flags
from deltaserve.stages import StageExited
from deltaserve.trust import trust_from_args
from executor_svc.c_kernels import KernelUnavailable
from protos.tls import TLSConfigError

log = get_logger("deltaserve.cli")

SERVING = {"up", "executor", "planner"}  # the commands that load a model (and transformers)
# The cache commands' --addr: DELTASERVE_ADDR already means the planner's address.
CACHE_ADDR_ENV = ENV_PREFIX + "CACHE_ADDR"


# ---- the parser ----


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="deltaserve",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
        description="LLM serving as gRPC services: a planner (the client API), executors (the model) "
        "and a cache (conversation snapshots on disk).",
    )
    if env_errors := add_global_flags(parser, environ, suppress=False):
        parser.error("; ".join(env_errors))
    commands_action = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(action, name: str, help: str) -> Flags:
        sub = action.add_parser(
            name, help=help, description=help, formatter_class=HelpFormatter, epilog=EPILOG
        )
        add_global_flags(sub, environ, suppress=True)
        flags = Flags(sub, environ)
        sub.set_defaults(env_errors=flags.env_errors)  # checked by parse_args once the command is known
        return flags

    up = command(
        commands_action,
        "up",
        "cache, executor and planner in one process: the model on this machine, the API on --host:--port",
    )
    add_model_flags(up)
    add_layer_split_flag(up)
    add_serve_flags(up, port_number=PLANNER_PORT)
    add_planner_flags(up)
    up.switch("--row-check", help="debug: compare every row a step reads with the planner's mirror")
    up.option(
        "--cache",
        type=cache_choice,
        default="auto",
        metavar="auto|off|HOST:PORT",
        help="the cache service: auto starts one in this process (on --host:--cache-port, snapshots in "
        "--cache-dir); off runs without one (conversations cannot be parked); or a running one's address",
    )
    up.parser.add_argument(
        "--no-cache", dest="cache", action="store_const", const="off", help="the same as --cache off"
    )
    up.option(
        "--cache-port",
        type=port,
        default=CACHE_PORT,
        metavar="PORT",
        help="port of the cache service this process starts (0 picks a free one)",
    )
    add_cache_store_flags(up, environ)
    add_server_trust_flags(up, api_keys=True, links=True)
    add_http_port_flag(up)

    add_http_flags(
        command(
            commands_action,
            "http",
            "the OpenAI-compatible HTTP API alone, talking to a running planner over gRPC",
        ),
        planner_port=PLANNER_PORT,
        http_port=HTTP_PORT,
    )

    executor = command(
        commands_action, "executor", "the executor alone: holds the model, runs the steps the planners send"
    )
    add_model_flags(executor)
    add_stage_flags(executor)
    add_serve_flags(executor, port_number=EXECUTOR_PORT)
    add_server_trust_flags(executor, api_keys=True, links=True)
    executor.switch("--row-check", help="debug: compare every row a step reads with the planner's mirror")
    executor.option(
        "--cache",
        type=address,
        metavar="HOST:PORT",
        help="the cache service to park conversations in (default: none)",
    )

    planner = command(
        commands_action, "planner", "the planner alone: the client API, attached to running executors"
    )
    planner.repeated(
        "--executor",
        type=addresses,
        metavar="HOST:PORT",
        help="an executor to attach to; repeat it or separate addresses with commas (this or "
        "--executor-group is required)",
    )
    add_executor_group_flag(planner)
    add_serve_flags(planner, port_number=PLANNER_PORT)
    planner.option(
        "--model",
        metavar="PATH",
        help="where the tokenizer comes from, as the executor's --model (default: SmolLM2-135M-Instruct)",
    )
    add_planner_flags(planner)
    add_server_trust_flags(planner, api_keys=True, links=True)
    add_executor_key_flag(planner)
    planner.switch(
        "--row-check", help="debug: ship the mirror of every row read, for the executors to compare"
    )
    planner.option(
        "--cache",
        type=address,
        metavar="HOST:PORT",
        help="the cache service holding parked conversations, the executors' --cache (default: none)",
    )

    cache = commands_action.add_parser(
        "cache",
        help="the cache service: serve it, or list, delete and size its snapshots",
        description="the cache service: serve it, or list, delete and size its snapshots",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
    )
    add_global_flags(cache, environ, suppress=True)
    cache_actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    cache_serve = command(
        cache_actions, "serve", "the cache service alone: snapshots on disk under --cache-dir"
    )
    add_cache_store_flags(cache_serve, environ)
    add_serve_flags(cache_serve, port_number=CACHE_PORT)
    add_server_trust_flags(cache_serve, api_keys=True, links=False)
    cache_ls = command(cache_actions, "ls", "list the tenant's snapshots, most recently used first")
    cache_ls.parser.add_argument(
        "--all", action="store_true", help="also the snapshots quarantined for failing their checks"
    )
    add_client_flags(cache_ls, service="the cache service", port_number=CACHE_PORT, addr_env=CACHE_ADDR_ENV)
    cache_rm = command(cache_actions, "rm", "delete a conversation's snapshot")
    cache_rm.parser.add_argument("conversation_id", metavar="ID", help="the conversation")
    add_client_flags(cache_rm, service="the cache service", port_number=CACHE_PORT, addr_env=CACHE_ADDR_ENV)
    add_client_flags(
        command(cache_actions, "stat", "snapshot count and bytes: the whole cache, the tenant's share"),
        service="the cache service",
        port_number=CACHE_PORT,
        addr_env=CACHE_ADDR_ENV,
    )

    add_generate_command(command(commands_action, "generate", GENERATE_HELP))

    for name, help in (
        ("park", "move an idle conversation's KV pages out of the pool into the cache service"),
        ("resume", "bring a parked conversation's pages back into the pool (its next generate does too)"),
        (
            "delete",
            "forget a conversation: its pages and checkpoints in the planner, its snapshot in the cache",
        ),
    ):
        flags = command(commands_action, name, help)
        flags.parser.add_argument("conversation_id", metavar="ID", help="the conversation")
        add_client_flags(flags, service="the planner", port_number=PLANNER_PORT)
    add_client_flags(
        command(
            commands_action, "conversations", "list the conversations the planner keeps, parked ones too"
        ),
        service="the planner",
        port_number=PLANNER_PORT,
    )
    return parser


def command_name(args: argparse.Namespace) -> str:
    """'up', 'generate', 'cache ls', ..."""
    return f"{args.command} {args.action}" if args.command == "cache" else args.command


_EVERY_INTERFACE = {"", "0.0.0.0", "::", "[::]"}


def _port_clash(args: argparse.Namespace) -> str | None:
    """Two listening flags of a serving command with one port on one address: said here, naming both, since
    the second listener would only fail as "port taken" (taken by this process's own first one)."""
    if "metrics_port" not in args:
        return None  # not a serving command
    bound = [("--port", args.port, args.host)]
    if args.command == "up":
        bound += [("--http-port", args.http_port, args.host)]
        if args.cache == "auto":
            bound += [("--cache-port", args.cache_port, args.host)]
    bound += [("--metrics-port", args.metrics_port, args.metrics_host)]
    for i, (flag, number, host) in enumerate(bound):
        for other, other_number, other_host in bound[:i]:
            one_address = host == other_host or {host, other_host} & _EVERY_INTERFACE
            if number and number == other_number and one_address:
                return f"{other} and {flag} are both {number}: give each its own port (0 picks a free one)"
    return None


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    if env_errors := args.__dict__.pop("env_errors"):
        parser.error(f"{command_name(args)}: " + "; ".join(env_errors))
    if args.command == "planner" and not args.executor and not args.executor_group:
        parser.error(
            f"planner: --executor HOST:PORT or --executor-group is required (or {env_name('--executor')})"
        )
    if clash := _port_clash(args):
        parser.error(f"{command_name(args)}: {clash}")
    if args.command == "up" and args.http_workers > 1 and not args.http_process:
        parser.error(
            f"up: --http-workers {args.http_workers} starts that many HTTP processes, but --no-http-process "
            "serves the HTTP API on the planner's event loop, in no process of its own: give one or the other"
        )
    if args.command == "generate":
        resolve_prompt(parser, args, environ)
        if args.shared_prefix is not None and not args.conversation:
            parser.error(
                "generate: --shared-prefix marks a conversation's prefix; give --conversation ID too"
            )
        if args.n > 1 and not args.json:
            parser.error("generate: --n above 1 makes several choices at once; give --json to print them")
    return args


# ---- running a command ----

_CLIENT_COMMANDS = {
    "generate": commands.generate,
    "park": commands.park,
    "resume": commands.resume,
    "conversations": commands.conversations,
    "delete": commands.delete,
    "cache ls": commands.cache_ls,
    "cache rm": commands.cache_rm,
    "cache stat": commands.cache_stat,
}


def _serving(args: argparse.Namespace):
    """The serve coroutine function of a serving command, its configs checked (ValueError when not)."""
    args.trust = trust_from_args(args)  # the key file and certificates read now: a bad one fails the start
    if args.command == "up":
        external = args.cache if args.cache not in ("auto", "off") else None
        executor_cfg = configs.executor_config(args, cache=external)
        planner_cfg = configs.planner_config(args, executors=[], cache=external)
        cache_cfg = configs.cache_config(args) if args.cache == "auto" else None
        return functools.partial(serve.serve_up, args, executor_cfg, planner_cfg, cache_cfg)
    if args.command == "executor":
        return functools.partial(serve.serve_executor, args, configs.executor_config(args, cache=args.cache))
    if args.command == "planner":
        config = configs.planner_config(args, executors=args.executor or [], cache=args.cache)
        config.executor_groups = args.executor_group or []
        return functools.partial(serve.serve_planner, args, config)
    if args.command == "http":
        return functools.partial(serve.serve_http, args)
    return functools.partial(serve.serve_cache, args, configs.cache_config(args))


def _run(args: argparse.Namespace) -> int:
    name = command_name(args)
    if name in _CLIENT_COMMANDS:
        try:
            return aio.run(functools.partial(_CLIENT_COMMANDS[name], args))
        except TLSConfigError as error:  # e.g. --tls-ca naming no file, --tls-cert without --tls-key
            print(f"deltaserve {name}: error: {error}", file=sys.stderr)
            return 2
        except UnicodeEncodeError as error:  # argv bytes that are not UTF-8 (surrogates): the wire takes text
            shown = ascii(error.object)[:80] if isinstance(error.object, str) else "an argument"
            print(f"deltaserve {name}: error: {shown} is not valid UTF-8 text", file=sys.stderr)
            return 2
    try:
        serving = _serving(args)
    except ValueError as error:  # a config's own check, e.g. a page size that is not a power of two
        print(f"deltaserve {name}: error: {error}", file=sys.stderr)
        return 2
    try:
        return aio.run(serving, stop_on_stdin_close=getattr(args, "stop_on_stdin_close", False))
    except StageExited as error:  # what the user of `up` acts on (a supervisor restarts it): one line
        log.debug("failed", command=name, exc_info=True)  # with what the lost stage failed, if anything
        print(f"deltaserve {name}: error: {error}", file=sys.stderr)
        return 1
    except (OSError, ValueError, MemoryError, RuntimeError) as error:  # KernelUnavailable: a RuntimeError
        mendable = isinstance(error, (OSError, ValueError, KernelUnavailable))
        if serve.LISTENED.is_set() or not (mendable or out_of_memory(error)):
            # a fault while serving or stopping, not a start-up mistake: its traceback
            log.exception("failed", command=name)
            return 1
        # What a user mends at start (a model path, a port taken, a cache directory, a limit, pools too large
        # for the memory): the message, not a traceback; --log-level debug still shows where it came from.
        log.debug("failed", command=name, exc_info=True)
        said = error if mendable else f"not enough memory to start ({memory_detail(error)}); {POOL_FLAGS}"
        print(f"deltaserve {name}: error: {said}", file=sys.stderr)
        return 1
    except Exception:
        log.exception("failed", command=name)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Only the commands that load a model pay for importing transformers (about a second) to quiet it.
    name = command_name(args)
    configure_logging(
        args.log_level,
        args.log_json,
        route_transformers=args.command in SERVING,
        service="cache" if name == "cache serve" else name,
    )
    return _run(args)
