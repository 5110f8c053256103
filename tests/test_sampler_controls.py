"""The device sampler's controls (executor_svc/sampler_controls.py) against a plain torch reference of the
same rules (vLLM's repetition penalty, OpenAI's frequency/presence penalties and logit bias), min_tokens,
min-p and the logprob table, on the CPU."""

from __future__ import annotations

import numpy as np
import torch

from executor_svc.control_writes import ControlWrites
from executor_svc.sampler import sample
from executor_svc.sampler_controls import SamplerControls, logprob_table, sample_controlled

VOCAB, SLOTS = 12, 4


def controls_for(
    slot,
    *,
    min_p=0.0,
    rep=1.0,
    freq=0.0,
    pres=0.0,
    bias=(),
    prompt=(),
    output=(),
    stop=(),
    min_tokens=0,
    top=-1,
):
    controls = SamplerControls(SLOTS, VOCAB, torch.device("cpu"))
    bias_ids = [token for token, _ in bias]
    writes = ControlWrites(
        np.array([slot], np.int32),
        np.array([[min_p, rep, freq, pres]], np.float32),
        np.array([[min_tokens, len(output), top, len(bias), len(prompt), len(output), len(stop)]], np.int32),
        np.array([*bias_ids, *prompt, *output, *stop], np.int32),
        np.array([b for _, b in bias], np.float32),
        [None],
    )
    controls.write(np.array([1, 2, 3], np.int32), torch.tensor([1, 2, 3], dtype=torch.int32), writes)
    return controls


def reference(logits, *, rep, freq, pres, bias, prompt, output):
    """vLLM/OpenAI: bias added, then the repetition penalty on tokens of the prompt or output (a positive
    logit divided by it, a negative one multiplied), then -freq * count - pres * (count > 0)."""
    logits = logits.clone()
    for token, value in bias:
        logits[token] += value
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
    for token in set(output):
        count = output.count(token)
        logits[token] -= freq * count + pres
    return logits


def test_penalties_and_bias_match_the_reference_and_other_rows_are_untouched():
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 3
    rule = dict(rep=1.3, freq=0.4, pres=0.7, bias=[(5, 2.5), (0, -100.0)], prompt=[1, 2, 3], output=[3, 4, 4])
    controls = controls_for(2, **rule)
    slots = torch.tensor([2, 1])  # slot 1 was written whole without controls
    got = controls.apply(logits, slots)
    torch.testing.assert_close(got[0], reference(logits[0], **rule))
    torch.testing.assert_close(got[1], logits[1])
    # The step counts its input (the last output) itself: one more 4 and a 7.
    controls.count_inputs(torch.tensor([2, 0]), torch.tensor([4, 9]))
    controls.count_inputs(torch.tensor([2, 0]), torch.tensor([7, 9]))
    counted = dict(rule, output=[3, 4, 4, 4, 7])
    torch.testing.assert_close(controls.apply(logits, slots)[0], reference(logits[0], **counted))
    assert int(controls.generated[2]) == 5 and int(controls.counts[0].sum()) == 0  # the sink counts nothing


def test_min_tokens_masks_the_stop_ids_until_reached():
    controls = controls_for(1, stop=[0, 7], min_tokens=2)
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 10.0  # the stop token is the best
    slot = torch.tensor([1])
    params = (
        torch.zeros(1),
        torch.ones(1),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int64),
    )
    tokens, _ = sample_controlled(logits, params, controls, slot, torch.zeros(1, dtype=torch.int64))
    assert int(tokens[0]) != 7 and torch.isinf(controls.apply(logits, slot)[0, [0, 7]]).all()
    controls.count_inputs(slot, tokens)
    controls.count_inputs(slot, tokens)  # two outputs: min_tokens reached
    tokens, _ = sample_controlled(logits, params, controls, slot, torch.zeros(1, dtype=torch.int64))
    assert int(tokens[0]) == 7


def test_logits_in_the_heads_bfloat16_sample_as_their_float32_copy():
    """A GPU model hands over logits in the head's dtype: penalties, bias, the draw and the logprob tables run on
    their float32 copy, so they equal those of float32 logits holding the same values."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    slot = torch.tensor([1])
    for temperature in (0.0, 0.8):
        params = (
            torch.full((1,), temperature),
            torch.full((1,), 0.9),
            torch.zeros(1, dtype=torch.int32),
            torch.full((1,), 11, dtype=torch.int64),
        )
        got, wanted = (
            sample_controlled(
                x,
                params,
                controls_for(1, rep=1.3, pres=0.5, bias=[(2, 1.5)], prompt=[2, 3], output=[4], top=3),
                slot,
                torch.tensor([6]),
            )
            for x in (logits, logits.float())
        )
        assert torch.equal(got[0], wanted[0]) and torch.equal(got[1], wanted[1])
        assert got[1].dtype == torch.float32


def test_min_p_keeps_only_tokens_near_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = set()
    for counter in range(200):
        args = (torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.tensor([3]))
        kept.add(int(sample(logits, *args, torch.tensor([counter]), min_p=torch.tensor([0.5]))[0]))
    assert kept == {0, 1}  # 0.15 < 0.5 * 0.5


def test_a_slot_written_again_without_controls_keeps_no_min_p():
    """A request without controls in a slot a min_p request held, sampled beside a row with controls (so through
    sample_controlled): it draws from every token, as alone. The old min_p used to stay on the slot and cut its
    draws to the best token."""
    controls = controls_for(1, min_p=1.0)
    controls.write(
        np.array([1], np.int32), torch.tensor([1], dtype=torch.int32), None
    )  # a new request, no controls
    controls.write(*_one_slot_with_controls(2))
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 0.5  # token 0 is the best, the others close behind
    slots = torch.tensor([1, 2])
    drawn = set()
    for counter in range(100):
        params = (torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.tensor([3, 4]))
        tokens, _ = sample_controlled(logits, params, controls, slots, torch.tensor([counter, counter]))
        drawn.add(int(tokens[0]))
    assert len(drawn) > 1, "the slot's new request sampled with the old request's min_p"


def _one_slot_with_controls(slot: int) -> tuple[np.ndarray, torch.Tensor, ControlWrites]:
    """A plan's writes of one slot with a control (a presence penalty) that leaves its logits as they are."""
    writes = ControlWrites(
        np.array([slot], np.int32),
        np.array([[0.0, 1.0, 0.0, 0.0]], np.float32),
        np.array([[0, 0, 0, 0, 0, 0, 0]], np.int32),
        np.zeros(0, np.int32),
        np.zeros(0, np.float32),
        [None],
    )
    return np.array([slot], np.int32), torch.tensor([slot], dtype=torch.int32), writes


def test_logprob_table_is_log_softmax_of_the_logits_with_the_top_ids():
    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    tokens = torch.tensor([5, 0, 63])
    table = logprob_table(logits, tokens)
    expected = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(table[:, 0], expected.gather(1, tokens[:, None])[:, 0])
    top = expected.topk(20)
    torch.testing.assert_close(table[:, 1:21], top.values)
    assert torch.equal(table[:, 21:].long(), top.indices)


def test_the_tables_bytes_are_logged_with_the_kv_pool():
    from structlog.testing import capture_logs

    from executor_svc.kv_pool import KVPool, log_tables
    from executor_svc.slot_store import SlotStore
    from protos.layout import RowLayout

    layout = RowLayout.build([1, 2], 64, 16, 8)
    store = SlotStore(layout, torch.device("cpu"), 1000)
    slots = layout.slots
    per_slot = 1 + 4 * 4 + 2 * 4 + 4 * -(-1000 // 32)  # on, four floats, two ints, the grammar bits
    assert store.controls.nbytes == 10 * slots * 1000 + per_slot * slots + 8 * 1000  # + the token ids
    with capture_logs() as logs:
        log_tables(KVPool(2, 8, 16, 2, 8, torch.float32, "cpu"), store)
    assert logs[0]["event"] == (
        f"KV pool: 8 pages of 16 tokens, 0.0 MiB; sampler controls: {slots} slots x 1000 tokens, "
        f"{store.controls.nbytes / 2**20:.1f} MiB"
    )
