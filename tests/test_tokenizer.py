"""The planner's detokenizer: streamed text, batch by batch, adds up to the whole answer's text."""

from __future__ import annotations

import numpy as np
import pytest

from planner_svc.config import PlannerConfig
from planner_svc.tokenizer import IncrementalDetokenizer
from protos.model_files import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(PlannerConfig().model)


@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_is_the_text_of_all_the_tokens(tokenizer, seed: int):
    rng = np.random.default_rng(seed)
    # Common tokens, special ones (no text) and byte pieces of multi-byte characters, in batches of 1-5.
    ids = rng.integers(0, len(tokenizer), size=300).tolist()
    ids[10:13] = tokenizer.encode("héllo wörld ✓ 日本")[:3]
    ids[40] = tokenizer.eos_token_id
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed, at = [], 0
    while at < len(ids):
        batch = ids[at : at + int(rng.integers(1, 6))]
        streamed.append(detokenizer.add(batch))
        at += len(batch)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    # Text held back for an unfinished character comes out once it is complete, or never when the
    # answer ends inside one (the whole text shows a replacement character there).
    assert "".join(streamed) == whole.removesuffix("\ufffd")
