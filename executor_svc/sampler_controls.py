"""Per-slot sampling controls on the device (DESIGN §9): min-p, the repetition, frequency and presence
penalties with the token counts they work from (which the decode step updates itself), logit bias, min_tokens
with its stop ids, and which rows return logprobs. A slot's controls are written whole with its sampler
state; a steady step stages nothing for them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from executor_svc.control_writes import TOP_LOGPROBS, ControlWrites
from executor_svc.sampler import sample

LOGPROB_COLUMNS = 1 + 2 * TOP_LOGPROBS  # the chosen token's logprob, the top ones', their ids (as float32)


class SamplerControls:
    """`on[S]` says which slots have any control (the others are left as the model's logits); its host copy
    lets a step whose rows have none run the variant without this work at all."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # The step's work in Triton kernels (executor_svc/kernels/controls.py); tests set it under the interpreter.
        self.fused = device.type == "cuda"
        self.on = torch.zeros(slots, dtype=torch.bool, device=device)
        self.min_p = torch.zeros(slots, dtype=torch.float32, device=device)
        self.repetition = torch.ones(slots, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(slots, dtype=torch.float32, device=device)
        self.presence = torch.zeros(slots, dtype=torch.float32, device=device)
        self.min_tokens = torch.zeros(slots, dtype=torch.int32, device=device)
        self.generated = torch.zeros(slots, dtype=torch.int32, device=device)  # outputs counted so far
        self.counts = torch.zeros(
            slots, vocab_size, dtype=torch.int32, device=device
        )  # output counts: [S, V]
        self.seen = torch.zeros(
            slots, vocab_size, dtype=torch.bool, device=device
        )  # prompt or output: [S, V]
        self.bias = torch.zeros(slots, vocab_size, dtype=torch.float32, device=device)  # [S, V]
        self.stop = torch.zeros(slots, vocab_size, dtype=torch.bool, device=device)  # masked early: [S, V]
        # Structured output: the tokens a slot's grammar allows next, 32 a word (xgrammar's layout; all bits
        # set for a slot without one), filled on the host by grammars.py before each step that reads it.
        words = -(-vocab_size // 32)
        self.grammar_mask = torch.full(
            (slots, words), -1, dtype=torch.int32, device=device
        )  # [S, ceil(V/32)]
        self._bit = torch.arange(vocab_size, device=device)  # token ids: which word and bit hold each
        self._host_on = np.zeros(slots, dtype=bool)
        self._host_logprobs = np.zeros(slots, dtype=bool)  # by slot: returns logprobs

    @property
    def nbytes(self) -> int:
        """Device bytes of the tables, mostly the [S, V] ones: 10 B a slot and token (+ the grammar bits)."""
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))

    # --- the host's view: which variant a step runs, which rows return logprobs ---------------------------

    def any_on(self, slots: np.ndarray) -> bool:
        return bool(self._host_on[slots].any())

    def logprob_rows(self, slots: np.ndarray) -> np.ndarray:
        """bool[len(slots)]: which of `slots` return logprobs."""
        return self._host_logprobs[slots]

    # --- writes (a plan, applied) ---------------------------------------------------------------------

    def write(
        self, sampler_slots: np.ndarray, device_slots: torch.Tensor, writes: ControlWrites | None
    ) -> None:
        """Every slot written whole loses its controls, but those `writes` names, written whole.
        `device_slots`: `sampler_slots` already on the device (the slot store's upload of them); a copy from
        the host here would synchronize the stream, holding every step that writes a row until the steps
        launched before it end."""
        self._host_on[sampler_slots] = False
        self._host_logprobs[sampler_slots] = False
        self.on.index_fill_(0, device_slots.long(), False)
        if writes is None:
            return
        at, bias_at = 0, 0
        for row, slot in enumerate(writes.slots.tolist()):
            min_tokens, generated, top_logprobs, n_bias, n_prompt, n_output, n_stop = writes.i32[row].tolist()
            lists = torch.from_numpy(
                writes.tokens[at : at + n_bias + n_prompt + n_output + n_stop].astype(np.int64)
            )
            lists = lists.to(self.device)
            bias_ids, prompt, output, stop = lists.split([n_bias, n_prompt, n_output, n_stop])
            at += n_bias + n_prompt + n_output + n_stop
            values = torch.from_numpy(writes.bias[bias_at : bias_at + n_bias].copy()).to(self.device)
            bias_at += n_bias
            for table in (self.counts, self.seen, self.bias, self.stop):
                table[slot].zero_()
            self.bias[slot].index_put_((bias_ids,), values, accumulate=True)
            self.counts[slot].index_put_(
                (output,), torch.ones_like(output, dtype=torch.int32), accumulate=True
            )
            self.seen[slot, prompt] = True
            self.seen[slot, output] = True
            self.stop[slot, stop] = True
            self.grammar_mask[slot] = -1  # grammars.py fills it where the slot has a grammar
            floats = torch.from_numpy(writes.f32[row].copy()).to(self.device)
            self.min_p[slot], self.repetition[slot], self.frequency[slot], self.presence[slot] = floats
            self.min_tokens[slot], self.generated[slot] = min_tokens, generated
            self.on[slot] = True
            self._host_on[slot] = True
            self._host_logprobs[slot] = top_logprobs >= 0

    # --- the step's own work (inside the graphs: fixed shapes, nothing read back) ----------------------------

    def count_inputs(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """A decode step's inputs are its rows' latest outputs (the loop-back tokens): count them for the rows
        with controls (padding rows read the sink slot, which has none)."""
        if self.fused:
            from executor_svc.kernels.controls import count_inputs

            count_inputs(slots, tokens, self.on, self.counts, self.seen, self.generated)
            return
        on = self.on[slots]
        self.counts.index_put_((slots, tokens), on.to(torch.int32), accumulate=True)
        self.seen.index_put_((slots, tokens), self.seen[slots, tokens] | on)
        self.generated.index_put_((slots,), on.to(torch.int32), accumulate=True)

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The rows' logits f32[B, V] after logit bias, the penalties (vLLM's and OpenAI's rules), the stop
        ids' mask below min_tokens and the grammar's mask; rows without controls as they were."""
        if not self.fused:
            return self._apply_torch(logits, slots)
        from executor_svc.kernels.controls import adjust_logits

        tables = (self.bias, self.seen, self.counts, self.stop, self.grammar_mask)
        scalars = (self.repetition, self.frequency, self.presence, self.generated, self.min_tokens)
        return adjust_logits(logits, slots, self.on, tables, scalars)

    def _apply_torch(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """apply's reference, and its form on the CPU."""
        adjusted = logits + self.bias[slots]
        repetition = self.repetition[slots][:, None]
        penalized = torch.where(adjusted > 0, adjusted / repetition, adjusted * repetition)
        adjusted = torch.where(self.seen[slots], penalized, adjusted)
        counts = self.counts[slots].to(torch.float32)
        adjusted = adjusted - self.frequency[slots][:, None] * counts
        adjusted = adjusted - self.presence[slots][:, None] * (counts > 0).to(torch.float32)
        early = (self.generated[slots] < self.min_tokens[slots])[:, None]
        adjusted = adjusted.masked_fill(self.stop[slots] & early, float("-inf"))
        words = self.grammar_mask[slots][:, self._bit >> 5]  # words: [B, V]
        allowed = ((words >> (self._bit & 31)) & 1).to(torch.bool)
        adjusted = adjusted.masked_fill(~allowed, float("-inf"))
        return torch.where(self.on[slots][:, None], adjusted, logits)


def logprob_table(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """f32[B, LOGPROB_COLUMNS]: each row's chosen token's log_softmax of the model's `logits`, then the
    TOP_LOGPROBS most likely tokens' (padded with -inf past the vocabulary), then their ids as float32
    (exact below 2**24)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    k = min(TOP_LOGPROBS, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1)
    pad = TOP_LOGPROBS - k
    values = torch.nn.functional.pad(top.values, (0, pad), value=float("-inf"))
    ids = torch.nn.functional.pad(top.indices.to(torch.float32), (0, pad))
    return torch.cat([logprobs.gather(1, tokens[:, None]), values, ids], dim=1)


def sample_controlled(
    logits: torch.Tensor,
    params: Sequence[torch.Tensor],
    controls: SamplerControls,
    slots: torch.Tensor,
    counter: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens i64[B] of rows that may have controls (greedy rows take the argmax of the adjusted logits),
    and every row's logprob table f32[B, LOGPROB_COLUMNS] of the model's own logits."""
    logits = logits.float()  # the head's dtype (bfloat16 on a GPU): the tables are of float32 logits
    adjusted = controls.apply(logits, slots)
    temperature, top_p, top_k, seed = params
    # min_p as every control, read where the slot's controls are on: a slot's last request's stays behind
    min_p = torch.where(controls.on[slots], controls.min_p[slots], 0.0)
    tokens = sample(adjusted, temperature, top_p, top_k, seed, counter, min_p=min_p)
    if controls.fused:
        from executor_svc.kernels.controls import fused_logprob_table

        return tokens, fused_logprob_table(logits, tokens, TOP_LOGPROBS)
    return tokens, logprob_table(logits, tokens)
