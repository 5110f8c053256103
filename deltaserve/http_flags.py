"""The HTTP API's flags: `up`'s port and processes for it, and the `http` command's (where the gateway listens,
the planner it talks to, TLS on both sides)."""

from __future__ import annotations

from deltaserve.flag_groups import add_serve_flags, add_server_trust_flags
from deltaserve.flags import Flags, address, int_at_least, port
from gateway_svc.reasoning import REASONING_FIELDS


def _add_reasoning_flag(flags: Flags) -> None:
    flags.option(
        "--reasoning-field",
        default="reasoning",
        choices=(*REASONING_FIELDS, "none"),
        help="the message field a chat answer's thought goes in (<think>...</think>: Qwen3, Qwen3.5, DeepSeek-R1), "
        "apart from its content: reasoning (vLLM's name now), reasoning_content (DeepSeek's API, vLLM's "
        "earlier name), or none: all of the text in content, as the model wrote it",
    )


def add_http_port_flag(flags: Flags) -> None:
    """`up`'s HTTP API beside its gRPC port."""
    flags.option(
        "--http-port",
        type=port,
        metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API on --host:PORT (0 picks a free one; HTTPS with "
        "--tls-cert); unset: gRPC only",
    )
    flags.switch(
        "--http-process",
        default=True,
        help="serve the HTTP API from a process of its own (--no-http-process: on the planner's event "
        "loop, where its per-token SSE work competes with the planner's steps)",
    )
    flags.option(
        "--http-workers",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="processes serving the HTTP API on its one port (the kernel spreads connections over them)",
    )
    _add_reasoning_flag(flags)


def add_http_flags(flags: Flags, *, planner_port: int, http_port: int) -> None:
    """`http`: where the gateway listens, the planner it talks to, and TLS on both sides."""
    add_serve_flags(flags, port_number=http_port)
    flags.option(
        "--workers",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="processes serving the API on its one port (1: this one; more: that many children, the "
        "kernel spreading connections over them)",
    )
    flags.option(
        "--planner",
        type=address,
        default=f"127.0.0.1:{planner_port}",
        metavar="HOST:PORT",
        help="the planner's gRPC address (each caller's `Authorization: Bearer` key is forwarded to it)",
    )
    _add_reasoning_flag(flags)
    add_server_trust_flags(flags, api_keys=False, links=False)
    flags.option(
        "--tls-ca",
        metavar="PEM",
        help="reach the planner with TLS, trusting this CA; --tls-cert is the client certificate where it "
        "requires one",
    )
