"""The CLI's parsing: each command's defaults, DELTASERVE_* variables filling flags (the command line wins),
global flags anywhere, bad values and keys as usage errors naming the flag or variable, the help (the
variables named, keys never shown), the planner's executors and groups, and the client commands' flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from executor_svc.config import DEFAULT_BUCKETS
from tests.cli_helpers import REPO, cli_env, parse, usage_error


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
    assert "without spaces at its ends" in usage_error(capsys, ["up", "--served-model-name", " smol"])
    assert "must be printable" in usage_error(
        capsys, ["planner", "--executor", "a:1", "--served-model-name", "a\tb"]
    )
    assert parse(["up"], DELTASERVE_SERVED_MODEL_NAME="smollm2").served_model_name == "smollm2"
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
