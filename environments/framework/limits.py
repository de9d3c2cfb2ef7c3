"""Token limits that agree before anything runs.

An env's context (``max_token_length`` tokens, prompt included: the whole trajectory, or
each segment of one that has several) must fit in what the inference server serves
(vLLM's ``max_model_len``, which ``GET /v1/models`` reports), and so must one turn
(``max_tokens_per_turn``, after at least one prompt token). If not, the env's own limit is
never the one reached: vLLM refuses the request that reaches past its length mid-episode,
the rollout fails as an inference failure and its whole group is dropped, where the env's
limit would have ended the trajectory as truncated and kept it.

So the settings are compared with the servers before anything runs, and a mismatch is
**refused** (not clamped), with a message naming both numbers and what to change:

* every env at start (:meth:`BaseEnv.start <environments.framework.base.BaseEnv.start>`,
  which every env kind goes through: the agent loop's envs, black-box envs, the verifiers
  and OpenEnv adapters), against each vLLM server it was given
  (:attr:`VLLMServerPool.context_limits
  <environments.inference.vllm_client.VLLMServerPool.context_limits>`);
* ``lachesis run`` and ``lachesis run --plan``, every env of the config against
  ``vllm.max_model_len``, before any process starts.

Why refuse rather than clamp: ``max_token_length`` is part of what a run is (the API and
the trainer budget by it, overlong shaping is measured against it, truncation rates depend
on it); a run that silently trains with other limits than its config says is harder to
read than one that does not start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class ContextLimitError(ValueError):
    """An env's token limits do not fit its inference servers' ``max_model_len``."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def context_limit_problems(
    max_token_length: int, max_tokens_per_turn: int | None, max_model_len: int, server: str, *,
    env_setting: Callable[[str], str] = lambda name: f"{name} ({_flag(name)})",
    server_fix: Callable[[int], str] = lambda n: f"start vLLM with --max-model-len {n} or more",
) -> list[str]:
    """What does not fit, one line each (empty: everything fits).

    ``server`` names the limit in the message (``the inference server URL (model 'm',
    max_model_len 4096)``); ``env_setting(name)`` says where the env's setting ``name``
    is changed, ``server_fix(n)`` how the server's limit is raised to ``n``."""
    problems = []
    if max_token_length > max_model_len:
        problems.append(
            f"max_token_length {max_token_length} does not fit {server}: vLLM would refuse "
            f"contexts past {max_model_len} tokens mid-episode and drop their groups, instead "
            f"of ending them as truncated at max_token_length. Set "
            f"{env_setting('max_token_length')} to {max_model_len} or less, or "
            f"{server_fix(max_token_length)}")
    if max_tokens_per_turn is not None and max_tokens_per_turn >= max_model_len:
        problems.append(
            f"max_tokens_per_turn {max_tokens_per_turn} does not fit {server}: a turn follows "
            f"at least one prompt token, so it can never be longer than {max_model_len - 1}. "
            f"Set {env_setting('max_tokens_per_turn')} to {max_model_len - 1} or less, or "
            f"{server_fix(max_tokens_per_turn + 1)}")
    return problems


def check_context_limits(max_token_length: int, max_tokens_per_turn: int | None,
                         limits: dict[str, int | None], model: str | None) -> None:
    """Raise :class:`ContextLimitError` when the env's limits do not fit the smallest
    ``max_model_len`` of its servers (``limits``: each server's; None where it did not
    say, which is logged and not checked)."""
    for url, max_model_len in limits.items():
        if max_model_len is None:
            log.warning("inference server %s did not report max_model_len (GET /v1/models); "
                        "max_token_length %d is not checked against it", url, max_token_length)
    known = {url: n for url, n in limits.items() if n is not None}
    if not known:
        return
    url = min(known, key=known.__getitem__)
    smallest = f", the smallest of {len(known)} servers" if len(known) > 1 else ""
    server = f"the inference server {url} (model {model!r}, max_model_len {known[url]}{smallest})"
    problems = context_limit_problems(max_token_length, max_tokens_per_turn, known[url], server)
    if problems:
        raise ContextLimitError(" | ".join(problems))
