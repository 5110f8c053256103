"""The serving commands in processes of their own, end to end: `deltaserve cache serve` answering ls, rm
and stat and stopping cleanly on SIGHUP, and `deltaserve up` with its cache serving a conversation,
park, cache ls and delete, stopping cleanly on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
from collections.abc import Iterator

from deltaserve.configs import GIB
from tests.cli_helpers import Serving, deltaserve, deltaserve_json, free_port


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
