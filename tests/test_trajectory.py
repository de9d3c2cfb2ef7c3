"""The data contract: validation names field and index; Atropos conversion is lossless;
the API's fast validator accepts exactly what the pydantic model accepts."""

import math

import orjson
import pytest
from conftest import make_group
from pydantic import ValidationError

from environments.api.wire import WireError, decode_group
from environments.trajectory import ScoredData, ScoredGroup, ScoredTrajectory


def base(**changes):
    t = {"tokens": [5, 6, 7, 8, 9], "masks": [-100, -100, 7, 8, 9], "scores": 1.0,
         "inference_logprobs": [1.0, 1.0, -0.1, -0.2, -0.3]}
    t.update(changes)
    return t


@pytest.mark.parametrize("changes, message", [
    ({"masks": [-100, 7, 8, 9]}, "masks: length 4 does not match tokens (5)"),
    ({"inference_logprobs": [1.0]}, "inference_logprobs: length 1 does not match tokens (5)"),
    ({"masks": [-100, -100, 7, 3, 9]}, "masks[3]: is 3; must be -100 or the token id 8"),
    ({"scores": [0.5, 1.0], "turn_spans": [[2, 4]]}, "turn_spans: 1 spans for 2 turn scores"),
    ({"scores": [0.5], "turn_spans": [[2, 6]]}, "turn_spans[0]: [2, 6) is empty or outside the 5 tokens"),
    ({"scores": [0.5, 1.0], "turn_spans": [[2, 4], [3, 5]]}, "turn_spans[1]: starts at 3, before the previous turn ends (4)"),
    ({"scores": [0.5, 1.0], "turn_spans": [[3, 5], [2, 3]]}, "turn_spans[1]: starts at 2, before the previous turn ends (5)"),
    ({"scores": [0.5]}, "turn_spans: required when scores are given per turn"),
    ({"scores": math.nan}, "finite"),
    ({"inference_logprobs": [1.0, 1.0, -math.inf, -0.2, -0.3]}, "finite"),
    ({"tokens": [], "masks": [], "inference_logprobs": []}, "tokens: must not be empty"),
    # segment starts: inside (0, n), strictly increasing, between turns, on a masked token
    ({"segment_starts": [5]}, "segment_starts[0]: 5 is not inside the 5 tokens"),
    ({"segment_starts": [0]}, "segment_starts[0]: 0 is not inside the 5 tokens"),
    ({"masks": [-100, -100, 7, -100, 9], "segment_starts": [3, 1]},
     "segment_starts[1]: 1 does not come after the previous segment start (3)"),
    ({"masks": [-100, -100, 7, -100, 9], "segment_starts": [3, 3]},
     "segment_starts[1]: 3 does not come after the previous segment start (3)"),
    ({"masks": [-100, -100, 7, -100, 9], "scores": [1.0], "turn_spans": [[2, 5]],
      "segment_starts": [3]}, "segment_starts[0]: 3 falls inside turn_spans[0] [2, 5)"),
    ({"segment_starts": [3]}, "segment_starts[0]: token 3 begins a new context, so nothing "
                              "predicts it; it must be masked (-100), but masks[3] is 8"),
])
def test_trajectory_validation_names_field_and_index(changes, message):
    with pytest.raises(ValidationError) as error:
        ScoredTrajectory(**base(**changes))
    assert message in str(error.value)


def segmented_group() -> ScoredGroup:
    """Two members; the first rebuilt its context at token 5 (a second prompt, turn 1)."""
    return ScoredGroup(group_id="seg", trajectories=[
        ScoredTrajectory(tokens=[1, 2, 3, 4, 9, 5, 6, 7],
                         masks=[-100, -100, 3, 4, -100, -100, 6, 7],
                         inference_logprobs=[1.0, 1.0, -0.1, -0.2, 1.0, 1.0, -0.3, -0.4],
                         scores=[0.5, 1.0], turn_spans=[[2, 4], [6, 8]], segment_starts=[4]),
        ScoredTrajectory(tokens=[1, 2, 3, 4], masks=[-100, -100, 3, 4],
                         inference_logprobs=[1.0, 1.0, -0.1, -0.2], scores=[0.0],
                         turn_spans=[[2, 4]]),
    ])


def test_segment_starts_are_accepted_and_round_trip():
    group = segmented_group()
    wire = group.to_scored_data()
    assert wire.segment_starts == [[4], None]
    raw = wire.model_dump_json().encode()
    decode_group(raw)  # the rollout API's fast validator accepts it
    assert ScoredGroup.from_scored_data(orjson.loads(raw)) == group
    body = orjson.loads(raw)
    body["segment_starts"] = [[4], [3]]  # inside the only turn of sequence 1
    with pytest.raises(WireError) as error:
        decode_group(orjson.dumps(body))
    assert error.value.field == "segment_starts[1][0]"
    assert "3 falls inside turn_spans[1][0] [2, 4)" in error.value.message


def test_group_errors_name_the_sequence():
    group = make_group(3).to_scored_data().model_dump()
    group["masks"][2] = group["masks"][2][:-1]
    with pytest.raises(ValidationError, match=r"masks\[2\]: length 5 does not match tokens\[2\] \(6\)"):
        ScoredData.model_validate(group)
    group = make_group(3).to_scored_data().model_dump()
    group["scores"] = group["scores"][:2]
    with pytest.raises(ValidationError, match="scores: has 2 entries for 3 sequences"):
        ScoredData.model_validate(group)


def test_round_trip_through_atropos_form_is_lossless():
    group = make_group(3, turn_scores=True, policy_version=4, env_id=1)
    group.trajectories[1].messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
        {"role": "assistant", "content": "4", "reward": 1.0},
    ]
    for t in group.trajectories:
        t.messages = t.messages or [{"role": "user", "content": "x"}]
    group.trajectories[0].flags.truncated = True
    group.trajectories[2].metadata = {"answer": 4}
    group.trajectories[2].turn_policy_versions = [4, 5]
    group.item_id = "item-7"
    group.metadata = {"split": "train"}

    wire = group.to_scored_data()
    # Atropos consumers see one float per sequence: the outcome (the last turn's score).
    assert wire.scores == [t.outcome for t in group.trajectories] == [0.0, 1.0, 2.0]
    assert wire.turn_scores == [[0.5, 0.0], [0.5, 1.0], [0.5, 2.0]]
    back = ScoredGroup.from_scored_data(orjson.loads(wire.model_dump_json()))
    assert back == group
    assert back.policy_version == 4


def test_plain_atropos_scored_data_round_trips():
    atropos = {"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]],
               "scores": [1.0, -1.0], "advantages": None, "ref_logprobs": None,
               "messages": [[{"role": "user", "content": "hi"}]] * 2,
               "generation_params": {"temperature": 1.0}, "inference_logprobs": None,
               "overrides": [{"set_advantage_to_zero": True}, {}], "group_overrides": None,
               "images": None, "env_id": 3}
    group = ScoredGroup.from_scored_data(atropos)
    assert [t.scores for t in group.trajectories] == [1.0, -1.0]
    again = group.to_scored_data().model_dump()
    for key, value in atropos.items():
        if key != "messages":
            assert again[key] == value, key
    assert again["messages"][0][0]["content"] == "hi"


def _bodies():
    """Valid and invalid bodies, to hold the fast validator against the pydantic model."""
    good = make_group(2, turn_scores=True, policy_version=1).to_scored_data().model_dump(mode="json")
    yield good
    yield {"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1]}
    def bad(**changes):
        body = orjson.loads(orjson.dumps(good))
        body.update(changes)
        return body
    yield bad(tokens=[[1, 2.5, 3, 4, 5, 6], good["tokens"][1]])
    yield bad(tokens=[[1, "2", 3, 4, 5, 6], good["tokens"][1]])
    yield bad(tokens=[[1, [2], 3, 4, 5, 6], good["tokens"][1]])
    yield bad(tokens=[[1, True, 3, 4, 5, 6], good["tokens"][1]])
    yield bad(masks=[good["masks"][0][:-1], good["masks"][1]])
    yield bad(scores=["1.0", 2.0])
    yield bad(scores=[1.0])
    yield bad(inference_logprobs=[good["inference_logprobs"][0], [0.0]])
    yield bad(turn_spans=[[[2, 4], [3, 6]], [[2, 4], [4, 6]]])
    yield bad(turn_spans=[[[2, 4]], [[2, 4], [4, 6]]])
    yield bad(turn_scores=[[0.5, 9.0], [0.5, 1.0]])  # outcome disagrees with scores[0]
    yield bad(messages=[[{"role": "robot", "content": "x"}], [{"role": "user", "content": "x"}]])
    yield bad(flags=[{"truncated": "yes"}, {}])
    yield bad(group_id="")
    yield bad(tokens=[])
    segmented = segmented_group().to_scored_data().model_dump(mode="json")
    yield segmented
    yield {**segmented, "segment_starts": [[4]]}
    yield {**segmented, "segment_starts": [[8], None]}
    yield {**segmented, "segment_starts": [[5, 4], None]}
    yield {**segmented, "segment_starts": [[3], None]}
    yield {"masks": [[1]], "scores": [1.0]}


@pytest.mark.parametrize("body", list(_bodies()))
def test_fast_wire_validator_agrees_with_the_model(body):
    raw = orjson.dumps(body)
    try:
        ScoredData.model_validate_json(raw)
        model_ok = True
    except ValidationError:
        model_ok = False
    try:
        decode_group(raw)
        wire_ok = True
    except WireError:
        wire_ok = False
    assert wire_ok == model_ok


def test_wire_rejects_non_finite_and_huge_floats():
    for raw in (b'{"tokens":[[1]],"masks":[[1]],"scores":[NaN]}',
                b'{"tokens":[[1]],"masks":[[1]],"scores":[1e400]}',
                b'{"tokens":[[1]],"masks":[[1]],"scores":[1],"inference_logprobs":[[-1e999]]}'):
        with pytest.raises(WireError):
            decode_group(raw)
