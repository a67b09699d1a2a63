"""Issue 53, point 2: the tokens a chat template loses when an agent's history comes back
(daemon/bench/template_loss.py), computed for templates whose rules are known: one that
keeps a resent reasoning block, one that drops it from the history (the loss is then that
block and what follows it), one that never renders it, and the demo's, which has none."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from template_families import family_tokenizer, measure_all, repository_tokenizers

from moestream.daemon.bench.template_loss import REASONING, call_text_renders, generated_text, template_loss
from moestream.shared.settings import demo_store_path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("templates")


def _by(losses):
    return {x.resend: x for x in losses}


def test_a_template_that_drops_a_turns_reasoning_loses_that_block_and_the_rest_of_the_answer(root):
    tok = family_tokenizer("qwen3", root)  # reasoning kept only where resent after the last user query
    answer = generated_text(tok)
    assert answer.startswith(tok.think_start + "\n" + REASONING) and answer.endswith("</tool_call><|im_end|>")
    resent, dropped = (_by(template_loss(tok))[k] for k in ("reasoning resent", "reasoning dropped"))
    # Resent, the block renders as the model wrote it: nothing lost.
    assert resent.lost_tokens == 0 and resent.first_difference == resent.prompt_tokens + resent.answer_tokens
    # Dropped, turn 2 parts at the block's first token: the block and everything after it.
    assert dropped.first_difference == dropped.prompt_tokens and dropped.lost_tokens == dropped.answer_tokens
    assert dropped.cached_text.startswith("<think>") and dropped.resent_text.startswith("Let me read")


def test_a_template_that_never_renders_reasoning_loses_it_and_the_opened_block_token(root):
    tok = family_tokenizer("deepseek-v3.1", root)  # the history writes `</think>` + the answer
    answer = generated_text(tok)
    assert answer.startswith(REASONING + "\n</think>")  # written after the prompt's own <think>
    block = len(tok.encode(REASONING + "\n", add_special_tokens=False))
    for x in template_loss(tok):
        # The prompt's last token (<think>) already differs, then the whole answer.
        assert x.first_difference == x.prompt_tokens - 1 and x.lost_tokens == x.answer_tokens + 1
        assert x.answer_tokens > block


def test_the_repositorys_templates(root):
    toks = repository_tokenizers(root)
    demo = _by(template_loss(toks["demo"]))
    assert all(x.lost_tokens == 0 for x in demo.values())  # no reasoning; the call renders as written
    thinking = _by(template_loss(toks["tiny thinking model"]))
    assert thinking["reasoning resent"].lost_tokens == 0
    # The generation prompt opened <think>\n (2 tokens) that a turn without reasoning lacks.
    dropped = thinking["reasoning dropped"]
    assert dropped.first_difference == dropped.prompt_tokens - 2 and dropped.lost_tokens == dropped.answer_tokens + 2


def test_a_kept_call_text_renders_in_each_family_with_a_tool_call_parser(root):
    """The gateway's kept text of a call replaces the template's serialisation of it in
    every family whose calls mlx-lm parses: JSON (Qwen3), XML (Qwen3.5), <arg_key> (GLM),
    <invoke> (MiniMax), Kimi's section tokens; DeepSeek's calls have no parser here."""
    for name in ("qwen3.5", "glm-4.5", "minimax-m2", "kimi-k2-thinking"):
        assert call_text_renders(family_tokenizer(name, root)) is True, name
    assert call_text_renders(family_tokenizer("deepseek-v3.1", root)) is None
    assert call_text_renders(repository_tokenizers(root)["demo"]) is True


@pytest.mark.slow  # every family: about 30 s
def test_every_family_is_measured(root):
    rows = measure_all(root)
    assert {r["template"] for r in rows} >= {"demo", "qwen3", "glm-4.5", "minimax-m2", "kimi-k2-thinking"}
    for r in rows:
        for x in r["losses"]:
            assert 0 <= x["lost_tokens"] <= x["prompt_tokens"] + x["answer_tokens"]


def test_the_bench_command_measures_a_stores_own_template():
    out = subprocess.run(
        [sys.executable, "-m", "moestream.client.cli", "bench", "session", "--model", str(demo_store_path())]
        + ["--template-loss", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert [x["resend"] for x in row["losses"]] == ["reasoning resent", "reasoning dropped"]
    assert all(x["lost_tokens"] == 0 and x["answer_tokens"] > 0 for x in row["losses"])
    assert row["call_text_renders"] is True
