"""The demo model's chat figures, through a running daemon serving it (greedy):

- 20 "what is the weather in X" prompts with one tool `get_weather(city)`: how many get a
  parsed tool call of get_weather whose JSON arguments name X;
- 20 questions about the standard library, with the same tool offered: how many are
  answered in text (something before the end of the turn, no tool call, not even one
  that fails to parse).

    cd tests/bench && python -m demo_recipe.chat_eval [--runtime-dir DIR] [--max-tokens N] [--out FILE]

The training corpus (`chat_data.py`) holds these cities and questions out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from moestream.client.client import Client
from moestream.shared.settings import Settings

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITIES = (
    "Paris London Tokyo Berlin Madrid Rome Oslo Cairo Lima Delhi "
    "Sydney Toronto Dublin Vienna Prague Lisbon Seoul Nairobi Boston Athens"
).split()
# ChatML's end of a turn: plain text to this tokenizer, so it comes back in the answer.
END_OF_TURN = "<|im_end|>"
WEATHER_FORMS = ("What is the weather in {}?", "How is the weather in {} today?", "Is it raining in {}?")
QUESTIONS = (
    "What does os.path.join do?",
    "How do I sort a list?",
    "What is itertools.chain?",
    "What does json.dumps return?",
    "How do I read a file line by line?",
    "What is a dataclass?",
    "What does re.sub do?",
    "How do I copy a dict?",
    "What is functools.lru_cache?",
    "What does zip do?",
    "How do I open a socket?",
    "What is collections.Counter?",
    "What does time.sleep do?",
    "How do I parse command-line arguments?",
    "What is pathlib.Path?",
    "What does enumerate return?",
    "How do I make a temporary file?",
    "What does shutil.rmtree do?",
    "What is a generator?",
    "How do I join strings?",
)


def _names_city(call: dict, city: str) -> bool:
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        return False
    named = isinstance(args, dict) and city.lower() in str(args.get("city", "")).lower()
    return call["name"] == "get_weather" and named


def answered_in_text(tool_calls: list, text: str) -> bool:
    """An answer in words: no call, parsed or not (a call that fails to parse comes back
    as text), and something before the end-of-turn marker."""
    return not tool_calls and "<tool_call>" not in text and bool(text.split(END_OF_TURN)[0].strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-dir", help="the daemon's runtime folder (default: the user's)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", help="also write the figures, with every answer, to this JSON file")
    args = parser.parse_args(argv)
    settings = Settings.resolve({"runtime_dir": args.runtime_dir})
    tic = time.monotonic()
    calls = texts = 0
    answers = []
    with Client(settings, timeout=600) as c:
        for i, city in enumerate(CITIES):
            prompt = WEATHER_FORMS[i % len(WEATHER_FORMS)].format(city)
            r = c.complete(
                messages=[{"role": "user", "content": prompt}], tools=[WEATHER_TOOL], max_tokens=args.max_tokens
            )
            ok = any(_names_city(call, city) for call in r.tool_calls)
            calls += ok
            answers.append({"prompt": prompt, "ok": ok, "tool_calls": r.tool_calls, "text": r.text})
            print(f"weather {ok!s:5} {prompt!r}: {r['tool_calls'] or r['text'][:60]!r}", file=sys.stderr, flush=True)
        for q in QUESTIONS:
            r = c.complete(messages=[{"role": "user", "content": q}], tools=[WEATHER_TOOL], max_tokens=args.max_tokens)
            ok = answered_in_text(r.tool_calls, r.text)
            texts += ok
            answers.append({"prompt": q, "ok": ok, "tool_calls": r.tool_calls, "text": r.text})
            print(f"stdlib  {ok!s:5} {q!r}: {r['text'][:60]!r}", file=sys.stderr, flush=True)
    result = {
        "weather_calls_naming_the_city": calls,
        "weather_prompts": len(CITIES),
        "stdlib_answered_in_text": texts,
        "stdlib_questions": len(QUESTIONS),
        "max_tokens": args.max_tokens,
        "seconds": round(time.monotonic() - tic, 1),
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result | {"answers": answers}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
