"""Which policy version sampled which token: the env's record of a turn that ran across
an in-flight weight update (environments.rollout.turn_versions), and what the trainer
reads back from it (trainer.versions)."""

from __future__ import annotations

from environments.rollout import GeneratedTurn, turn_versions
from environments.trajectory import MASKED, ScoredGroup, ScoredTrajectory
from trainer.sources import Batch
from trainer.versions import only_version, token_versions


def turn(labels):
    return GeneratedTurn(list(range(9)), [-1.0] * 9, "", "length", False,
                         weight_versions=labels)


def test_a_turn_across_an_update_records_where_each_version_sampled():
    labels = [("default", 0, 5), ("3", 5, 9)]
    # the server's starting weights: what the env knew, or 0 in a fresh run
    assert turn_versions(turn(labels), 10, None) == (0, [(10, 15, 0), (15, 19, 3)])
    assert turn_versions(turn(labels), 10, 2) == (2, [(10, 15, 2), (15, 19, 3)])
    # the labels win over what the env knew (it learns of an update at its next poll)
    assert turn_versions(turn([("4", 0, 9)]), 0, 3) == (4, [(0, 9, 4)])
    # a server that never got a label, or did not say: the version the env knew
    assert turn_versions(turn([("default", 0, 9)]), 0, 3) == (3, None)
    assert turn_versions(turn(None), 0, 3) == (3, None)


def trajectory():
    # prompt 0-2, turn [3, 9) sampled by versions 0 then 1, tool 9-10, turn [11, 14) by 1
    tokens = list(range(1, 15))
    masks = [MASKED] * 3 + tokens[3:9] + [MASKED] * 2 + tokens[11:14]
    return ScoredTrajectory(
        tokens=tokens, masks=masks, inference_logprobs=[-1.0] * 14, scores=[0.0, 1.0],
        turn_spans=[[3, 9], [11, 14]], policy_version=0, turn_policy_versions=[0, 1],
        metadata={"turns": [{"version_spans": [[3, 6, 0], [6, 9, 1]]}, {}]})


def test_the_trainer_reads_each_tokens_version_and_checks_only_its_own():
    t = trajectory()
    assert token_versions(t) == [None] * 3 + [0] * 3 + [1] * 3 + [None] * 2 + [1] * 3
    batch = Batch([ScoredGroup(trajectories=[t, t.model_copy(update={"scores": [0.0, 0.0]})])])
    own = only_version(batch, 0)
    for kept in own.groups[0].trajectories:  # version 0's tokens only, the rest context
        assert [i for i, m in enumerate(kept.masks) if m != MASKED] == [3, 4, 5]
        assert kept.tokens == t.tokens
    assert only_version(batch, 1).groups[0].trajectories[0].masks.count(MASKED) == 8
    plain = t.model_copy(update={"metadata": {}, "turn_policy_versions": [0, 0]})
    assert only_version(Batch([ScoredGroup(trajectories=[plain])]), 0) is None  # all 0's
