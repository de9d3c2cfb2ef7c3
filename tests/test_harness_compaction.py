"""A harness that compacts its context as shipped, trained as segments (issue 77).

Kimi Code 2.1.0 compacts with no switch to turn it off: before a step, once its context
(the last reply's reported usage plus an estimate of what came after) reaches 0.85 of
``KIMI_MODEL_MAX_CONTEXT_SIZE``, it sends the whole history plus a "handoff summary"
instruction, and goes on from the summary. With ``harness_compaction: true`` the catalog
tells it the proxy's window (``max_token_length``); the window here is set a little
above its first prompt, so the compaction comes right after the first tool result.

The episode runs through ``benchmarks/harness_table.py`` (bwrap, the proxy, vLLM CPU, a
tiny random model; three scripted turns: a Bash call writing 42 to answer.txt, the
summary, the answer) and is then checked: the summarisation request extended the
recorded conversation (the same segment, a recorded and trained turn), the request after
it did not and started a new segment, the trainer's alignment check and a step passed,
and each segment trains as its own row with the rollout's advantage.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from harness_table import FIXTURES, MAX_MODEL_LEN  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.needs("bubblewrap", "npm", "nodejs"),
              pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap is Linux-only")]

SUMMARY = "Summary: the user asked for 42 in answer.txt; a Bash call wrote it."
ANSWER = "Done: answer.txt holds 42."


def first_prompt_tokens(model) -> int:
    """Kimi Code's first captured request (tests/fixtures/harness_requests/kimi-code),
    rendered as the proxy renders it, in ``model``'s tokens."""
    from transformers import AutoTokenizer

    from environments.blackbox.proxy import DIALECTS
    from environments.blackbox.recorder import InterceptedRollout
    from environments.inference.chat_template import ChatRenderer

    request = json.loads(sorted((FIXTURES / "kimi-code").glob("*.json"))[0].read_text())
    dialect = next(d for d in DIALECTS if d.matches(request["path"]))
    turn = dialect.parse(json.dumps(request["body"]).encode(),
                         InterceptedRollout("r", "t", None))
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(model)))
    return len(renderer.prompt_ids([m.rendered for m in turn.messages], turn.tools))


def test_kimi_code_compacting_as_shipped_starts_a_segment_each_trained_with_the_advantage(
        tmp_path):
    from environments.envs.answer_file import hermes_call
    from environments.jsonl_store import read_groups
    from environments.trajectory import MASKED, ScoredGroup
    from lachesis.tiny_model import make_tiny_model
    from trainer.advantages import compute_group_advantages
    from trainer.config import TrainConfig
    from trainer.sources import Batch
    from trainer.train import batch_tensors

    model = make_tiny_model(tmp_path / "tiny", tied=True, tokenizer="corpus",
                            corpus=[FIXTURES], vocab_size=8192,
                            max_position_embeddings=MAX_MODEL_LEN)
    first = first_prompt_tokens(model)
    # Compaction once the context reaches 0.85 x window: after the first reply (its
    # usage: the first prompt and the call) but not before it; and room for the
    # compaction request (the history, the call, its result and the ~1k-token instruction).
    window = first + 3000
    assert 0.85 * window < first and window <= MAX_MODEL_LEN - 512, (first, window)
    script = [hermes_call("Bash", {"command": "echo 42 > answer.txt"}), SUMMARY, ANSWER]
    done = subprocess.run(
        [sys.executable, "benchmarks/harness_table.py", "--harness", "kimi-code",
         "--model", str(model), "--dtype", "float32", "--group-size", "1",
         "--parallel", "1", "--timeout-s", "240", "--work", str(tmp_path / "work"),
         "--json", str(tmp_path / "table.json"), "--set", "harness_compaction=true",
         f"max_token_length={window}", "script=false",
         f"scripted_turns={json.dumps(script)}"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert (tmp_path / "table.json").exists(), done.stderr[-3000:]
    summary = json.loads((tmp_path / "table.json").read_text())
    [row] = summary["rows"]
    assert row["exit"] == 0 and row["rollouts"] == 1, row["stderr_tail"]
    assert row["reached_end"] == [True] and row["solved"] == [True], row
    # three model calls, all recorded turns: the call, the summary, the answer
    assert row["turns"] == [3] and row["segments"] == [2], row
    assert summary["check_exit"] == 0, summary["check"]  # trainer vs vLLM logprobs
    assert summary["step_exit"] == 0, summary["step"]
    assert done.returncode == 0, done.stdout

    [group] = read_groups(row["out"])
    [t] = group.trajectories
    spans = t.turn_spans
    [start] = t.segment_starts
    # the summarisation request extended the conversation (segment 0 holds the call and
    # the summary, its instruction a user message before it); the request after it sent
    # a history that does not extend the recorded one: segment 1, rendered afresh
    assert spans[1][1] <= start < spans[2][0]
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(str(model)).decode
    assert "handoff summary" in decode(t.tokens[spans[0][1]:spans[1][0]])  # its request
    assert decode(t.tokens[slice(*spans[1])]).startswith(SUMMARY)  # the policy wrote it
    assert SUMMARY in decode(t.tokens[start:spans[2][0]])  # the history it went on from
    assert "handoff summary" not in decode(t.tokens[start:spans[2][0]])
    reasons = [s["reason"] for s in t.metadata["segments"]]
    assert reasons[0] is None and reasons[1], reasons
    print("segments:", t.metadata["segments"], "turn spans:", spans)

    # each segment trains as its own row, with the rollout's (group-normalised)
    # advantage: beside a sibling rollout that failed, +A on every trained token of both
    # of its rows and -A on the sibling's
    failed = t.model_copy(update={"scores": [0.0] * len(t.scores)})
    pair = ScoredGroup(trajectories=[t, failed])
    advantage = compute_group_advantages(pair.trajectories, "grpo").advantages[0]
    trained = np.array(t.masks) != MASKED
    [a] = set(np.round(advantage[trained], 6).tolist())
    assert a > 0
    config = TrainConfig(model=str(model), estimator="grpo")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batch = Batch([pair])
    tensors, stats = batch_tensors(batch, config, vocab_size=vocab, pad_id=0)
    assert stats["rows"] == 4, (stats, batch.rejected)  # two segments each
    bounds = [0, start, len(t.tokens)]
    for row_index, sign in ((0, 1), (1, 1), (2, -1), (3, -1)):
        segment = row_index % 2
        n = bounds[segment + 1] - bounds[segment]
        assert tensors.tokens[row_index, :n].tolist() == \
            t.tokens[bounds[segment]:bounds[segment + 1]]
        mask = tensors.mask[row_index, :n].numpy().astype(bool)
        assert mask.any()
        values = tensors.advantages[row_index, :n].numpy()[mask]
        np.testing.assert_allclose(values, sign * a, rtol=1e-5)
