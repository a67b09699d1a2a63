"""The demo model's chat corpus: synthetic ChatML conversations, rendered by the chat
template the store ships, so that the training text is what the gateway renders.

Three kinds, drawn with one seeded generator:

- questions about the standard library ("What does X do?" and other phrasings), answered
  with the first paragraph of X's docstring, with tools offered in some and none in others;
- requests that one of the offered tools answers (invented tools with their own names,
  parameters and phrasings; several tools offered in some), answered with a
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- the same, followed by the tool's result (`role: tool`) and a short text answer.

The chat evaluation's cities and questions (`chat_eval.py`) and the objects those
questions name are held out, so its figures measure what the model generalises to.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from demo_recipe.chat_eval import CITIES as EVAL_CITIES
from demo_recipe.chat_eval import QUESTIONS as EVAL_QUESTIONS
from demo_recipe.chat_eval import WEATHER_TOOL

# Modules whose public functions and classes the questions are about.
QA_MODULES = (
    "abc argparse array base64 bisect builtins calendar collections contextlib copy csv dataclasses datetime "
    "decimal difflib enum fnmatch fractions functools getpass glob gzip hashlib heapq hmac html inspect io "
    "ipaddress itertools json keyword linecache locale logging math mimetypes operator os os.path pathlib "
    "pickle platform pprint queue random re secrets shlex shutil signal socket statistics string struct "
    "subprocess sys tarfile tempfile textwrap threading time timeit tokenize traceback types typing unicodedata "
    "urllib.parse uuid warnings weakref zipfile zlib"
).split()
QA_FORMS = (
    "What does {} do?",
    "What is {}?",
    "What is {} for?",
    "Explain {}.",
    "Tell me about {}.",
    "Can you describe {}?",
    "what does {} do",
    "Describe {} briefly.",
    "I saw {} in some code. What is it?",
    "What is the purpose of {}?",
    "How do I use {}?",
    "How does {} work?",
)
# Words that start city names the weather forms are filled with (the eval's are left out).
TRAIN_CITIES = tuple(
    c
    for c in (
        "Amsterdam Ankara Auckland Baghdad Bangkok Barcelona Beijing Beirut Belgrade Bern Bogota Brasilia "
        "Bratislava Brisbane Brussels Bucharest Budapest Calgary Canberra Caracas Chicago "
        "Copenhagen Dakar Dallas Denver Detroit Doha Dubai Edinburgh Florence Frankfurt Geneva Glasgow Hamburg "
        "Hanoi Havana Helsinki Houston Istanbul Jakarta Kabul Kampala Karachi Kiev Kyoto Lagos Leeds Lyon Manila "
        "Marseille Melbourne Miami Milan Montreal Moscow Mumbai Munich Nagoya Naples Osaka Ottawa Perth Porto "
        "Quito Riga Riyadh Santiago Seattle Shanghai Singapore Sofia Stockholm Taipei Tallinn Tehran Tunis Turin "
        "Valencia Vancouver Venice Vilnius Warsaw Wellington Zagreb Zurich Accra Algiers Antwerp Austin Baku "
        "Bergen Bilbao Bologna Bordeaux Bremen Bristol Cardiff Cologne Cork Dresden Dundee Durban Essen Fez "
        "Genoa Gdansk Graz Hobart Jaipur Kassel Krakow Leipzig Lille Linz Luxembourg Malaga Malmo Manchester "
        "Minsk Nantes Nice Oxford Padua Pisa Poznan Reno Rotterdam Salzburg Seville Split Tampa Toulouse Utrecht "
        "Verona Windsor Wroclaw York Zaragoza Hanover Kiel Lucerne Lausanne Basel Ghent Bruges Tartu Kaunas Lodz"
    ).split()
    if c not in EVAL_CITIES
)
WEATHER_FORMS = (
    "What is the weather in {}?",
    "How is the weather in {} today?",
    "Is it raining in {}?",
    "What's the weather like in {}?",
    "weather in {}",
    "Tell me the weather in {}.",
    "Is it cold in {} right now?",
    "Do I need an umbrella in {}?",
    "How warm is it in {}?",
    "Check the weather for {}.",
)
_WORDS = (
    "apple river orange window garden silver planet bridge winter summer coffee market pencil rocket "
    "forest harbor candle mirror violin castle meadow lantern thunder pepper cotton marble island"
).split()
_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Oscar Peggy Rupert Sybil Trent Victor Wendy".split()
_LANGS = "French German Spanish Italian Dutch Polish Swedish Turkish Greek Czech Finnish Danish".split()
_CURRENCIES = "USD EUR GBP JPY CHF CAD AUD SEK NOK PLN".split()
_SYMBOLS = "AAPL MSFT GOOG AMZN NVDA TSLA IBM INTC ORCL SAP".split()
_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowing", "clear", "overcast")


@dataclass(frozen=True)
class Tool:
    """An invented tool: its schema, ways to ask for it, and how to draw arguments."""

    name: str
    description: str
    params: tuple[str, ...]
    forms: tuple[str, ...]  # str.format templates over the params
    draw: Callable[[random.Random], dict[str, Any]]
    result: Callable[[random.Random, dict[str, Any]], tuple[dict[str, Any], str]]  # (tool output, answer)

    def schema(self, rng: random.Random) -> dict[str, Any]:
        props = {p: {"type": "number" if p in ("amount", "days", "minutes") else "string"} for p in self.params}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {"type": "object", "properties": props, "required": list(self.params)},
            },
        }


def _weather_result(rng: random.Random, args: dict[str, Any]) -> tuple[dict[str, Any], str]:
    t, c = rng.randint(-10, 35), rng.choice(_CONDITIONS)
    return {"city": args["city"], "temperature_c": t, "conditions": c}, f"It is {t} °C and {c} in {args['city']}."


def _pick(values: tuple[str, ...] | list[str], key: str) -> Callable[[random.Random], dict[str, Any]]:
    return lambda rng: {key: rng.choice(values)}


def _tools() -> tuple[Tool, ...]:
    cities = TRAIN_CITIES

    def two_cities(rng: random.Random) -> dict[str, Any]:
        a, b = rng.sample(cities, 2)
        return {"origin": a, "destination": b}

    def money(rng: random.Random) -> dict[str, Any]:
        a, b = rng.sample(_CURRENCIES, 2)
        return {"amount": rng.choice((5, 10, 20, 50, 100, 250, 1000)), "source": a, "target": b}

    def echo(key: str, fmt: str) -> Callable[[random.Random, dict[str, Any]], tuple[dict[str, Any], str]]:
        def result(rng: random.Random, args: dict[str, Any]) -> tuple[dict[str, Any], str]:
            value = rng.randint(2, 900)
            return {key: value}, fmt.format(value=value, **args)

        return result

    return (
        Tool("get_weather", "The current weather in a city", ("city",), WEATHER_FORMS, _pick(cities, "city"),
             _weather_result),
        Tool("weather_now", "Current conditions for a place", ("location",),
             tuple(f.replace("{}", "{location}") for f in WEATHER_FORMS[:6]), _pick(cities, "location"),
             lambda rng, a: _weather_result(rng, {"city": a["location"]})),
        Tool("get_forecast", "The weather forecast for a city", ("city", "days"),
             ("What is the forecast for {city} for the next {days} days?", "Forecast {city}, {days} days.",
              "Will it rain in {city} in the next {days} days?"),
             lambda rng: {"city": rng.choice(cities), "days": rng.randint(2, 7)},
             lambda rng, a: ({"city": a["city"], "rain_days": rng.randint(0, a["days"])},
                             f"Rain is expected in {a['city']} on some of the next {a['days']} days.")),
        Tool("get_local_time", "The local time in a city", ("city",),
             ("What time is it in {city}?", "Current time in {city}?", "What is the local time in {city}?"),
             _pick(cities, "city"),
             lambda rng, a: ({"time": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"},
                             f"It is {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} in {a['city']}.")),
        Tool("get_distance", "The distance between two cities in km", ("origin", "destination"),
             ("How far is {origin} from {destination}?", "Distance from {origin} to {destination}?"),
             two_cities, echo("km", "{origin} is {value} km from {destination}.")),
        Tool("convert_currency", "Convert an amount between currencies", ("amount", "source", "target"),
             ("Convert {amount} {source} to {target}.", "How much is {amount} {source} in {target}?"),
             money, echo("result", "{amount} {source} is {value} {target}.")),
        Tool("translate", "Translate a word into a language", ("text", "language"),
             ("Translate '{text}' into {language}.", "How do you say {text} in {language}?"),
             lambda rng: {"text": rng.choice(_WORDS), "language": rng.choice(_LANGS)},
             lambda rng, a: ({"translation": a["text"][::-1]}, f"In {a['language']}: {a['text'][::-1]}.")),
        Tool("get_stock_price", "The latest price of a stock", ("symbol",),
             ("What is the price of {symbol}?", "How is {symbol} trading?", "Stock price of {symbol}?"),
             _pick(_SYMBOLS, "symbol"), echo("price", "{symbol} trades at {value} dollars.")),
        Tool("send_email", "Send a short email", ("to", "subject"),
             ("Email {to} about {subject}.", "Send {to} an email with the subject {subject}."),
             lambda rng: {"to": rng.choice(_NAMES), "subject": rng.choice(_WORDS)},
             lambda rng, a: ({"sent": True}, f"I sent the email to {a['to']}.")),
        Tool("set_timer", "Start a timer", ("minutes",),
             ("Set a timer for {minutes} minutes.", "Remind me in {minutes} minutes."),
             lambda rng: {"minutes": rng.randint(1, 90)},
             lambda rng, a: ({"ok": True}, f"The timer is set for {a['minutes']} minutes.")),
        Tool("define_word", "A dictionary definition", ("word",),
             ("Define {word}.", "What does the word {word} mean?", "Look up {word} in the dictionary."),
             _pick(_WORDS, "word"),
             lambda rng, a: ({"definition": f"a kind of {a['word']}"}, f"{a['word'].capitalize()}: a kind of "
                             f"{a['word']}.")),
        Tool("find_restaurants", "Restaurants in a city", ("city", "cuisine"),
             ("Find {cuisine} restaurants in {city}.", "Where can I eat {cuisine} food in {city}?"),
             lambda rng: {"city": rng.choice(cities), "cuisine": rng.choice(("Thai", "Italian", "Indian", "Greek"))},
             echo("count", "There are {value} {cuisine} restaurants in {city}.")),
        Tool("get_population", "The population of a city", ("city",),
             ("How many people live in {city}?", "What is the population of {city}?"),
             _pick(cities, "city"), echo("thousands", "About {value} thousand people live in {city}.")),
    )  # fmt: skip


def _first_paragraph(doc: str, limit: int = 240) -> str:
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    para = " ".join(para.split())
    if len(para) <= limit:
        return para
    cut = para[:limit].rsplit(". ", 1)[0]
    return cut if cut.endswith(".") else cut.rsplit(" ", 1)[0] + "."


def stdlib_facts(held_out: frozenset[str]) -> list[tuple[str, str]]:
    """(qualified name, docstring's first paragraph) of the public functions and classes
    of `QA_MODULES`, sorted, leaving out the names in `held_out`."""
    facts: dict[str, str] = {}
    for mod_name in QA_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # a Python built without this module: fewer facts, not an error
            continue
        for attr in sorted(vars(mod)):
            with warnings.catch_warnings():  # typing's deprecated aliases warn when read
                warnings.simplefilter("ignore", DeprecationWarning)
                obj = getattr(mod, attr)
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            home = (getattr(obj, "__module__", None) or mod.__name__).lstrip("_")
            if home not in (mod_name, mod.__name__, "posix"):  # a name the module imported from another
                continue
            name = attr if mod_name == "builtins" else f"{mod_name}.{attr}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(obj)
            if _is_held_out(name, held_out) or not doc or doc.startswith(("Initialize self", "Create and return")):
                continue
            text = _first_paragraph(doc)
            if len(text) >= 20 and not text.startswith((attr + "(", name + "(")):
                facts.setdefault(name, text)
    return sorted(facts.items())


def held_out_names() -> frozenset[str]:
    """The objects the chat evaluation asks about ("What does X do?", "What is a X?")."""
    found = (re.match(r"What (?:does|is) (?:an? )?([A-Za-z_][\w.]*\w)", q) for q in EVAL_QUESTIONS)
    return frozenset(m.group(1) for m in found if m)


def _is_held_out(name: str, held_out: frozenset[str]) -> bool:
    return any(name == h or name.endswith("." + h) for h in held_out)


@dataclass(frozen=True)
class Conversation:
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    kind: str  # "qa", "call" or "result"


class ChatCorpus:
    """Draws conversations of the three kinds with one seeded generator."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.tools = _tools()
        self.facts = stdlib_facts(held_out_names())
        if len(self.facts) < 100:
            raise RuntimeError(f"only {len(self.facts)} stdlib docstrings found; is this Python's stdlib complete?")

    def _offered(self, must: Tool | None) -> tuple[list[dict[str, Any]], list[Tool]]:
        rng = self.rng
        count = rng.choice((1, 1, 1, 2, 3))
        pool = [t for t in self.tools if t is not must]
        chosen = rng.sample(pool, count - 1 if must else count)
        if must:
            chosen.insert(rng.randrange(len(chosen) + 1), must)
        schemas = [WEATHER_TOOL if t.name == "get_weather" and rng.random() < 0.5 else t.schema(rng) for t in chosen]
        return schemas, chosen

    def qa(self) -> Conversation:
        rng = self.rng
        name, text = rng.choice(self.facts)
        question = rng.choice(QA_FORMS).format(name)
        if question in EVAL_QUESTIONS:
            question = f"What does {name} do?"
        tools = self._offered(None)[0] if rng.random() < 0.6 else []
        answer = f"{name}: {text}" if rng.random() < 0.5 else text
        return Conversation(({"role": "user", "content": question}, {"role": "assistant", "content": answer}),
                            tuple(tools), "qa")  # fmt: skip

    def call(self, with_result: bool) -> Conversation:
        rng = self.rng
        tool = rng.choice(list(self.tools[:1]) * 4 + list(self.tools))  # weather-like asks more often
        tools, _ = self._offered(tool)
        args = tool.draw(rng)
        question = rng.choice(tool.forms).format(*args.values(), **args)
        call = {"type": "function", "function": {"name": tool.name, "arguments": args}}
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        if with_result:
            output, answer = tool.result(rng, args)
            messages += [{"role": "tool", "content": json.dumps(output)}, {"role": "assistant", "content": answer}]
        return Conversation(tuple(messages), tuple(tools), "result" if with_result else "call")

    def draw(self) -> Conversation:
        roll = self.rng.random()
        if roll < 0.45:
            return self.qa()
        return self.call(with_result=roll > 0.85)


def load_template_tokenizer(tokenizer_dir: str | Path):
    """The Hugging Face tokenizer of a model folder or store, as mlx-lm loads it (so
    `apply_chat_template` renders exactly what the daemon renders)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))


def render(hf_tokenizer, conv: Conversation) -> str:
    """The conversation's full text by the model's chat template."""
    extra = {"tools": list(conv.tools)} if conv.tools else {}
    return hf_tokenizer.apply_chat_template(list(conv.messages), tokenize=False, **extra)


def chat_texts(tokenizer_dir: str | Path, count: int, *, seed: int) -> tuple[list[str], dict[str, int]]:
    """`count` rendered conversations and how many of each kind."""
    hf = load_template_tokenizer(tokenizer_dir)
    corpus = ChatCorpus(seed)
    texts, kinds = [], {"qa": 0, "call": 0, "result": 0}
    for _ in range(count):
        conv = corpus.draw()
        kinds[conv.kind] += 1
        texts.append(render(hf, conv))
    return texts, kinds | {"stdlib_facts": len(corpus.facts), "cities": len(TRAIN_CITIES)}
