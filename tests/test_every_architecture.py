"""Every MoE architecture the installed mlx-lm runs, streamed exactly.

The model files with stacked experts are found by scanning mlx-lm's `models/` folder
(tests/arch_table.py `stacked_expert_files`); each must be in the table, which says how
to build a tiny instance (and `VARIANTS`, more configs of some). Each is converted to an
expert store and streamed with default settings at top-k capacity and at half of its
experts, prefetch on and off, 4-bit and float32, through the daemon's own path (the
layer-major prefill, which each prompt takes): greedy tokens and every step's logits
equal stock mlx-lm's `generate_step` bit for bit, and the prefill went the way `status`
says (tests/arch_runner.py). Each decode forward is also forced through the optimistic
path (daemon/model/optimistic.py: residency checked every few layers, the forward redone
from a layer that missed), which at top-k redoes forwards in most tokens. The default run
takes every architecture at 4-bit, top-k, short prompts, prefetch on by the miss rule and
prefetch off forced optimistic; `-m slow` runs the rest of the matrix, and a 600-token
prompt at every quantization and capacity. An architecture that fails is an expected
failure (strict) with its reason in the table, so a fix shows up as an unexpected pass.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from arch_runner import LONG, SHORT, Converted, check_streamed, convert_arch
from arch_table import ARCHS, VARIANTS, arch_of, markdown, stacked_expert_files, supported, tiny_arch_config
from tiny_models import make_tiny_model

FILES = stacked_expert_files()
QUANTS = ("4bit", "f32")
CAPACITIES = ("topk", "half")
PREFETCH = ("on", "off")
PROMPTS = {"short": SHORT, "long": LONG}
# "rule": decode forwards check residency every few layers where the miss rule says so;
# "always": wherever they can, redone from each layer that missed (prefetch off, short prompts).
OPTIMISTIC = ("rule", "always")
DEFAULT_RUN = {("4bit", "topk", "on", "short", "rule"), ("4bit", "topk", "off", "short", "always")}


def _cases() -> list:
    cases = []
    for model_type in [*FILES, *VARIANTS]:
        arch = arch_of(model_type) if model_type in ARCHS or model_type in VARIANTS else None
        for quant in QUANTS:
            for capacity in CAPACITIES:
                for prefetch in PREFETCH:
                    for prompts in PROMPTS:
                        for optimistic in OPTIMISTIC:
                            if prompts == "long" and prefetch == "off":
                                continue
                            if optimistic == "always" and (prefetch, prompts) != ("off", "short"):
                                continue
                            case = (quant, capacity, prefetch, prompts, optimistic)
                            marks = []
                            if case not in DEFAULT_RUN:
                                marks.append(pytest.mark.slow)
                            reason = arch.xfail_reason(quant) if arch is not None else None
                            if reason is not None:
                                marks.append(pytest.mark.xfail(strict=True, reason=reason))
                            cases.append(pytest.param(model_type, *case, id="-".join((model_type, *case)), marks=marks))
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


@pytest.mark.parametrize("model_type,quant,capacity,prefetch,prompts,optimistic", _cases())
def test_streamed_exactly(converted_arch, model_type, quant, capacity, prefetch, prompts, optimistic):
    if model_type not in ARCHS and model_type not in VARIANTS:
        pytest.fail(
            f"mlx-lm's models/{model_type}.py keeps stacked experts, but tests/arch_table.py does not know it: "
            "add a tiny config for it to ARCHS"
        )
    check_streamed(converted_arch(model_type, quant), capacity, prefetch, PROMPTS[prompts], optimistic)


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


def test_muse_spark_keeps_its_norm_beside_the_experts_resident(tmp_path):
    """muse_spark's SwitchGLU holds a post-expert norm, one weight for every expert, that
    the MoE block around it calls: convert keeps it with the resident weights, the
    streaming model loads it and reaches it through the streaming layer. (Its forward
    needs Metal, so exactness is checked only where Metal runs: the table's cases.)"""
    from mlx.utils import tree_flatten

    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.daemon.store.convert import convert_model
    from moestream.shared.settings import Settings
    from moestream.shared.store_format import load_manifest

    src = make_tiny_model(tmp_path / "model", "muse_spark", quant="4bit", seed=3, config=tiny_arch_config("muse_spark"))
    convert_model(src, tmp_path / "store")
    manifest = load_manifest(tmp_path / "store")
    assert all("post_expert_norm" not in t.name for layer in manifest.layers for t in layer.tensors)
    source = {}
    for f in sorted(src.glob("*.safetensors")):
        source.update(mx.load(str(f)))
    norms = {k: v for k, v in source.items() if "post_expert_norm" in k}
    assert len(norms) == len(manifest.layers)
    sm = load_streaming_model(tmp_path / "store", Settings(capacity=0.5, direct_io=True))
    try:
        loaded = dict(tree_flatten(sm.model.parameters()))
        for name, weight in norms.items():
            inner = name.replace(".experts.", ".experts.inner.")
            assert mx.array_equal(loaded[inner], weight), name
        moes = [m for n, m in sm.model.named_modules() if n.endswith("mlp.experts")]
        assert moes and all(m.post_expert_norm is m.inner.post_expert_norm for m in moes)
    finally:
        sm.close()
