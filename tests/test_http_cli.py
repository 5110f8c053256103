"""The HTTP API from the command line: `deltaserve up --http-port` beside gRPC, and `deltaserve http` as its
own process over that planner; the bearer key of each HTTP caller checked by the planner's --api-keys."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest

from tests.test_cli import Serving, free_port

ALICE = "alice-http-key-0123456789"
QUESTION = [{"role": "user", "content": "Name a colour."}]


def test_up_serves_http_beside_grpc_and_http_runs_alone_with_the_same_keys(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{ALICE} alice\n")
    port, http_port, alone_port = free_port(), free_port(), free_port()
    up = Serving(
        tmp_path / "up.log",
        "up",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--api-keys",
        str(keys),
        "--no-cache",
        "--device",
        "cpu",
        "--pool-pages",
        "64",
        "--buckets",
        "1,2",
        "--max-seq-len",
        "512",
    )
    alone = None
    try:
        listening = up.wait_listening(180)
        assert (listening["addr"], listening["http"]) == (f"127.0.0.1:{port}", f"127.0.0.1:{http_port}")
        alone = Serving(
            tmp_path / "http.log", "http", "--planner", f"127.0.0.1:{port}", "--port", str(alone_port)
        )
        assert alone.wait_listening(60)["addr"] == f"127.0.0.1:{alone_port}"
        answers = []
        for served in (http_port, alone_port):
            base = f"http://127.0.0.1:{served}"
            assert httpx.get(f"{base}/health").status_code == 200
            missing = httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": QUESTION})
            assert missing.status_code == 401 and "no API key" in missing.json()["error"]["message"]
            with pytest.raises(openai.AuthenticationError, match="unknown API key"):
                openai.OpenAI(
                    api_key="wrong-key-0123456789", base_url=f"{base}/v1", max_retries=0
                ).models.list()
            client = openai.OpenAI(api_key=ALICE, base_url=f"{base}/v1", max_retries=0)
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(
                model=model, messages=QUESTION, max_tokens=4, temperature=0
            )
            answers.append(reply.choices[0].message.content)
        assert answers[0] == answers[1] and answers[0]
    finally:
        codes = [alone.stop() if alone is not None else 0, up.stop()]
    assert codes == [0, 0], (up.log_path.read_text()[-2000:], alone and alone.log_path.read_text()[-2000:])
