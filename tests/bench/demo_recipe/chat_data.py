"""The demo model's chat corpus: synthetic ChatML conversations, rendered by the chat
template the store ships, so that the training text is what the gateway renders.

Three kinds, drawn with one seeded generator:

- questions about the standard library ("What does X do?" and other phrasings), answered
  with the first paragraph of X's docstring, with tools offered in some and none in others;
- requests that one of the offered tools answers (invented tools with their own names,
  parameters and phrasings; several tools offered in some), answered with a
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- the same, followed by the tool's result (`role: tool`) and a short text answer.

The city-taking tools draw real city names and, more often, invented ones (pronounceable
names made from syllables, of one to three words), so that copying the name from the
request is the only way to get a call right. The chat evaluation's cities and questions
(`chat_eval.py`) and the objects those questions name are held out, so its figures measure
what the model generalises to.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import warnings
from dataclasses import asdict, dataclass, field
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
    "What does {} return?",
)
# Tasks asked as "How do I ...?", answered in a sentence; the eval's own tasks (sort a list,
# copy a dict, join strings, ...) and the objects it asks about are left out (a test checks).
HOWTOS = (
    ("reverse a list", "Call items.reverse() to reverse it in place, or use reversed(items) to iterate backwards."),
    ("remove a file", "Use os.remove(path); it raises FileNotFoundError if the file does not exist."),
    ("check if a file exists", "Use os.path.exists(path), or os.path.isfile(path) to also check it is a file."),
    ("make a directory", "Use os.makedirs(path, exist_ok=True); it also creates the missing parents."),
    ("list the files in a directory", "Use os.listdir(path), or os.scandir(path) for entries with their types."),
    ("get the current date and time", "Call datetime.datetime.now(); it returns the local date and time."),
    ("measure how long some code takes", "Take time.perf_counter() before and after, or use the timeit module."),
    ("split a string", "Call text.split(sep); without an argument it splits on runs of whitespace."),
    ("convert a string to an integer", "Call int(text); int(text, 16) reads other bases."),
    ("round a number", "Use round(x, ndigits); the decimal module rounds money exactly."),
    ("generate a random number", "Use random.random() for a float below 1, or random.randint(a, b) for an integer."),
    ("pick a random element from a list", "Use random.choice(items)."),
    ("shuffle a list", "Use random.shuffle(items); it shuffles the list in place."),
    ("read a JSON file", "Open the file and call json.load(f); it returns the parsed object."),
    ("write a CSV file", "Open the file with newline='' and call csv.writer(f).writerow(row) for each row."),
    ("read an environment variable", "Use os.environ.get(name); it returns None when the variable is not set."),
    ("run a shell command", "Use subprocess.run(args, capture_output=True, text=True) and read its stdout."),
    ("hash a string", "Encode it and use hashlib: hashlib.sha256(text.encode()).hexdigest()."),
    ("encode bytes as base64", "Use base64.b64encode(data); base64.b64decode reverses it."),
    ("compress some bytes", "Use zlib.compress(data), or the gzip module for .gz files."),
    ("get the length of a list", "Call len(items)."),
    ("remove duplicates from a list", "Use list(dict.fromkeys(items)) to keep the order, or set(items) otherwise."),
    ("find the largest item in a list", "Use max(items); pass key= to compare by something else."),
    ("add up a list of numbers", "Use sum(numbers); math.fsum is more accurate for floats."),
    ("get the square root of a number", "Use math.sqrt(x), or x ** 0.5."),
    ("format a number with two decimals", "Use an f-string such as f'{x:.2f}'."),
    ("check the type of a value", "Use isinstance(value, SomeType); type(value) gives the exact type."),
    ("handle an exception", "Put the code in a try block and handle the error in an except clause."),
    ("define a class", "Use the class statement, with an __init__ method that sets the attributes."),
    ("write text to a file", "Open it with open(path, 'w') in a with statement and call f.write(text)."),
    ("get the current working directory", "Call os.getcwd()."),
    ("get the extension of a file name", "Use os.path.splitext(name)[1]."),
    ("lower-case a string", "Call text.lower(); text.casefold() is better for comparisons."),
    ("check if a string starts with a prefix", "Use text.startswith(prefix); it also takes a tuple of prefixes."),
    ("replace text in a string", "Use text.replace(old, new), or the re module for patterns."),
    ("find the index of an item in a list", "Use items.index(value); it raises ValueError when it is missing."),
    ("merge two dictionaries", "Use a | b, or a.update(b) to change a in place."),
    ("get the keys of a dictionary", "Use d.keys(), or list(d) for a list of them."),
    ("pretty-print a nested structure", "Use pprint.pprint(obj)."),
    ("log a message", "Call logging.basicConfig() once, then logging.getLogger(__name__).info(message)."),
    ("start a thread", "Create threading.Thread(target=func) and call its start() method."),
    ("wait for a thread to finish", "Call thread.join()."),
    ("parse a date string", "Use datetime.datetime.strptime(text, '%Y-%m-%d') with a format that matches."),
    ("get the absolute path of a file", "Use os.path.abspath(path)."),
    ("download a web page", "Use urllib.request.urlopen(url).read() and decode the bytes."),
    ("check if a key is in a dictionary", "Use key in d; d.get(key) returns None when it is missing."),
    ("convert a number to a string", "Call str(x), or use an f-string to format it."),
    ("get the last item of a list", "Use items[-1]; it raises IndexError when the list is empty."),
    ("remove whitespace from a string", "Call text.strip(); lstrip() and rstrip() trim one side."),
    ("exit a program", "Call sys.exit(code); zero means success."),
)
HOWTO_FORMS = (
    "How do I {}?",
    "How can I {} in Python?",
    "What is the best way to {}?",
    "how to {}",
    "In Python, how do I {}?",
    "How would I {}?",
)
# Concepts asked as "What is a ...?"; the eval's (dataclass, generator) are left out.
CONCEPTS = (
    ("list", "A mutable sequence of items, written [a, b, c]; it can grow and shrink."),
    ("tuple", "An immutable sequence of items, written (a, b, c)."),
    ("dictionary", "A mapping from keys to values, written {key: value}; lookups by key are fast."),
    ("set", "An unordered collection of distinct, hashable items, written {a, b}."),
    ("string", "An immutable sequence of Unicode characters, written in quotes."),
    ("function", "A named block of code defined with def that takes arguments and returns a value."),
    ("lambda", "A small anonymous function written as lambda args: expression."),
    ("decorator", "A callable that takes a function and returns a replacement, applied with @name above a def."),
    ("module", "A Python file whose names other code can import."),
    ("package", "A folder of modules that can be imported as one name."),
    ("class", "A template for objects: it defines their attributes and methods."),
    ("method", "A function defined in a class and called on its instances."),
    ("iterator", "An object with __next__ that returns the items of a sequence one at a time."),
    ("context manager", "An object used in a with statement: it sets something up and cleans it up afterwards."),
    ("exception", "An error raised at run time; try and except handle it."),
    ("virtual environment", "A folder with its own Python and installed packages, made with python -m venv."),
    ("list comprehension", "An expression such as [f(x) for x in items] that builds a list in one line."),
    ("keyword argument", "An argument passed by name, as in f(x=1)."),
    ("type hint", "An annotation such as x: int that documents a type; Python does not enforce it."),
    ("coroutine", "A function defined with async def; await runs it inside an event loop."),
    ("thread", "A separate flow of execution within one process, started with the threading module."),
    ("bytes object", "An immutable sequence of integers from 0 to 255, written b'...'."),
    ("f-string", "A string literal prefixed with f whose {expressions} are formatted into it."),
    ("global variable", "A name defined at the top level of a module, visible to all its functions."),
    ("docstring", "The string literal at the start of a module, class or function that documents it."),
)
CONCEPT_FORMS = ("What is {}?", "What is {} in Python?", "Explain what {} is.", "Can you tell me what {} is?")

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
# Invented city names: syllables of an onset, a vowel and a coda, simple ones weighted up
# (most real names are short, like "Lima" or "Oslo"): two or three per word, rarely one.
_ONSETS = tuple("b c d f g h k l m n p r s t v z".split() * 3 + "br dr gr kr pr st tr ch sh th".split() + [""] * 8)
_VOWELS = tuple("a e i o u".split() * 4 + "ai ea ei io ou y".split())
_CODAS = ("",) * 12 + tuple("n r l s m t k nd rg st".split())
_PREFIXES = "New Port San Saint Lake Upper Lower Old North South East West Fort Mount".split()


def _contains_eval_city(name: str) -> bool:
    low = name.lower()
    return any(c.lower() in low for c in EVAL_CITIES)


def invented_cities(count: int = 2000, *, seed: int = 0) -> tuple[str, ...]:
    """`count` distinct pronounceable one-word names, seeded; none is nor contains an eval
    city or a training city, case-insensitively."""
    rng = random.Random(seed)
    real = {c.lower() for c in TRAIN_CITIES}
    names: dict[str, None] = {}
    while len(names) < count:
        syllables = rng.choice((1, 2, 2, 2, 2, 3, 3))
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        name = name.capitalize()
        if 4 <= len(name) <= 11 and name.lower() not in real and not _contains_eval_city(name):
            names[name] = None
    return tuple(names)


@dataclass
class CityStats:
    """How the city arguments were drawn."""

    real: int = 0
    invented: int = 0
    multi_word: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class CityPool:
    """Draws city names: real ones (`TRAIN_CITIES`) with probability `real_share`, else
    invented ones of one to three words (the words invented or a common prefix such as
    "Port"); counts what it drew."""

    def __init__(self, invented: tuple[str, ...], *, real_share: float = 0.25):
        self.invented, self.real_share = invented, real_share
        self.stats = CityStats()

    def draw(self, rng: random.Random) -> str:
        if rng.random() < self.real_share:
            self.stats.real += 1
            return rng.choice(TRAIN_CITIES)
        self.stats.invented += 1
        words = rng.choice((1, 1, 1, 1, 1, 1, 1, 2, 2, 3))
        if words == 1:
            return rng.choice(self.invented)
        self.stats.multi_word += 1
        parts = [rng.choice(self.invented) for _ in range(words)]
        if rng.random() < 0.5:
            parts[0] = rng.choice(_PREFIXES)
        return " ".join(parts)


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


def _tools(city: Callable[[random.Random], str]) -> tuple[Tool, ...]:
    def one_city(key: str) -> Callable[[random.Random], dict[str, Any]]:
        return lambda rng: {key: city(rng)}

    def two_cities(rng: random.Random) -> dict[str, Any]:
        a = city(rng)
        b = city(rng)
        while b == a:
            b = city(rng)
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
        Tool("get_weather", "The current weather in a city", ("city",), WEATHER_FORMS, one_city("city"),
             _weather_result),
        Tool("weather_now", "Current conditions for a place", ("location",),
             tuple(f.replace("{}", "{location}") for f in WEATHER_FORMS[:6]), one_city("location"),
             lambda rng, a: _weather_result(rng, {"city": a["location"]})),
        Tool("get_forecast", "The weather forecast for a city", ("city", "days"),
             ("What is the forecast for {city} for the next {days} days?", "Forecast {city}, {days} days.",
              "Will it rain in {city} in the next {days} days?"),
             lambda rng: {"city": city(rng), "days": rng.randint(2, 7)},
             lambda rng, a: ({"city": a["city"], "rain_days": rng.randint(0, a["days"])},
                             f"Rain is expected in {a['city']} on some of the next {a['days']} days.")),
        Tool("get_local_time", "The local time in a city", ("city",),
             ("What time is it in {city}?", "Current time in {city}?", "What is the local time in {city}?"),
             one_city("city"),
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
             lambda rng: {"city": city(rng), "cuisine": rng.choice(("Thai", "Italian", "Indian", "Greek"))},
             echo("count", "There are {value} {cuisine} restaurants in {city}.")),
        Tool("get_population", "The population of a city", ("city",),
             ("How many people live in {city}?", "What is the population of {city}?"),
             one_city("city"), echo("thousands", "About {value} thousand people live in {city}.")),
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


@dataclass
class CorpusStats:
    """What a `ChatCorpus` drew: conversations of each kind, the stdlib questions' sources
    and the tools they were offered, and the city arguments."""

    qa: int = 0
    call: int = 0
    result: int = 0
    qa_docstring: int = 0
    qa_howto: int = 0
    qa_concept: int = 0
    qa_weather_tool_only: int = 0  # offered exactly chat_eval's WEATHER_TOOL, as the eval does
    qa_with_get_weather: int = 0  # get_weather among the offered tools, in any schema
    weather_calls_tool_only: int = 0
    cities: CityStats = field(default_factory=CityStats)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"cities": self.cities.to_dict()}


class ChatCorpus:
    """Draws conversations of the three kinds with one seeded generator.

    Of the stdlib questions, `qa_weather_only` are offered exactly the eval's WEATHER_TOOL
    and `qa_some_tools` some other 1-3 tools (get_weather among them at times); all are
    answered in text, so the question, not the offer, decides between text and a call."""

    def __init__(self, seed: int, *, invented: int = 2000, qa_weather_only: float = 0.25, qa_some_tools: float = 0.45):
        self.rng = random.Random(seed)
        self.cities = CityPool(invented_cities(invented))
        self.tools = _tools(self.cities.draw)
        self.facts = stdlib_facts(held_out_names())
        if len(self.facts) < 100:
            raise RuntimeError(f"only {len(self.facts)} stdlib docstrings found; is this Python's stdlib complete?")
        self.qa_weather_only, self.qa_some_tools = qa_weather_only, qa_some_tools
        self.stats = CorpusStats(cities=self.cities.stats)

    def _offered(self, must: Tool | None) -> tuple[list[dict[str, Any]], list[Tool]]:
        rng = self.rng
        count = rng.choice((1, 1, 1, 2, 3))
        pool = [t for t in self.tools if t is not must]
        chosen = rng.sample(pool, count - 1 if must else count)
        if must:
            chosen.insert(rng.randrange(len(chosen) + 1), must)
        schemas = [WEATHER_TOOL if t.name == "get_weather" and rng.random() < 0.5 else t.schema(rng) for t in chosen]
        return schemas, chosen

    def _question(self) -> tuple[str, str]:
        rng, stats = self.rng, self.stats
        roll = rng.random()
        if roll < 0.15:
            stats.qa_howto += 1
            task, answer = rng.choice(HOWTOS)
            return rng.choice(HOWTO_FORMS).format(task), answer
        if roll < 0.25:
            stats.qa_concept += 1
            concept, answer = rng.choice(CONCEPTS)
            article = "an" if concept[0] in "aeiou" else "a"
            return rng.choice(CONCEPT_FORMS).format(f"{article} {concept}"), answer
        stats.qa_docstring += 1
        name, text = rng.choice(self.facts)
        question = rng.choice(QA_FORMS).format(name)
        if question in EVAL_QUESTIONS:
            question = f"What does {name} do?"
        return question, (f"{name}: {text}" if rng.random() < 0.5 else text)

    def qa(self) -> Conversation:
        rng, stats = self.rng, self.stats
        question, answer = self._question()
        roll = rng.random()
        if roll < self.qa_weather_only:
            tools = [WEATHER_TOOL]
            stats.qa_weather_tool_only += 1
        elif roll < self.qa_weather_only + self.qa_some_tools:
            tools = self._offered(None)[0]
        else:
            tools = []
        stats.qa_with_get_weather += any(t["function"]["name"] == "get_weather" for t in tools)
        stats.qa += 1
        return Conversation(({"role": "user", "content": question}, {"role": "assistant", "content": answer}),
                            tuple(tools), "qa")  # fmt: skip

    def call(self, with_result: bool) -> Conversation:
        rng = self.rng
        tool = rng.choice(list(self.tools[:1]) * 4 + list(self.tools))  # weather-like asks more often
        if tool.name == "get_weather" and rng.random() < 0.4:  # the eval's offer, as in the QA above
            tools = [WEATHER_TOOL]
            self.stats.weather_calls_tool_only += 1
        else:
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
            self.stats.result += 1
        else:
            self.stats.call += 1
        return Conversation(tuple(messages), tuple(tools), "result" if with_result else "call")

    def draw(self) -> Conversation:
        roll = self.rng.random()
        if roll < 0.45:
            return self.qa()
        return self.call(with_result=roll > 0.85)

    def summary(self) -> dict[str, Any]:
        """What was drawn so far, and the pools it was drawn from."""
        pools = {
            "stdlib_facts": len(self.facts),
            "real_cities": len(TRAIN_CITIES),
            "invented_cities": len(self.cities.invented),
            "howtos": len(HOWTOS),
            "concepts": len(CONCEPTS),
        }
        return self.stats.to_dict() | {"pools": pools}


def load_template_tokenizer(tokenizer_dir: str | Path):
    """The Hugging Face tokenizer of a model folder or store, as mlx-lm loads it (so
    `apply_chat_template` renders exactly what the daemon renders)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))


def render(hf_tokenizer, conv: Conversation) -> str:
    """The conversation's full text by the model's chat template."""
    extra = {"tools": list(conv.tools)} if conv.tools else {}
    return hf_tokenizer.apply_chat_template(list(conv.messages), tokenize=False, **extra)


def chat_texts(tokenizer_dir: str | Path, count: int, *, seed: int) -> tuple[list[str], dict[str, Any]]:
    """`count` rendered conversations and the corpus summary (`ChatCorpus.summary`)."""
    hf = load_template_tokenizer(tokenizer_dir)
    corpus = ChatCorpus(seed)
    texts = [render(hf, corpus.draw()) for _ in range(count)]
    return texts, corpus.summary()
