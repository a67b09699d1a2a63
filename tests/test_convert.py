"""`moestreamctl convert` and the tiny test models it is tested on.

Every check compares against what stock mlx-lm loads from the source folder: expert
blocks read back with plain file reads, resident safetensors, manifest, checksums.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear, SwitchMLP
from mlx_lm.utils import _get_classes, load_config
from synthetic_store import tensor_spec
from tiny_models import MOE_ARCHS, make_tiny_model

from moestream.client.cli import main as cli
from moestream.daemon.store.convert import convert_model, required_free_bytes
from moestream.daemon.store.layout import describe_switch
from moestream.shared.settings import demo_store_path
from moestream.shared.store_format import (
    EXPERT_ALIGN,
    MANIFEST_NAME,
    TENSOR_ALIGN,
    StoreError,
    content_store_id,
    load_manifest,
    manifest_stamp,
    vanished_store_problem,
)

CASES = (
    [(a, "4bit") for a in MOE_ARCHS] + [(a, "bf16") for a in MOE_ARCHS] + [("mixtral", "8bit"), ("qwen3_moe", "f32")]
)


def raw(a: mx.array) -> bytes:
    mx.eval(a)
    return memoryview(a).tobytes()


def modules_by_path(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules())


def leftovers(out: Path) -> list[Path]:
    """Hidden partial/replaced siblings a convert into `out` might leave behind."""
    return sorted(out.parent.glob(f".{out.name}.*"))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- the tiny models themselves --------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiny_model_loads_with_stock_mlx_lm_and_routes_to_many_experts(tiny_model, arch):
    path = tiny_model(arch, "4bit")
    model, tokenizer = mlx_lm.load(str(path))
    text = "def route(hidden, gate): the quick brown fox"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert max(ids) < 512 and len(ids) < len(text)  # BPE merges happened
    assert tokenizer.eos_token_ids == {0}

    # Record the experts each Switch layer is asked for on 128 distinct tokens.
    picks: dict[str, list[mx.array]] = {}

    class Recorder(nn.Module):
        def __init__(self, inner: nn.Module, log: list[mx.array]):
            super().__init__()
            self.inner = inner
            self._log = log

        def __call__(self, x, indices):
            self._log.append(indices)
            return self.inner(x, indices)

    mods = modules_by_path(model)
    for name, m in list(mods.items()):
        if isinstance(m, (SwitchGLU, SwitchMLP)):
            parent, attr = name.rsplit(".", 1)
            picks[name] = []
            setattr(mods[parent], attr, Recorder(m, picks[name]))
    logits = model(mx.array([list(range(3, 131))]))
    assert logits.shape == (1, 128, 512) and bool(mx.all(mx.isfinite(logits)))
    assert picks
    for name, log in picks.items():
        rows = log[0].reshape(-1, log[0].shape[-1]).tolist()
        num_experts = modules_by_path(model)[name].inner.gate_proj.num_experts
        chosen = Counter(e for r in rows for e in r)
        assert len(chosen) == num_experts, f"{name}: some experts never chosen"
        assert len({tuple(sorted(r)) for r in rows}) >= 16, f"{name}: routing is degenerate"


def test_tiny_model_is_deterministic_and_shards(tiny_model, tmp_path):
    a = make_tiny_model(tmp_path / "a", "qwen3_moe", seed=3)
    b = make_tiny_model(tmp_path / "b", "qwen3_moe", seed=3)
    c = make_tiny_model(tmp_path / "c", "qwen3_moe", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()

    sharded = tiny_model("deepseek_v3", "4bit", shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (sharded / "model.safetensors").exists()
    single = dict(tree_flatten(mlx_lm.load(str(tiny_model("deepseek_v3", "4bit")))[0].parameters()))
    split = dict(tree_flatten(mlx_lm.load(str(sharded))[0].parameters()))
    assert single.keys() == split.keys()
    assert all(raw(single[k]) == raw(split[k]) for k in single)


# ---- a converted store holds exactly the model -----------------------------------------


@pytest.fixture(scope="module")
def converted(tiny_model, tmp_path_factory):
    """(source folder, store folder) per case, converted once for this module."""
    root = tmp_path_factory.mktemp("stores")
    done: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(arch: str, quant: str) -> tuple[Path, Path]:
        if (arch, quant) not in done:
            src = tiny_model(arch, quant)
            out = root / f"{arch}-{quant}"
            convert_model(src, out)
            done[arch, quant] = (src, out)
        return done[arch, quant]

    return get


@pytest.mark.parametrize("arch,quant", CASES)
def test_store_matches_stock_mlx_lm_bit_for_bit(converted, arch, quant):
    src, out = converted(arch, quant)
    manifest = load_manifest(out)
    model, _ = mlx_lm.load(str(src))
    mods = modules_by_path(model)
    params = dict(tree_flatten(model.parameters()))

    switch_paths = sorted(p for p, m in mods.items() if isinstance(m, (SwitchGLU, SwitchMLP)))
    assert sorted(layer.module_path for layer in manifest.layers) == switch_paths
    assert [layer.ordinal for layer in manifest.layers] == list(range(len(switch_paths)))
    expert_params = set()
    for layer in manifest.layers:
        switch = mods[layer.module_path]
        projections = ("gate_proj", "up_proj", "down_proj") if layer.kind == "SwitchGLU" else ("fc1", "fc2")
        assert layer.kind == type(switch).__name__
        assert layer.stride % EXPERT_ALIGN == 0
        layer_file = out / layer.file
        assert layer_file.stat().st_size == layer.num_experts * layer.stride
        stacked = {t.name: params[f"{layer.module_path}.{t.name}"] for t in layer.tensors}
        expert_params.update(f"{layer.module_path}.{t.name}" for t in layer.tensors)
        assert {n.split(".")[0] for n in stacked} == set(projections)
        for proj in projections:
            q = layer.quantization[proj]
            if quant in ("bf16", "f32"):
                assert q is None
            else:
                assert q == {"group_size": 32, "bits": int(quant[0]), "mode": "affine"}
        with open(layer_file, "rb") as f:
            for e, entry in enumerate(layer.experts):
                f.seek(entry.offset)
                block = f.read(layer.stride)
                assert zlib.crc32(block[: entry.length]) == entry.crc32
                assert block[entry.length :] == bytes(layer.stride - entry.length)
                for t in layer.tensors:
                    original = stacked[t.name][e]
                    assert t.offset % TENSOR_ALIGN == 0
                    assert t.shape == tuple(original.shape)
                    assert t.dtype == str(original.dtype).rsplit(".", 1)[-1]
                    f.seek(entry.offset + t.offset)
                    assert f.read(t.nbytes) == raw(original), f"{layer.module_path} expert {e} {t.name}"

    resident: dict[str, mx.array] = {}
    for name in manifest.resident_files:
        part = mx.load(str(out / name))
        assert not resident.keys() & part.keys()
        resident.update(part)
    assert set(resident) == set(params) - expert_params
    for k, v in resident.items():
        assert v.dtype == params[k].dtype and raw(v) == raw(params[k]), k

    config = load_config(src)
    assert manifest.config == config
    assert manifest.model_type == config["model_type"]
    assert ("quantization" in manifest.config) == (quant in ("4bit", "8bit"))
    if quant == "f32":
        assert {t.dtype for layer in manifest.layers for t in layer.tensors} == {"float32"}
    model_class, args_class = _get_classes(manifest.config)
    assert model_class is type(model)
    for name in manifest.tokenizer_files:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest.tokenizer_files)
    assert not leftovers(out)


def test_flipped_byte_changes_the_checksum(converted):
    _, out = converted("qwen3_moe", "4bit")
    layer = load_manifest(out).layers[1]
    entry = layer.experts[5]
    data = bytearray((out / layer.file).read_bytes()[entry.offset : entry.offset + entry.length])
    assert zlib.crc32(data) == entry.crc32
    data[tensor_spec(layer, "down_proj.scales").offset + 3] ^= 0x01
    assert zlib.crc32(data) != entry.crc32


def test_sharded_source_and_several_resident_files(tiny_model, tmp_path):
    src = tiny_model("deepseek_v3", "4bit", shards=2)
    reports: list[tuple[int, int]] = []
    manifest = convert_model(
        src, tmp_path / "store", resident_shard_bytes=64 << 10, progress=lambda d, t: reports.append((d, t))
    )
    assert len(manifest.resident_files) > 2
    assert [r[0] for r in reports] == sorted(r[0] for r in reports)
    assert (
        reports[-1][0]
        == reports[-1][1]
        == sum(l.num_experts * l.stride for l in manifest.layers)
        + sum((tmp_path / "store" / f).stat().st_size for f in manifest.resident_files)
        - sum(_safetensors_header_bytes(tmp_path / "store" / f) for f in manifest.resident_files)
    )
    model, _ = mlx_lm.load(str(src))
    params = dict(tree_flatten(model.parameters()))
    resident = {}
    for name in manifest.resident_files:
        resident.update(mx.load(str(tmp_path / "store" / name)))
    expert = {f"{l.module_path}.{t.name}" for l in manifest.layers for t in l.tensors}
    assert set(resident) == set(params) - expert
    assert all(raw(resident[k]) == raw(params[k]) for k in resident)


def _safetensors_header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


# ---- refusals --------------------------------------------------------------------------


def test_refuses_a_model_without_moe_layers(tiny_model, tmp_path):
    out = tmp_path / "store"
    with pytest.raises(StoreError, match="no MoE layers"):
        convert_model(tiny_model("qwen3", "4bit"), out)
    assert not out.exists() and not leftovers(out)


def test_refuses_experts_kept_as_one_module_each(tiny_model, tmp_path):
    out = tmp_path / "store"
    with pytest.raises(StoreError, match=r"unknown expert layout.*one module per expert.*experts\.0"):
        convert_model(tiny_model("dbrx", "4bit"), out)
    assert not out.exists() and not leftovers(out)


def test_refuses_switch_modules_with_unknown_projections():
    class ExtraProjection(SwitchGLU):
        def __init__(self):
            super().__init__(64, 32, 4)
            self.gate2_proj = SwitchLinear(64, 32, 4, bias=False)

    with pytest.raises(StoreError, match=r"unknown expert layout at m\.switch.*gate2_proj"):
        describe_switch("m.switch", ExtraProjection())

    renamed = SwitchMLP(64, 32, 4)
    renamed.fc1 = nn.Linear(64, 32)  # one dense layer where stacked experts belong
    with pytest.raises(StoreError, match="fc1 is Linear"):
        describe_switch("m.switch", renamed)

    ok = describe_switch("m.switch", SwitchMLP(64, 32, 4))
    assert ok.names == ("fc1.weight", "fc2.weight") and ok.num_experts == 4


def test_refuses_a_missing_shard(tiny_model, tmp_path):
    src = copy_model(tiny_model("mixtral", "4bit", shards=2), tmp_path / "model")
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(StoreError, match="missing: model-00002-of-00002.safetensors"):
        convert_model(src, tmp_path / "store")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("keep", ["data", "header", "prefix"])
def test_refuses_a_truncated_shard(tiny_model, tmp_path, keep):
    src = copy_model(tiny_model("mixtral", "4bit", shards=2), tmp_path / "model")
    shard = src / "model-00001-of-00002.safetensors"
    size = {"data": shard.stat().st_size - 100, "header": 40, "prefix": 5}[keep]
    os.truncate(shard, size)
    with pytest.raises(StoreError, match=f"{re.escape(str(shard))}.*truncated"):
        convert_model(src, tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_refuses_when_free_space_is_short(tiny_model, tmp_path):
    src = tiny_model("qwen3_moe", "4bit")
    out = tmp_path / "store"
    asked: list[Path] = []

    def tiny_disk(folder: Path) -> int:
        asked.append(folder)
        return 10 << 20

    with pytest.raises(StoreError, match=f"not enough free disk space in {re.escape(str(tmp_path))}"):
        convert_model(src, out, disk_free=tiny_disk)
    assert asked == [tmp_path] and not out.exists() and not leftovers(out)
    # The same check passes when the space is there.
    convert_model(src, out, disk_free=lambda _: 1 << 40)
    load_manifest(out)


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) -> folder on a real tmpfs of that size (needs CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        point = tmp_path / f"tmpfs-{size}"
        point.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the injected check above covers the logic")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def test_refuses_a_real_file_system_that_is_too_small(tiny_model, small_tmpfs):
    src = tiny_model("qwen3_moe", "4bit")
    small = small_tmpfs("2m")
    with pytest.raises(StoreError, match="not enough free disk space"):
        convert_model(src, small / "store")
    assert list(small.iterdir()) == []
    big = small_tmpfs("96m")
    manifest = convert_model(src, big / "store")
    assert load_manifest(big / "store") == manifest
    assert required_free_bytes(0) < (96 << 20)


def test_existing_store_needs_force_and_is_replaced_whole(tiny_model, tmp_path):
    out = tmp_path / "store"
    first = convert_model(tiny_model("qwen3_moe", "4bit", seed=0), out)
    with pytest.raises(StoreError, match="already holds an expert store; pass --force"):
        convert_model(tiny_model("qwen3_moe", "4bit", seed=1), out)
    assert load_manifest(out) == first
    second = convert_model(tiny_model("qwen3_moe", "4bit", seed=1), out, force=True)
    assert load_manifest(out) == second
    assert second.layers[0].experts != first.layers[0].experts  # new weights, new CRCs
    assert not leftovers(out)


def test_never_replaces_a_folder_that_is_not_a_store(tiny_model, tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(StoreError, match="not empty and is not an expert store"):
        convert_model(tiny_model("qwen3_moe", "4bit"), out, force=True)
    assert (out / "cat.jpg").read_bytes() == b"\xff\xd8"
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_model(tiny_model("qwen3_moe", "4bit"), empty)
    assert (empty / MANIFEST_NAME).is_file()


def test_an_interrupted_convert_leaves_no_store(tiny_model, tmp_path):
    src = tiny_model("deepseek_v3", "4bit")
    out = tmp_path / "store"

    def interrupt(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_model(src, out, progress=interrupt)
    assert not out.exists() and not leftovers(out)

    # A partial folder left by a process that died is cleaned up by the next run.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".store.partial-{int(dead.stdout)}"
    (stale / "experts").mkdir(parents=True)
    convert_model(src, out)
    assert not stale.exists() and load_manifest(out).layers


def test_a_store_id_is_fresh_from_convert_and_comes_from_the_content_of_an_older_store(converted, tiny_model, tmp_path):
    _, out = converted("qwen3_moe", "4bit")
    first = load_manifest(out)
    again = convert_model(tiny_model("qwen3_moe", "4bit"), tmp_path / "again")
    assert first.store_id and again.store_id != first.store_id  # one model converted twice: two stores
    assert load_manifest(shutil.copytree(out, tmp_path / "copy")).store_id == first.store_id
    # Stores written before ids existed: each copy gets the same id from its manifest's
    # content, however the JSON is laid out.
    older = []
    for name, indent in (("old1", None), ("old2", 2)):
        folder = Path(shutil.copytree(out, tmp_path / name))
        data = json.loads((folder / MANIFEST_NAME).read_text())
        del data["store_id"]
        (folder / MANIFEST_NAME).write_text(json.dumps(data, indent=indent))
        older.append(load_manifest(folder).store_id)
    assert older[0] == older[1] == content_store_id(data) != first.store_id
    # The demo store's committed id is its content's: a demo installed before ids existed
    # is the same store.
    demo = json.loads((demo_store_path() / MANIFEST_NAME).read_text())
    assert demo["store_id"] == content_store_id(demo) == load_manifest(demo_store_path()).store_id
    bad = {**data, "store_id": 7}
    (tmp_path / "old1" / MANIFEST_NAME).write_text(json.dumps(bad))
    with pytest.raises(StoreError, match="malformed manifest .*store_id is a int, not a string"):
        load_manifest(tmp_path / "old1")


def test_a_store_replaced_by_a_copy_of_itself_is_seen_as_replaced(converted, tmp_path):
    """A copy keeps the manifest's size and mtime and, right after the old one is deleted,
    often gets its inode number too; the stamp still tells the two apart."""
    _, out = converted("qwen3_moe", "4bit")
    own = Path(shutil.copytree(out, tmp_path / "own"))
    stamp = manifest_stamp(own)
    assert vanished_store_problem(own, stamp) is None
    shutil.rmtree(own)
    shutil.copytree(out, own)
    assert vanished_store_problem(own, stamp) == (
        f"the store in the model folder {own} was replaced or its manifest changed since the daemon loaded it: "
        "restart the daemon (`moestreamctl restart`) to serve what is there now"
    )


def test_a_config_out_of_step_with_the_layer_files_says_what_differs(converted, tmp_path):
    from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
    from moestream.shared.settings import Settings

    _, out = converted("qwen3_moe", "4bit")
    store = Path(shutil.copytree(out, tmp_path / "edited"))
    data = json.loads((store / MANIFEST_NAME).read_text())
    experts = data["config"]["num_experts"]
    data["config"]["num_experts"] = experts // 2
    (store / MANIFEST_NAME).write_text(json.dumps(data))
    layer = load_manifest(store).layers[0]
    message = (
        f"{store}: layer {layer.module_path} holds {experts} experts in {layer.file}, but the manifest's config "
        f"gives num_experts = {experts // 2}: the config does not match the store's layer files "
        "(was it edited? convert the model again)"
    )
    with pytest.raises(StoreError) as streaming:
        load_streaming_model(store, Settings())
    with pytest.raises(StoreError) as stock:
        load_stock_model(store)
    assert str(streaming.value) == str(stock.value) == message


def test_an_output_folder_that_cannot_be_made_or_written_is_one_clean_error(tiny_model, tmp_path, monkeypatch):
    src = tiny_model("qwen3_moe", "4bit")
    (tmp_path / "afile").write_text("x")
    r = CliRunner().invoke(cli, ["convert", str(src), "--out", str(tmp_path / "afile" / "store")])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    assert (
        f"cannot make the store {tmp_path}/afile/store: {tmp_path}/afile is not a folder; choose another --out"
    ) in r.stderr

    import moestream.daemon.store.convert as convert

    def full(items, folder: Path, *args):
        raise OSError(28, "No space left on device", str(folder / "resident-00001.safetensors"))

    monkeypatch.setattr(convert, "_write_resident", full)
    out = tmp_path / "store"
    r = CliRunner().invoke(cli, ["convert", str(src), "--out", str(out)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    full_disk = f"cannot write the store {out}: {out}/resident-00001.safetensors: No space left on device"
    assert f"Error: {full_disk}\n" in r.stderr
    assert not out.exists() and not leftovers(out)


# ---- the command line ------------------------------------------------------------------


def test_cli_convert_exit_codes_and_messages(tiny_model, tmp_path):
    runner = CliRunner()
    src = str(tiny_model("mixtral", "4bit"))
    out = str(tmp_path / "store")

    ok = runner.invoke(cli, ["convert", src, "--out", out])
    assert ok.exit_code == 0, ok.output
    assert "2 MoE layers, 16 experts" in ok.stdout
    assert "writing store" in ok.stderr
    load_manifest(out)

    again = runner.invoke(cli, ["convert", src, "--out", out])
    assert again.exit_code == 1
    assert "already holds an expert store; pass --force" in again.stderr

    forced = runner.invoke(cli, ["convert", src, "--out", out, "--force"])
    assert forced.exit_code == 0, forced.output

    dense = runner.invoke(cli, ["convert", str(tiny_model("qwen3", "4bit")), "--out", str(tmp_path / "d")])
    assert dense.exit_code == 1 and "no MoE layers" in dense.stderr

    missing = runner.invoke(cli, ["convert", str(tmp_path / "nowhere"), "--out", str(tmp_path / "n")])
    assert missing.exit_code == 1 and "does not exist" in missing.stderr


def test_cli_in_a_real_process_and_without_mlx_at_import(tiny_model, tmp_path):
    src = copy_model(tiny_model("qwen3_moe", "4bit", shards=2), tmp_path / "model")
    os.truncate(src / "model-00002-of-00002.safetensors", 1000)
    bin_dir = Path(sys.executable).parent
    r = subprocess.run(
        [str(bin_dir / "moestreamctl"), "convert", str(src), "--out", str(tmp_path / "store")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "model-00002-of-00002.safetensors is truncated" in r.stderr
    assert "Traceback" not in r.stderr

    probe = "import sys, moestream.client.cli; print(sorted(m for m in sys.modules if m.startswith('mlx')))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"
