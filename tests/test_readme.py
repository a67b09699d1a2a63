"""The user README: short, its reliability table made from a committed soak report, and the
commands and flags it gives those of the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from moestream.daemon.bench.soak.run import reliability_table_markdown

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 220
SOAK_REPORT = ROOT / "tests" / "bench" / "results" / "soak" / "bench_soak_demo_cpu.json"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_the_reliability_table_is_the_soak_reports():
    """Each figure in the README's table is the committed `bench soak --json` report's
    (regenerate: python -m moestream.daemon.bench.soak.run tests/bench/results/soak/bench_soak_demo_cpu.json)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- reliability-table")
    table = text[text.index("\n", start) + 1 : text.index("<!-- end reliability-table -->")]
    report = json.loads(SOAK_REPORT.read_text())
    assert report["ok"], "the committed soak report failed a check"
    assert table == reliability_table_markdown(report, SOAK_REPORT.name), (
        "README.md's reliability table differs from the soak report: regenerate it"
    )


def _commands_of(words: list[str]) -> list[click.Command]:
    """The moestreamctl commands that `words` (what follows `moestreamctl`) name: a group's
    subcommand, `a\\|b` alternatives each; [] where the first word is no command."""
    from moestream.client.cli import main

    found: list[click.Command] = [main]
    for word in words:
        groups = [c for c in found if isinstance(c, click.Group)]
        names = word.replace("\\|", "|").split("|")
        below = [g.commands[n] for g in groups for n in names if n in g.commands]
        if not below:
            break
        found = below
    return [] if found == [main] else found


def _options(commands: list[click.Command]) -> set[str]:
    """Their options, and --help (every command's, from the group's context settings)."""
    return {"--help"} | {o for c in commands for p in c.params for o in (*p.opts, *p.secondary_opts)}


def _flags(text: str) -> set[str]:
    """The --flags in `text`, leaving out what is quoted (another program's options)."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "", text)
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))


def test_every_flag_the_readme_gives_a_command_is_in_its_help():
    """Each `moestreamctl ...` the README shows (code, inline or its commands table) names
    commands that exist, and each --flag given them is one of their options; a --flag the
    prose names alone is some command's. (The settings table is generated from the settings.)"""
    text = (ROOT / "README.md").read_text()
    generated = text[text.index("<!-- settings-table") : text.index("<!-- end settings-table -->")]
    text = text.replace(generated, "")
    checked: list[tuple[str, set[str], set[str]]] = []  # (where, flags, options)
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            pieces = [p.strip() for p in re.split(r"&&|;|\|(?!\|)", line)]
            spans = [p for p in pieces if p.startswith("moestreamctl ")]
        elif line.startswith("| `moestreamctl"):
            first = line.split(" | ")[0]
            words = re.findall(r"`([^`]+)`", first)
            commands = [c for w in words for c in _commands_of(w.split()[1:] if w.startswith("moestreamctl") else [w])]
            assert commands, line
            checked.append((line, _flags(line), _options(commands)))
            continue
        else:
            spans = [s for s in re.findall(r"`([^`]+)`", line) if s.startswith("moestreamctl ")]
            for alone in re.findall(r"`(--[^`]+)`", line):
                checked.append((line, _flags(alone), set().union(*(_options([c]) for c in _all_commands()))))
        for span in spans:
            words = [w for w in span.split()[1:] if not w.startswith("-")]
            commands = _commands_of(words)
            assert commands, f"no such command: {span}"
            checked.append((span, _flags(span), _options(commands)))
    assert len(checked) > 15
    for where, flags, options in checked:
        assert flags <= options, f"{sorted(flags - options)} not in the --help of: {where}"


def _all_commands() -> list[click.Command]:
    from moestream.client.cli import main

    out, todo = [], [main]
    while todo:
        c = todo.pop()
        out.append(c)
        if isinstance(c, click.Group):
            todo.extend(c.commands.values())
    return out
