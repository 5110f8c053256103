"""An allocation that fails while a serving command starts (its pools, slot store or graphs sized past the
memory), told apart from other runtime errors and said in a line: torch's CPU allocator raises a RuntimeError
("DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes"), CUDA an OutOfMemoryError, numpy a
MemoryError."""

from __future__ import annotations

import re

POOL_FLAGS = (
    "the memory a server takes is sized by --pool-pages, --state-slots, --buckets and --prefill-buckets"
)

_TRIED = re.compile(r"(?:tried to allocate|Tried to allocate) ([\d.]+ ?(?:bytes|[KMGT]iB))")
_GIB = 1 << 30


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def memory_detail(error: BaseException) -> str:
    """What was asked for, where the error says ('an allocation of 33.5 TiB'), else its first line."""
    found = _TRIED.search(str(error))
    if found is None:
        return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    amount = found.group(1)
    if amount.endswith("bytes"):
        size = int(float(amount.split()[0]))
        amount = f"{size / _GIB:,.1f} GiB" if size < 1024 * _GIB else f"{size / (1024 * _GIB):,.1f} TiB"
    return f"an allocation of {amount} failed"
