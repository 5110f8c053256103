"""The step runner's tests' tiny random Llama, its runner (row check on) and a script of plans: two sequences
prefilled (one in two chunks) then decoded, each also run alone through the model and the sampler for
reference."""

from __future__ import annotations

import numpy as np
import torch

from executor_svc.models.dense import DenseModel
from executor_svc.runner import StepRunner
from executor_svc.sampler import sample
from executor_svc.slot_store import SlotStore
from protos import executor_pb2
from protos.layout import RowLayout
from protos.wire import pack_f32, pack_i32, unpack_i32
from tests.conftest import decode_logits, prefill_logits, tiny_llama_config

PAGE = 4
POOL_PAGES = 32
BUCKETS = (1, 2, 4)
TINY = tiny_llama_config()
LAYOUT = RowLayout.build(list(BUCKETS), TINY.max_seq_len, PAGE, POOL_PAGES)  # 9 slots of 3 + 16 columns
KV_LEN, BLOCK_TABLE = RowLayout.KV_LEN, RowLayout.BLOCK_TABLE


def tiny_model(seed: int = 0, device: str = "cpu") -> DenseModel:
    """Random weights drawn on the CPU, so every device gets the same model."""
    model = DenseModel(TINY, device=device, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model


def tiny_runner(model: DenseModel) -> StepRunner:
    """A runner with the row check on, over a fresh KV pool and slot store."""
    store = SlotStore(LAYOUT, model.device, model.config.vocab_size)
    kv = model.make_kv_pool(POOL_PAGES, PAGE)
    return StepRunner(model, kv, store, LAYOUT, True, buckets=BUCKETS, fingerprint="tiny")


def whole_row(kv_len: int, pages: list[int]) -> list[int]:
    return [kv_len, 0, 0, *pages]


def as_i32(value: int) -> int:
    """A uint32 as the int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def pack_runs(*rows: tuple[int, list[int]]) -> bytes:
    return pack_i32([v for slot, cells in rows for v in (slot, 0, len(cells), *cells)])


def sampler_fields(rows: list[tuple[int, float, float, int, int]]) -> dict[str, bytes]:
    """rows: (slot, temperature, top_p, top_k, seed); the loop-back token is kept (-1)."""
    return dict(
        sampler_slots=pack_i32([r[0] for r in rows]),
        sampler_f32=pack_f32([(r[1], r[2]) for r in rows]),
        sampler_i32=pack_i32(
            [(r[3], as_i32(r[4] & 0xFFFFFFFF), as_i32(r[4] >> 32 & 0xFFFFFFFF), -1) for r in rows]
        ),
    )


def prefill_chunk(
    ids: list[int], start: int, pages: list[int], sample_slot: int
) -> executor_pb2.PrefillChunk:
    return executor_pb2.PrefillChunk(
        token_ids=pack_i32(ids), start=start, pages=pack_i32(pages), sample_slot=sample_slot
    )


# Two sequences: A (slot 1, greedy) prefills in one chunk; B (slot 2, seeded) in two chunks over two steps.
PROMPT_A = [5, 17, 3, 40, 22, 9]
PROMPT_B = [1, 33, 7, 7, 60, 12, 45, 2, 30]
PAGES_A = [3, 4, 5, 6]
PAGES_B = [10, 11, 12, 13, 14]
SAMPLING_A = (1, 0.0, 1.0, 0, 0)
SAMPLING_B = (2, 0.9, 0.95, 20, 1234)
DECODE_STEPS = 5


def decode_pages(kv_len: int, pages: list[int]) -> list[int]:
    """The pages a row holds before decoding at kv_len: those covering [0, kv_len + 1)."""
    return pages[: kv_len // PAGE + 1]


def scripted_plans(slots: list[int]) -> list[executor_pb2.StepPlan]:
    """Prefill A and B, then decode steps over `slots` (A at slot 1, B at slot 2, zeros pad).

    Rows go whole at the first decode step, holding only the pages they need; each page crossing
    after that is a run of one cell.
    """
    bucket = len(slots)
    plans = [
        executor_pb2.StepPlan(
            seq=1,
            prefill=[
                prefill_chunk(PROMPT_A, 0, PAGES_A[:2], 1),
                prefill_chunk(PROMPT_B[:5], 0, PAGES_B[:2], 0),
            ],
            **sampler_fields([SAMPLING_A, SAMPLING_B]),
        ),
        executor_pb2.StepPlan(seq=2, prefill=[prefill_chunk(PROMPT_B[5:], 5, PAGES_B[:3], 2)]),
    ]
    lens = {1: len(PROMPT_A), 2: len(PROMPT_B)}
    pages = {1: PAGES_A, 2: PAGES_B}
    for step in range(DECODE_STEPS):
        plan = executor_pb2.StepPlan(seq=3 + step, bucket=bucket)
        if step == 0:
            plan.slots = pack_i32(slots)
            plan.row_runs = pack_runs(
                *((s, whole_row(lens[s], decode_pages(lens[s], pages[s]))) for s in (1, 2))
            )
        else:
            crossings = [
                (s, BLOCK_TABLE + lens[s] // PAGE, pages[s][lens[s] // PAGE])
                for s in (1, 2)
                if lens[s] % PAGE == 0
            ]
            if crossings:
                plan.row_runs = pack_i32([v for slot, col, page in crossings for v in (slot, col, 1, page)])
        mirror = np.zeros((bucket, LAYOUT.columns), dtype=np.int32)
        for row, slot in enumerate(slots):
            if slot:
                held = decode_pages(lens[slot], pages[slot])
                mirror[row, : RowLayout.NARROW + len(held)] = whole_row(lens[slot], held)
        plan.mirror = mirror.tobytes()
        plans.append(plan)
        lens = {s: n + 1 for s, n in lens.items()}
    return plans


def reference_tokens(model: DenseModel) -> dict[int, list[int]]:
    """Each sequence on its own through the model and the sampler, batch of one."""
    kv = model.make_kv_pool(POOL_PAGES, PAGE)
    device = model.device
    out = {}
    for (slot, temperature, top_p, top_k, seed), prompt, pages in (
        (SAMPLING_A, PROMPT_A, PAGES_A),
        (SAMPLING_B, PROMPT_B, PAGES_B),
    ):
        params = (
            torch.tensor([temperature], device=device),
            torch.tensor([top_p], device=device),
            torch.tensor([top_k], dtype=torch.int32, device=device),
            torch.tensor([seed], device=device),
        )
        ids, page_ids = (
            torch.tensor(prompt, device=device),
            torch.tensor(pages, dtype=torch.int32, device=device),
        )
        logits = prefill_logits(model, kv, ids, 0, page_ids)
        tokens = [int(sample(logits[None], *params, torch.tensor([len(prompt)], device=device)))]
        table = torch.zeros(1, LAYOUT.block_span, dtype=torch.int32, device=device)
        table[0, : len(pages)] = page_ids
        for step in range(DECODE_STEPS):
            position = torch.tensor([len(prompt) + step], device=device)
            logits = decode_logits(
                model,
                kv,
                torch.tensor([tokens[-1]], device=device),
                position,
                position.to(torch.int32),
                table,
            )
            tokens.append(int(sample(logits, *params, position + 1)))
        out[slot] = tokens
    return out


def without_timing(outputs: list[executor_pb2.StepOutput]) -> list[executor_pb2.StepOutput]:
    """The outputs less what the device's timing decides (device_wait_us), to compare two runs."""
    bare = [executor_pb2.StepOutput.FromString(output.SerializeToString()) for output in outputs]
    for output in bare:
        output.ClearField("device_wait_us")
    return bare


def run_script(runner: StepRunner, slots: list[int]) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {1: [], 2: []}
    for plan in scripted_plans(slots):
        output = runner.run(plan)
        assert output.seq == plan.seq
        assert output.row_mismatches == 0
        for chunk, token in zip(plan.prefill, unpack_i32(output.prefill_tokens), strict=True):
            if chunk.sample_slot:
                got[chunk.sample_slot].append(int(token))
            else:
                assert token == -1
        tokens = unpack_i32(output.tokens)
        assert len(tokens) == plan.bucket
        for row, slot in enumerate(slots if plan.bucket else []):
            if slot:
                got[slot].append(int(tokens[row]))
    return got


def steady_from_written_rows(runner: StepRunner) -> int:
    """Prefill A and B, then a decode step writing both rows whole with every page they can write (bucket 2);
    returns the next seq."""
    for plan in scripted_plans([1, 2])[:2]:
        runner.run(plan)
    lens = {1: len(PROMPT_A), 2: len(PROMPT_B)}
    rows = ((1, whole_row(lens[1], PAGES_A)), (2, whole_row(lens[2], PAGES_B)))
    runner.run(executor_pb2.StepPlan(seq=3, bucket=2, slots=pack_i32([1, 2]), row_runs=pack_runs(*rows)))
    return 4
