"""The demo model's training script, run end to end with `--tiny` on the CPU.

One real run (tiny dims, 40 steps, a slice of the stdlib) is shared by the tests: its
outputs are loaded with stock mlx-lm, its MTP head with `load_mtp`, its store with the
store reader, and its figures are checked against what the files say.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from demo_recipe.data import collect_corpus, source_files
from demo_recipe.model import (
    FULL,
    STORE_BUDGET_BYTES,
    STORE_WITH_MTP_BUDGET_BYTES,
    TINY,
    build_model,
    forward_train,
    moe_dense,
    over_budget,
    store_size_estimate,
)
from mlx.utils import tree_flatten

from moestream.daemon.model.demo_mtp import MTP_FILE, MTPHead, load_mtp
from moestream.shared.store_format import load_manifest

# The recipe lives outside the package (tests/bench/demo_recipe); it runs from its parent.
RECIPE_PARENT = Path(__file__).resolve().parent / "bench"

STEPS = 40
# The tests of a trained tiny recipe (its training takes about 40 s on 2 cores) run with
# `-m slow`; the recipe's parts are tested apart in the default run.
TRAINED = pytest.mark.slow
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MTP_FILE)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("demo") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "demo_recipe.train", "--out", str(out), "--tiny", "--steps", str(STEPS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=RECIPE_PARENT,
    )
    assert proc.returncode == 0, f"train --tiny failed:\n{proc.stdout}\n{proc.stderr}"
    return out, proc.stdout


@pytest.fixture(scope="module")
def metrics(run: tuple[Path, str]) -> dict:
    return json.loads((run[0] / "metrics.json").read_text())


@TRAINED
def test_outputs_exist(run: tuple[Path, str]) -> None:
    out, log = run
    for folder in ("model-f32", "model-4bit"):
        for name in MODEL_FILES:
            assert (out / folder / name).is_file(), f"{folder}/{name} missing"
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert (out / "store" / "manifest.json").is_file() and (out / "store" / MTP_FILE).is_file()
    # loss.png is drawn where matplotlib is installed; elsewhere the log says how to draw it.
    try:
        import matplotlib  # noqa: F401

        assert (out / "loss.png").stat().st_size > 1000
    except ModuleNotFoundError:
        assert "loss.png skipped" in log and "demo_recipe.plot" in log
        assert not (out / "loss.png").exists()


@TRAINED
def test_quantized_model_loads_and_generates(run: tuple[Path, str]) -> None:
    from mlx_lm import load, stream_generate

    out, _ = run
    config = json.loads((out / "model-4bit" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == TINY.group_size
    model, tokenizer = load(str(out / "model-4bit"))
    assert model.model.layers[0].mlp.switch_mlp.gate_proj.bits == 4
    responses = list(stream_generate(model, tokenizer, "def fibonacci(n):", max_tokens=8))
    assert responses and responses[-1].generation_tokens >= 1
    assert all(0 <= r.token < TINY.vocab_size for r in responses)


@TRAINED
def test_mtp_files_have_expected_keys_and_load(run: tuple[Path, str]) -> None:
    out, _ = run
    model, config = build_model(TINY, seed=0)
    expected = {"mtp." + k for k, _ in tree_flatten(MTPHead(model.args, TINY.mtp_intermediate_size).parameters())}
    float_keys = set(mx.load(str(out / "model-f32" / MTP_FILE)))
    assert float_keys == expected
    quant_keys = set(mx.load(str(out / "model-4bit" / MTP_FILE)))
    assert {"mtp.proj.scales", "mtp.proj.biases", "mtp.block.mlp.down_proj.scales"} <= quant_keys
    assert {k for k in quant_keys if not k.endswith((".scales", ".biases"))} == expected
    # The model files themselves carry no mtp.* weights, so stock mlx-lm loads them.
    assert not [k for k in mx.load(str(out / "model-4bit" / "model.safetensors")) if k.startswith("mtp.")]

    head, meta = load_mtp(out / "model-4bit" / MTP_FILE)
    assert meta["quantization"] == {"group_size": TINY.group_size, "bits": TINY.bits}
    assert isinstance(head.proj, nn.QuantizedLinear)
    hidden = mx.random.normal((1, 5, TINY.hidden_size))
    assert head(hidden, mx.random.normal((1, 5, TINY.hidden_size)), "causal").shape == (1, 5, TINY.hidden_size)


@TRAINED
def test_metrics_fields(metrics: dict) -> None:
    for key in (
        "settings", "config", "corpus", "device", "seed", "steps", "tokens_seen", "time_s", "train_curve",
        "validation", "validation_4bit", "routing", "sample", "store_bytes", "store_estimate_bytes",
    ):  # fmt: skip
        assert key in metrics, key
    assert metrics["steps"] == STEPS and metrics["seed"] == 0
    assert metrics["selection"] == {"rule": "mixed", "step": metrics["best_step"], "loss": pytest.approx(
        min(v["loss"] for v in metrics["train_curve"]["val"]))}  # fmt: skip
    assert metrics["train_curve"]["chat_val"] == [] and metrics["validation_chat"] is None
    assert metrics["tokens_seen"] == STEPS * metrics["settings"]["batch_size"] * metrics["settings"]["seq_len"]
    assert len(metrics["train_curve"]["loss"]) == STEPS
    for name in ("validation", "validation_4bit"):
        v = metrics[name]
        assert math.isfinite(v["loss"]) and v["ppl"] == pytest.approx(math.exp(v["loss"]))
        assert 0 <= v["next_token_acc"] <= 1 and 0 <= v["mtp_next_next_acc"] <= 1
    # Quantizing to 4 bits must not wreck the model.
    assert metrics["validation_4bit"]["loss"] < metrics["validation"]["loss"] + 0.5
    assert metrics["corpus"]["train_tokens"] > 0 and metrics["corpus"]["val_tokens"] > 0
    routing = metrics["routing"]["layers"]
    assert len(routing) == len(TINY.moe_layers)
    for layer in routing:
        assert sum(layer["fractions"]) == pytest.approx(1.0, abs=1e-4)
        assert 0 < layer["normalized_entropy"] <= 1
    assert metrics["sample"]["prompt"] == "def fibonacci(n):"


@TRAINED
def test_loss_decreased(metrics: dict) -> None:
    curve = metrics["train_curve"]
    first, last = np.mean(curve["ce"][:5]), np.mean(curve["ce"][-5:])
    assert last < first - 0.3, (first, last)
    assert np.mean(curve["mtp_ce"][-5:]) < np.mean(curve["mtp_ce"][:5]) - 0.3
    val = curve["val"]
    assert val[-1]["loss"] < val[0]["loss"] or metrics["validation"]["loss"] < math.log(TINY.vocab_size) - 0.5


@TRAINED
def test_store_matches_estimate(run: tuple[Path, str], metrics: dict) -> None:
    out, _ = run
    store = out / "store"
    manifest = load_manifest(store)
    assert [l.num_experts for l in manifest.layers] == [TINY.num_experts] * len(TINY.moe_layers)
    experts = sum((store / l.file).stat().st_size for l in manifest.layers)
    resident = sum((store / f).stat().st_size for f in manifest.resident_files)
    estimate = metrics["store_estimate_bytes"]
    assert experts == estimate["experts"]
    assert abs(resident - estimate["resident"]) < 0.05 * resident, (resident, estimate["resident"])
    mtp = (store / MTP_FILE).stat().st_size
    assert abs(mtp - estimate["mtp"]) < 0.1 * mtp, (mtp, estimate["mtp"])
    assert (store / "manifest.json").stat().st_size <= estimate["manifest"]
    assert 0.95 * estimate["store"] <= metrics["store_bytes"]["store"] <= estimate["store"]
    assert metrics["store_bytes"]["total"] == sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def test_full_shape_fits_the_budget() -> None:
    estimate = store_size_estimate(FULL, tokenizer_bytes=300_000)
    assert over_budget(estimate["store"], estimate["mtp"]) is None
    assert (
        estimate["store"] <= STORE_BUDGET_BYTES and estimate["store"] + estimate["mtp"] <= STORE_WITH_MTP_BUDGET_BYTES
    )
    bigger = store_size_estimate(replace(FULL, num_hidden_layers=8), tokenizer_bytes=300_000)
    assert "over the budget" in over_budget(bigger["store"], bigger["mtp"])


@TRAINED
def test_dense_experts_equal_stock_forward(run: tuple[Path, str]) -> None:
    """The training forward pass computes what stock mlx-lm computes from the same weights."""
    from mlx_lm import load

    out, _ = run
    model, _ = load(str(out / "model-f32"))
    tokens = mx.array(np.random.default_rng(1).integers(0, TINY.vocab_size, size=(2, 24)))
    got = forward_train(model, tokens)
    want = model(tokens)
    assert mx.allclose(got.logits, want, atol=1e-4, rtol=1e-4).item()
    assert mx.allclose(got.hidden, model.model(tokens), atol=1e-5).item()


def test_unchosen_experts_get_no_gradient() -> None:
    model, _ = build_model(TINY, seed=3)
    block = model.model.layers[0].mlp
    x = mx.random.normal((1, 3, TINY.hidden_size), key=mx.random.key(0))
    probs = mx.softmax(block.gate(x), axis=-1)
    chosen = set(
        np.asarray(mx.argpartition(probs, kth=-TINY.num_experts_per_tok, axis=-1)[..., -TINY.num_experts_per_tok :])
        .ravel()
        .tolist()
    )

    def loss(params: dict) -> mx.array:
        block.update(params)
        return moe_dense(block, x)[0].sum()

    grads = mx.grad(loss)(block.trainable_parameters())
    g = np.asarray(grads["switch_mlp"]["down_proj"]["weight"])
    used = {e for e in range(TINY.num_experts) if np.abs(g[e]).sum() > 0}
    assert used == chosen


def test_corpus_rules(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    files = {f"m{i:02d}.py": f"def f{i}():\n    return {i}\n" * 20 for i in range(12)}
    files |= {
        "test/test_a.py": "assert True\n",
        "pkg/tests/t.py": "assert True\n",
        "encodings/cp1.py": "table = ()\n",
        "site-packages/d.py": "y = 2\n",
        "big.py": "#" * 400_000,
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "latin.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    plain = sorted([f"m{i:02d}.py" for i in range(12)] + ["latin.py"])
    assert source_files(root) == plain
    assert source_files(root, include_tests=True) == sorted(plain + ["pkg/tests/t.py", "test/test_a.py"])

    corpus = collect_corpus(100_000, val_percent=20, root=root)
    assert corpus.skipped_undecodable == 1
    assert corpus.val_files == ("m03.py",)  # fixed by the hash of the path alone
    assert len(corpus.train_files) == 11
    assert collect_corpus(100_000, val_percent=20, root=root).digest == corpus.digest
    # A cap gives each split its share and still keeps the split of every file.
    cap = 5 * len(files["m00.py"])
    small = collect_corpus(cap, val_percent=20, root=root)
    assert small.val_files == ("m03.py",)
    assert 0 < small.train_bytes <= cap - cap // 5 and set(small.train_files) < set(corpus.train_files)


def test_bad_steps_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "demo_recipe.train", "--out", str(tmp_path), "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RECIPE_PARENT,
    )
    assert proc.returncode == 2 and "--steps must be at least 1" in proc.stderr


@TRAINED
def test_plot_command(run: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = run
    png = tmp_path / "loss.png"
    proc = subprocess.run(
        [sys.executable, "-m", "demo_recipe.plot", str(out / "metrics.json"), str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RECIPE_PARENT,
    )
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        assert proc.returncode == 1 and "matplotlib is not installed" in proc.stderr
        assert not png.exists()
    else:
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Slow: a real (tiny) training run of several seconds. How close a run ends to its budget
# is a wall-clock figure, which the recipe's log reports ("plan: ... ms/step"); asserted
# here, it failed whenever other tests shared the cores (27.6 s against 9.2).
@pytest.mark.slow
def test_step_count_is_planned_from_the_time_budget(tmp_path: Path) -> None:
    from demo_recipe.train import Trainee, TrainSettings, train_loop

    from moestream.daemon.model.demo_mtp import MTPHead as Head

    settings = TrainSettings.tiny_preset(str(tmp_path), steps=None, minutes=0.08, warmup_steps=8, eval_every=10_000)
    model, _ = build_model(TINY, seed=0)
    trainee = Trainee(model, Head(model.args, TINY.mtp_intermediate_size))
    rng = np.random.default_rng(0)
    train_ids = rng.integers(0, TINY.vocab_size, size=20_000).astype(np.int32)
    val_ids = rng.integers(0, TINY.vocab_size, size=2_000).astype(np.int32)
    result = train_loop(trainee, train_ids, val_ids, settings)
    # The probe (at the end of warm-up) evaluates once and fixes the total; the last step evaluates again.
    assert [v["step"] for v in result.curve.val] == [8, result.steps]
    assert result.curve.step == list(range(1, result.steps + 1))
    # Planned from the budget, not the epoch cap: far fewer steps than the data allows.
    assert 8 < result.steps < len(train_ids) // (settings.batch_size * settings.seq_len) * settings.max_epochs


@TRAINED
def test_fine_tune_from_the_store_keeps_the_tokenizer_and_mixes_chat(run: tuple[Path, str], tmp_path: Path) -> None:
    start, _ = run
    out = tmp_path / "ft"
    proc = subprocess.run(
        [sys.executable, "-m", "demo_recipe.train", "--out", str(out), "--tiny", "--steps", "10",
         "--init-from", str(start / "store"), "--chat-fraction", "0.4", "--warmup-steps", "2", "--select", "chat",
         "--eval-every", "5"],
        capture_output=True, text=True, timeout=300, cwd=RECIPE_PARENT,
    )  # fmt: skip
    assert proc.returncode == 0, f"the fine-tune failed:\n{proc.stdout}\n{proc.stderr}"
    assert (out / "store" / "tokenizer.json").read_bytes() == (start / "store" / "tokenizer.json").read_bytes()
    tuned, trained = (json.loads((d / "metrics.json").read_text()) for d in (out, start))
    chat = tuned["corpus"]["chat"]
    assert chat["qa"] and chat["call"] and chat["result"]
    # Chat is 0.4 of the stream, with every distinct conversation in it (the code tiled if short).
    code = chat["code_train_tokens_tiled"]
    assert code >= tuned["corpus"]["train_tokens"] and chat["train_tokens"] == int(code * 0.4 / 0.6)
    assert chat["train_tokens"] >= chat["distinct_tokens"]
    chat_curve = tuned["train_curve"]["chat_val"]
    assert [v["step"] for v in chat_curve] == [5, 10] and tuned["selection"]["rule"] == "chat"
    assert tuned["selection"]["step"] == min(chat_curve, key=lambda v: v["loss"])["step"]
    assert chat["cities"]["invented"] > 0 and tuned["validation_chat"]["tokens"] > 0
    # It starts where the first run ended, not from a fresh model's ln(vocab).
    assert tuned["train_curve"]["ce"][0] < trained["train_curve"]["ce"][0] - 0.5
    assert "<|im_start|>" in json.loads((out / "store" / "tokenizer_config.json").read_text())["chat_template"]
