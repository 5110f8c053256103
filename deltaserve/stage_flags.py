"""The layer split's flags: `executor` as one stage, `planner --executor-group`, `up --layer-split`
(docs/LAYER_SPLIT.md)."""

from __future__ import annotations

from deltaserve.flags import BadValue, Flags, address, address_groups, int_at_least
from executor_svc.stage import BACKENDS
from protos.layer_split import parse_layers


def _layers(text: str) -> tuple[int, int]:
    try:
        return parse_layers(text)
    except ValueError as error:
        raise BadValue(str(error)) from None


def _layer_split(text: str) -> str:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts) or (len(parts) == 1 and int(parts[0]) < 1):
        raise BadValue(f"expected N stages or cut points like 10,20, got {text!r}")
    return text


def add_stage_flags(flags: Flags) -> None:
    """`executor`: this process as one stage of a layer split (docs/LAYER_SPLIT.md)."""
    flags.option(
        "--layers",
        type=_layers,
        metavar="A:B",
        help="hold layers A to B-1 only: a stage of a layer split (the first stage also the embedding, the "
        "last the final norm, head and sampler); default: every layer",
    )
    flags.option(
        "--stage-rank", type=int_at_least(0), default=0, metavar="R", help="this stage's rank, from 0"
    )
    flags.option("--stages", type=int_at_least(1), default=1, metavar="N", help="stages in the group")
    flags.option(
        "--stage-group",
        type=address,
        metavar="HOST:PORT",
        help="the group's torch.distributed rendezvous, where stage 0 listens (the same for every stage)",
    )
    flags.option(
        "--stage-backend",
        default="auto",
        choices=BACKENDS,
        help="the transfers between stages: auto is nccl on CUDA, gloo on the CPU; gloo for stages sharing "
        "one GPU (through host memory)",
    )
    flags.switch(
        "--stop-on-stdin-close",
        help="stop when standard input closes, not on SIGINT, SIGTERM or SIGHUP: how `up` runs its stages, so "
        "they stop after its drain and never outlive it",
    )


def add_executor_group_flag(flags: Flags) -> None:
    """`planner`: attach to the stages of a layer split as to one executor."""
    flags.repeated(
        "--executor-group",
        type=address_groups,
        metavar="HOST:PORT,HOST:PORT,...",
        help="the stages of one layer-split executor, in rank order; repeat it for more groups (beside "
        "whole --executor ones: conversations and load spread over them all; in the variable, groups "
        "separated by ';')",
    )


def add_layer_split_flag(flags: Flags) -> None:
    """`up`: the model split over stage processes on this machine."""
    flags.option(
        "--layer-split",
        type=_layer_split,
        metavar="N|C1,C2",
        help="run the model as N stage processes (layers split evenly; on the local GPUs in turn, or the "
        "CPU), or cut at the layers given (10,20: three stages); default: one executor in this process",
    )
