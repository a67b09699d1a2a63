"""Every MoE architecture the installed mlx-lm runs, streamed exactly.

The model files with stacked experts are found by scanning mlx-lm's `models/` folder
(tests/arch_table.py `stacked_expert_files`); each must be in the table, which says how
to build a tiny instance. Each is converted to an expert store and streamed at top-k
capacity and at half of its experts, prefetch on and off, 4-bit and float32: greedy
tokens and every step's logits equal stock mlx-lm's bit for bit (tests/arch_runner.py).
The default run takes every architecture at 4-bit, top-k, prefetch on; `-m slow` runs
the rest of the matrix. An architecture that fails is an expected failure (strict) with
its reason in the table, so a fix shows up as an unexpected pass.
"""

from __future__ import annotations

import pytest
from arch_runner import Converted, check_streamed, convert_arch
from arch_table import ARCHS, markdown, stacked_expert_files, supported

FILES = stacked_expert_files()
QUANTS = ("4bit", "f32")
CAPACITIES = ("topk", "half")
PREFETCH = ("on", "off")


def _cases() -> list:
    cases = []
    for model_type in FILES:
        arch = ARCHS.get(model_type)
        for quant in QUANTS:
            for capacity in CAPACITIES:
                for prefetch in PREFETCH:
                    marks = []
                    if (quant, capacity, prefetch) != ("4bit", "topk", "on"):
                        marks.append(pytest.mark.slow)
                    reason = arch.xfail_reason(quant) if arch is not None else None
                    if reason is not None:
                        marks.append(pytest.mark.xfail(strict=True, reason=reason))
                    cases.append(
                        pytest.param(
                            model_type,
                            quant,
                            capacity,
                            prefetch,
                            id=f"{model_type}-{quant}-{capacity}-{prefetch}",
                            marks=marks,
                        )
                    )
    return cases


@pytest.fixture(scope="session")
def converted_arch(tmp_path_factory):
    """`converted_arch(model_type, quant) -> Converted`, built once per session (a build
    or convert that raised raises again, without a second try)."""
    done: dict[tuple[str, str], Converted | BaseException] = {}

    def get(model_type: str, quant: str) -> Converted:
        key = (model_type, quant)
        if key not in done:
            try:
                done[key] = convert_arch(model_type, quant, tmp_path_factory.mktemp(f"{model_type}-{quant}"))
            except Exception as e:
                done[key] = e
        if isinstance(done[key], BaseException):
            raise done[key]
        return done[key]

    return get


def test_the_table_knows_every_model_file_with_stacked_experts():
    assert len(FILES) > 40, f"the scan of mlx-lm's models found only {FILES}"
    unknown = [name for name in FILES if name not in ARCHS]
    assert not unknown, (
        f"mlx-lm model files with stacked experts that tests/arch_table.py does not know: {', '.join(unknown)}; "
        "add a tiny config for each to ARCHS"
    )
    gone = sorted(set(ARCHS) - set(FILES))
    assert not gone, f"tests/arch_table.py has entries for files mlx-lm no longer has with stacked experts: {gone}"


@pytest.mark.parametrize("model_type,quant,capacity,prefetch", _cases())
def test_streamed_exactly(converted_arch, model_type, quant, capacity, prefetch):
    if model_type not in ARCHS:
        pytest.fail(
            f"mlx-lm's models/{model_type}.py keeps stacked experts, but tests/arch_table.py does not know it: "
            "add a tiny config for it to ARCHS"
        )
    check_streamed(converted_arch(model_type, quant), capacity, prefetch)


def test_the_supported_list():
    names = supported()
    assert names and set(names) <= set(FILES)
    text = markdown()
    assert all(f"`{name}`" in text for name in ARCHS)
    assert len(text.splitlines()) == len({arch.family for arch in ARCHS.values()})


def test_the_readme_lists_the_supported_architectures():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    listed = text.split("<!-- architectures -->\n", 1)[1].split("<!-- end architectures -->", 1)[0]
    assert listed.strip().split(", ") == supported(), (
        "README.md's list of architectures differs from tests/arch_table.py: regenerate it with "
        "`python tests/arch_table.py --list`, comma-separated, between the architectures markers"
    )
