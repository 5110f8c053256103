"""A user's mistake is one line, not a traceback: a bad model path, cache directory, port or pool at start, a
client's bad TLS option or non-UTF-8 argument, a failed config check, a keyed executor refusing a planner
without its service key; and the warning of an executor that holds a cache key while it takes keyless
callers."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

from structlog.testing import capture_logs

from deltaserve.cli import main
from deltaserve.configs import executor_config
from tests.cli_helpers import REPO, Serving, cli_env, deltaserve, free_port, parse


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
