"""The serving commands' flags made configs: the executor's, the planner's and the cache's, the cache flags
and their variables, `up`'s own cache (in the user's cache directory unless told otherwise), and the
trust flags (API key files, TLS) failing the start naming the line or flag."""

from __future__ import annotations

import pytest

from deltaserve.configs import GIB, cache_config, executor_config, planner_config
from deltaserve.flags import default_cache_dir
from executor_svc.config import DEFAULT_PREFILL_BUCKETS, DEFAULT_SHARD_LAYERS
from planner_svc.config import PlannerConfig
from tests.cli_helpers import parse, usage_error


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
    assert planner.served_model_name is None  # the checkpoint's own name
    named = parse(["planner", "--executor", "x:1", "--served-model-name", "smollm2"])
    assert planner_config(named, executors=[], cache=None).served_model_name == "smollm2"
    with pytest.raises(ValueError, match="served_model_name: a model name has at most 256 characters"):
        PlannerConfig(served_model_name="m" * 257)


def test_a_chat_template_is_read_from_its_file_when_the_flag_is_given(tmp_path, capsys):
    template = tmp_path / "chatml.jinja"
    template.write_text("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert planner_config(parse(["up"]), executors=[], cache=None).chat_template is None  # the tokenizer's
    args = parse(["planner", "--executor", "x:1", "--chat-template", str(template)])
    assert planner_config(args, executors=[], cache=None).chat_template == template.read_text()
    from_env = parse(["up"], DELTASERVE_CHAT_TEMPLATE=str(template))
    assert planner_config(from_env, executors=[], cache=None).chat_template == template.read_text()
    (tmp_path / "empty.jinja").write_text(" \n")
    assert "is empty" in usage_error(capsys, ["up", "--chat-template", str(tmp_path / "empty.jinja")])
    said = usage_error(capsys, ["up", "--chat-template", str(tmp_path / "missing.jinja")])
    assert "--chat-template" in said and "cannot read" in said and "missing.jinja" in said
    with pytest.raises(ValueError, match="chat_template is empty"):
        PlannerConfig(chat_template="")


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
