"""Progress of long prompts being read: the planner logs one `prefill` line when a prompt with THRESHOLD tokens
or more to read starts its prefill, one every INTERVAL_S while it is read, and one when its last chunk is
planned, so an 8,000-token prompt on a CPU is not a silent minute. The state rides on the request."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog

from planner_svc.requests import PrefillRead, Request

if TYPE_CHECKING:
    from planner_svc.scheduler import PrefillChunk

log = structlog.get_logger("deltaserve.planner.prefill")

THRESHOLD = 1024
INTERVAL_S = 5.0


def progress_line(
    request: Request,
    start: int,
    end: int,
    now: float,
    threshold: int = THRESHOLD,
    interval_s: float = INTERVAL_S,
) -> dict[str, object] | None:
    """Chunk [start, end) of the request's prompt planned at `now`: a log line's fields, or None. `read`
    counts the tokens planned before the chunk (done, or one step from it)."""
    total, reading = request.prompt_len, request.prefill_read
    if reading is None:
        if total - start < threshold:
            return None
        reading = request.prefill_read = PrefillRead(now, start, now)
        return {"request_id": request.request_id, "read": start, "of": total, "state": "started"}
    if end == total:
        request.prefill_read = None
        elapsed = now - reading.began
        return {
            "request_id": request.request_id,
            "read": end,
            "of": total,
            "state": "last chunk",
            "seconds": round(elapsed, 1),
            "tokens_per_s": round((end - reading.first) / elapsed) if elapsed > 0 else 0,
        }
    if now - reading.shown < interval_s:
        return None
    reading.shown = now
    return {"request_id": request.request_id, "read": start, "of": total, "state": "reading"}


def log_prefill_progress(chunks: Iterable[PrefillChunk]) -> None:
    now = time.monotonic()
    for chunk in chunks:
        end = chunk.start + len(chunk.token_ids) // 4  # int32 token ids
        line = progress_line(chunk.request, chunk.start, end, now)
        if line is not None:
            log.info("prefill", **line)
