"""The services' configs from the parsed flags (the serving commands' and `up`'s)."""

from __future__ import annotations

import argparse

from cache_svc.config import CacheServiceConfig
from executor_svc.config import ExecutorConfig
from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.retention import RetentionConfig

GIB = 1 << 30


def executor_config(args: argparse.Namespace, *, cache: str | None) -> ExecutorConfig:
    return ExecutorConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        page_size=args.page_size,
        pool_pages=args.pool_pages,
        state_slots=args.state_slots,
        max_seq_len=args.max_seq_len,
        buckets=tuple(args.buckets),
        prefill_buckets=tuple(args.prefill_buckets),
        decode_path=args.decode_path,
        row_check=args.row_check,
        cache=cache,
        shard_layers=args.shard_layers,
        grammar_cache=args.grammar_cache,
        layers=getattr(args, "layers", None),  # a stage of a layer split: `executor` only
        stage_rank=getattr(args, "stage_rank", 0),
        stages=getattr(args, "stages", 1),
        stage_group=getattr(args, "stage_group", None),
        stage_backend=getattr(args, "stage_backend", "auto"),
    )


def planner_config(args: argparse.Namespace, *, executors: list[str], cache: str | None) -> PlannerConfig:
    return PlannerConfig(
        executors=executors,
        model=args.model,
        max_waiting=args.max_waiting,
        max_waiting_per_tenant=args.max_waiting_per_tenant,
        default_max_tokens=args.default_max_tokens,
        served_model_name=args.served_model_name,
        chat_template=None if args.chat_template is None else args.chat_template.text,
        executor_timeout=args.executor_timeout,
        cache=cache,
        scheduling=SchedulingConfig(
            prefill_token_budget=args.prefill_token_budget,
            decode_steps=args.decode_steps,
            row_check=args.row_check,
            prefix_cache=args.prefix_cache,
        ),
        retention=RetentionConfig(cap=args.retention_cap, policy=args.retention_policy),
    )


def cache_config(args: argparse.Namespace) -> CacheServiceConfig:
    tenant_gib = args.tenant_budget_gib
    return CacheServiceConfig(
        root_dir=args.cache_dir,
        budget_bytes=int(args.cache_budget_gib * GIB),
        tenant_budget_bytes=None if tenant_gib is None else int(tenant_gib * GIB),
    )
