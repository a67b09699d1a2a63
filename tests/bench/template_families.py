"""The template loss of issue 53 (daemon/bench/template_loss.py) for each chat-template
family of tests/data/chat_templates/ and the repository's own templates (the demo's, the
tiny test models', the tiny thinking model's).

A family's tokenizer is a tiny byte-level BPE (tests/tiny_models.py `write_tokenizer`)
with the family's special tokens as tokens of their own, as in its real vocabulary, and its
template: token counts are this tokenizer's, not the real one's (which spells ordinary
text in fewer tokens), but where turn 2 parts from turn 1 is the template's doing.

    python tests/bench/template_families.py    # the table of tests/bench/RESULTS.md
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny_models

from tiny_models import SPECIAL_TOKENS, write_tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
# Text the family tokenizers learn their merges from: an agent's chat, code, tool calls.
TEXT = """
You are a coding agent. Use the tools to read and change files; answer briefly.
The test tests/test_parser.py::test_trailing_comma fails. Find out why. Let me read the parser.
The user wants the failing test fixed. I should read the parser first, then the test.
{"name": "Read", "arguments": {"file_path": "/home/user/project/src/parser.py"}}
{"type": "function", "function": {"name": "Read", "description": "Reads a file from the local filesystem.",
"parameters": {"type": "object", "properties": {"file_path": {"type": "string", "description": "The absolute
path to the file to read"}}, "required": ["file_path"]}}}
def parse(text):
    return [int(x) for x in text.strip('[]').split(',')]
"""


def families() -> dict[str, dict[str, Any]]:
    return json.loads((DATA / "families.json").read_text())["families"]


def family_template(family: dict[str, Any]) -> str:
    text = (DATA / family["template"]).read_text()
    for old, new in family.get("replace", []):
        if old not in text:
            raise ValueError(f"{family['template']}: {old!r} is not in the template")
        text = text.replace(old, new)
    return text


def family_tokenizer(name: str, root: Path) -> Any:
    """mlx-lm's tokenizer wrapper of the family `name` (written under `root`)."""
    from mlx_lm.utils import load_tokenizer

    family = families()[name]
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    specials = tuple(dict.fromkeys((*SPECIAL_TOKENS, *family["special_tokens"])))
    write_tokenizer(path, special_tokens=specials, chat_template=family_template(family), text=TEXT)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["eos_token"] = family["eos"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(path)


def repository_tokenizers(root: Path) -> dict[str, Any]:
    """The templates this repository ships or tests with: the demo's, the tiny models'
    (plain ChatML: no tools), the tiny thinking model's (Qwen3-like, reasoning always kept)."""
    from mlx_lm.utils import load_tokenizer
    from thinking_model import write_thinking_tokenizer

    from moestream.shared.settings import demo_store_path

    out = {"demo": load_tokenizer(demo_store_path())}
    for name, write in (
        ("tiny test models", lambda p: write_tokenizer(p)),
        ("tiny thinking model", write_thinking_tokenizer),
    ):
        path = root / name.replace(" ", "_")
        path.mkdir(parents=True, exist_ok=True)
        write(path)
        out[name] = load_tokenizer(path)
    return out


def measure_all(root: Path) -> list[dict[str, Any]]:
    from moestream.daemon.bench.template_loss import call_text_renders, report, template_loss

    toks = repository_tokenizers(root) | {name: family_tokenizer(name, root) for name in families()}
    rows = [report(name, template_loss(tok), call_text_renders(tok)) for name, tok in toks.items()]
    return [r | {"architectures": families().get(r["template"], {}).get("architectures", [])} for r in rows]


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| template | architectures | prompt | answer | reasoning resent: parts at, lost "
        "| reasoning dropped: parts at, lost | where (cached / resent) | kept call text |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        resent, dropped = r["losses"]

        def cell(x: dict[str, Any]) -> str:
            at = x["first_difference"] - x["prompt_tokens"]
            return f"{'+' if at >= 0 else ''}{at}, **{x['lost_tokens']}**"

        where = dropped if dropped["lost_tokens"] else resent
        shown = f"`{where['cached_text'][:14]!r}` / `{where['resent_text'][:14]!r}`" if where["lost_tokens"] else "-"
        archs = ", ".join(r.get("architectures", [])) or "-"
        lines.append(
            f"| {r['template']} | {archs} | {resent['prompt_tokens']} | {resent['answer_tokens']} | {cell(resent)} | "
            f"{cell(dropped)} | {shown} | {CALL_TEXT[r['call_text_renders']]} |"
        )
    return "\n".join(lines)


CALL_TEXT = {True: "rendered", False: "template's", None: "no parser"}


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        print(markdown(measure_all(Path(root))))


if __name__ == "__main__":
    main()
