"""Which policy version sampled which token: the env's record of a turn that ran across
an in-flight weight update (environments.rollout.turn_versions), and what the trainer
reads back from it (trainer.versions)."""

from __future__ import annotations

from environments.inference.vllm_client import Completion, VLLMServerPool, join_completions
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


def test_a_continued_request_keeps_the_labels_of_every_part_that_sampled_tokens():
    """``sync_pause: abort`` ends a request with the tokens it has; the client continues it
    on the new weights and joins the parts' labels. A request aborted before its first
    token (it was waiting for a slot) has no label to give: the turn is its continuation's
    weights, not the version the env knew when it sent it."""
    def part(n, labels, reason="abort"):
        return Completion(list(range(n)), [-1.0] * n, reason, None, "u", labels)

    # as vLLM's generate route answers a request aborted while it waited: no tokens, no spans
    url = "http://127.0.0.1:9"
    aborted, = VLLMServerPool([url])._completions({"choices": [{
        "token_ids": [], "logprobs": {"content": []}, "finish_reason": "abort",
        "weight_versions": []}]}, url, 1)
    assert aborted.weight_versions == []
    waited = join_completions(aborted, part(6, [("1", 0, 6)], "length"))
    assert waited.weight_versions == [("1", 0, 6)]
    assert turn_versions(turn(waited.weight_versions), 3, 0) == (1, [(3, 9, 1)])
    both = join_completions(join_completions(part(3, [("default", 0, 3)]), part(0, [])),
                            part(6, [("1", 0, 6)], "length"))
    assert both.token_ids == [0, 1, 2] + list(range(6))
    assert both.weight_versions == [("default", 0, 3), ("1", 3, 9)]
    # a part that sampled tokens and did not say which weights: the turn's are unknown
    assert join_completions(part(3, None), part(6, [("1", 0, 6)])).weight_versions is None


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
