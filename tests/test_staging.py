"""The staging of host words for the device: a region refilled and uploaded in place, or refused whole."""

import numpy as np
import pytest
import torch

from executor_svc.staging import Staging, upload_once


def test_put_uploads_the_words_at_the_regions_fixed_address() -> None:
    staging = Staging({"a": 4, "b": 8}, torch.device("cpu"), torch.int64)
    first = staging.put("b", np.array([5, 6, 7], dtype=np.int64))
    second = staging.put("b", np.array([9], dtype=np.int64))
    assert first.tolist() == [9, 6, 7] and second.tolist() == [9]  # the same words, refilled
    assert second.data_ptr() == staging.device("b").data_ptr()
    assert staging.device("a").tolist() == [0, 0, 0, 0]


def test_put_refuses_more_words_than_the_region_holds_and_changes_nothing() -> None:
    staging = Staging({"a": 2}, torch.device("cpu"), torch.int64)
    with pytest.raises(ValueError, match="3 words do not fit the a staging of 2"):
        staging.put("a", np.arange(3, dtype=np.int64))
    assert staging.device("a").tolist() == [0, 0]


def test_upload_once_gives_the_words_a_buffer_of_their_own() -> None:
    words = np.arange(5, dtype=np.int64)
    assert upload_once(words, torch.device("cpu")).tolist() == [0, 1, 2, 3, 4]
