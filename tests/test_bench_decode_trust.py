"""bench/decode.py's trust arms in a CPU smoke run: the resident gRPC arm behind an API key and behind TLS
serve every request (the GPU run measures their cost at c = 1 against the resident arm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_auth_and_tls_arms_run_on_the_cpu(tmp_path):
    out = tmp_path / "decode.json"
    command = [
        sys.executable,
        os.path.join(ROOT, "bench", "decode.py"),
        *("--device", "cpu", "--arms", "resident-auth,resident-tls", "--concurrency", "1", "--rounds", "1"),
        *(
            "--prompt-tokens",
            "16",
            "--output-tokens",
            "4",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
        ),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(out.read_text())
    records = [r for r in (loaded if isinstance(loaded, list) else loaded["records"]) if "tok_s" in r]
    assert sorted(r["arm"] for r in records) == ["resident-auth", "resident-tls"]
    assert all(r["tok_s"] > 0 and not r.get("failed") for r in records), records
    assert "API keys required" in done.stdout + done.stderr and "transport=TLS" in done.stdout + done.stderr
