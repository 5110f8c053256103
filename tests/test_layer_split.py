"""The pure parts of a layer split: ranges, the group's description and outputs, `up`'s stage plan, and the
weights a stage keeps; and that `up`'s stage key file never outlives a failed start."""

from __future__ import annotations

import tempfile

import pytest
import torch

from deltaserve.stages import StagePlan, plan_stages, stage_argv, stage_processes
from deltaserve.trust import Trust
from executor_svc.config import ExecutorConfig
from executor_svc.models.loader import stage_weights
from planner_svc.group_link import describe_group, merge_outputs
from planner_svc.link import LinkLost
from protos import executor_pb2
from protos.layer_split import LayerRange, check_stages, parse_layers, split_layers
from protos.rpc import ChannelSecurity


def test_even_splits_give_the_first_stages_the_extra_layers():
    assert split_layers(30, "2") == [(0, 15), (15, 30)]
    assert split_layers(30, "4") == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(30, "1") == [(0, 30)]
    assert split_layers(30, "10,20") == [(0, 10), (10, 20), (20, 30)]


@pytest.mark.parametrize(
    "split, fragment",
    [
        ("0", "need 1 to 30"),
        ("31", "need 1 to 30"),
        ("20,10", "ascend"),
        ("10,30", "ascend"),
        ("a", "N stages"),
    ],
)
def test_bad_splits_say_why(split, fragment):
    with pytest.raises(ValueError, match=fragment):
        split_layers(30, split)


def test_layer_ranges_and_their_ends():
    assert parse_layers("13:30") == (13, 30)
    for bad in ("13", "a:b", "5:5", "-1:3"):
        with pytest.raises(ValueError):
            parse_layers(bad)
    middle = LayerRange(7, 19, 30)
    assert (middle.first, middle.last, middle.count) == (False, False, 12)
    assert LayerRange.whole(30).first and LayerRange.whole(30).last
    with pytest.raises(ValueError, match="non-empty range"):
        LayerRange(20, 31, 30)


@pytest.mark.parametrize(
    "begin, end, tied, embedding, head",
    [
        (0, 30, False, True, True),
        (0, 30, True, True, False),
        (0, 10, True, True, False),
        (10, 20, True, False, False),
        (20, 30, True, True, False),  # a tied head is the embedding
        (20, 30, False, False, True),
    ],
)
def test_the_ends_a_stage_holds(begin, end, tied, embedding, head):
    held = LayerRange(begin, end, 30)
    assert (held.holds_embedding(tied), held.holds_head(tied)) == (embedding, head)


def test_a_group_must_hold_every_layer_once_in_rank_order():
    check_stages([(0, 7), (7, 19), (19, 30)], 30)
    with pytest.raises(ValueError, match="stage 1 holds layers 8:19; expected it to start at 7"):
        check_stages([(0, 7), (8, 19), (19, 30)], 30)
    with pytest.raises(ValueError, match="0:19 of the model's 30"):
        check_stages([(0, 7), (7, 19)], 30)


def describe(begin: int, end: int, **fields) -> executor_pb2.ExecutorDescription:
    base = dict(model_fingerprint="m", num_layers=30, page_size=16, pool_pages=400, slots=17, device="cpu")
    return executor_pb2.ExecutorDescription(layer_begin=begin, layer_end=end, **{**base, **fields})


def test_the_group_describes_itself_as_one_executor():
    group = describe_group([describe(0, 13, pool_pages=900), describe(13, 30, eos_token_ids=[2])])
    assert (group.layer_begin, group.layer_end, group.pool_pages) == (0, 30, 400)
    assert list(group.eos_token_ids) == [2] and group.device == "cpu,cpu"
    with pytest.raises(ValueError, match="stage 1 has page_size 32, stage 0 16"):
        describe_group([describe(0, 13), describe(13, 30, page_size=32)])
    with pytest.raises(ValueError, match="stage 1 has state_slots 9, stage 0 17"):
        describe_group([describe(0, 13, state_slots=17), describe(13, 30, state_slots=9)])
    with pytest.raises(ValueError, match="expected it to start at 13"):
        describe_group([describe(0, 13), describe(14, 30)])
    with pytest.raises(ValueError, match=r"stage 1 has no cache service \(no --cache\), stage 0 a cache"):
        describe_group([describe(0, 13, snapshots=True), describe(13, 30)])
    with pytest.raises(ValueError, match="stage 1 joined another torch.distributed group than stage 0"):
        describe_group([describe(0, 13, stage_group="a1"), describe(13, 30, stage_group="b2")])


def test_outputs_merge_to_the_last_stages_tokens_and_every_stages_mismatches():
    first = executor_pb2.StepOutput(seq=4, tokens=b"", row_mismatches=1, device_wait_us=7)
    last = executor_pb2.StepOutput(seq=4, tokens=b"\x05\x00\x00\x00", row_mismatches=2, device_wait_us=3)
    merged = merge_outputs([first, last])
    assert (merged.seq, merged.tokens, merged.row_mismatches, merged.device_wait_us) == (4, last.tokens, 3, 7)
    with pytest.raises(LinkLost, match="out of step"):
        merge_outputs([first, executor_pb2.StepOutput(seq=5)])


def test_up_places_stages_on_the_local_devices():
    assert plan_stages(30, "3", "cpu", 0) == [
        StagePlan(0, (0, 10), "cpu", "gloo"),
        StagePlan(1, (10, 20), "cpu", "gloo"),
        StagePlan(2, (20, 30), "cpu", "gloo"),
    ]
    two_gpus = plan_stages(30, "2", "cuda", 2)
    assert [(s.device, s.backend) for s in two_gpus] == [("cuda:0", "nccl"), ("cuda:1", "nccl")]
    one_gpu = plan_stages(30, "10,20", "auto", 1)  # stages sharing a GPU: gloo through the host
    assert [(s.device, s.backend) for s in one_gpu] == [("cuda:0", "gloo")] * 3
    with pytest.raises(ValueError, match="one stage"):
        plan_stages(30, "1", "cpu", 0)
    argv = stage_argv(
        ExecutorConfig(device="cpu", cache="127.0.0.1:9", state_slots=9, weights="dequantize"),
        one_gpu[1],
        3,
        5001,
        "127.0.0.1:5000",
        metrics_port=5002,
    )
    joined = " ".join(argv)
    assert (
        "--layers 10:20 --stage-rank 1 --stages 3 --stage-group 127.0.0.1:5000 --stage-backend gloo" in joined
    )
    assert "--device cuda:0" in joined and "--cache 127.0.0.1:9" in joined and "--state-slots 9" in joined
    assert "--weights dequantize" in joined and "--metrics-port 5002" in joined


def test_the_stage_key_file_is_gone_when_a_start_fails_after_writing_it(tmp_path, monkeypatch):
    """`up --layer-split --api-keys` hands its stages its own service key in a file only it reads. A start that
    fails once the file exists (here its write: a key the file cannot encode) removes it before the error
    reaches the caller, not whenever the file object is collected (never, if the process is killed first)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    trust = Trust(executor_link=ChannelSecurity(api_key="service-key-\udc80"))
    with pytest.raises(UnicodeEncodeError) as caught:
        with stage_processes(ExecutorConfig(device="cpu"), "2", trust):
            raise AssertionError("no stage starts")
    # Looked at while the error lives (`caught`): the frame it holds still holds the old code's file object.
    assert list(tmp_path.iterdir()) == [], caught.value


def test_a_stage_keeps_its_layers_renumbered_and_the_ends_it_holds():
    weights = {name: torch.zeros(1) for name in ("embed_tokens.weight", "norm.weight")}
    weights |= {f"layers.{i}.mlp.up_proj.weight": torch.full((1,), float(i)) for i in range(4)}
    middle = stage_weights(weights, LayerRange(1, 3, 4), held=set())
    assert sorted(middle) == ["layers.0.mlp.up_proj.weight", "layers.1.mlp.up_proj.weight"]
    assert middle["layers.1.mlp.up_proj.weight"].item() == 2.0
    last = stage_weights(weights, LayerRange(3, 4, 4), held={"norm.weight", "embed_tokens.weight"})
    assert sorted(last) == ["embed_tokens.weight", "layers.0.mlp.up_proj.weight", "norm.weight"]
