"""`moestreamctl pull` and `plan REPO_ID`, through huggingface_hub's real downloader against
a local hub (tests/hub_server.py) serving a tiny MoE model in the hub's layout.

The store a pull writes is compared with `convert` of the same folder byte for byte (all
but the manifest's id and source); the disk is measured at every step of the pull; the
faults are the hub's: a connection cut mid-file, a file whose bytes do not match its hash,
a pull stopped or killed half way, a repository that is no MoE model."""

from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import huggingface_hub.constants
import pytest
from daemon_cli import clean_env, ctl
from hub_server import FakeHub, Sparse

from moestream.daemon.planning.plan import Bandwidths, ComputeProbe, probe_key, save_bandwidths, save_compute
from moestream.daemon.store.convert import convert_model
from moestream.daemon.store.hub import default_store_dir, is_repo_id
from moestream.daemon.store.pull import PULL_DIR, PullEvent, folder_bytes, pull_model
from moestream.shared.store_format import MANIFEST_NAME, StoreError

REPO = "tiny/moe"
SHARDS = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
Q30 = Path(__file__).parent / "data" / "hub" / "qwen3-30b-a3b-4bit"
Q30_REPO = "mlx-community/Qwen3-30B-A3B-4bit"


@pytest.fixture(scope="module")
def tiny_repo(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny qwen3_moe (4-bit, three weight files, each with tensors of both MoE layers
    and resident ones) and `convert` of it."""
    model = tiny_model("qwen3_moe", "4bit", shards=3)
    converted = tmp_path_factory.mktemp("converted") / "store"
    convert_model(model, converted)
    return model, converted


@pytest.fixture
def hub(tiny_repo):
    with FakeHub() as hub:
        hub.add(REPO, tiny_repo[0])
        yield hub


@pytest.fixture
def small_chunks(monkeypatch):
    """huggingface_hub writes a download in chunks of 10 MiB; the tiny files are smaller,
    so a cut or a stop would leave nothing of them on disk to continue from."""
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1024)


def assert_same_store(pulled: Path, converted: Path) -> None:
    """Every file of `converted` in `pulled` with the same bytes, no other file, and the same
    manifest but its id and its source."""
    files = sorted(p.relative_to(converted) for p in converted.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(pulled) for p in pulled.rglob("*") if p.is_file())
    for rel in files:
        if rel.name != MANIFEST_NAME:
            assert (pulled / rel).read_bytes() == (converted / rel).read_bytes(), rel
    a, b = (json.loads((d / MANIFEST_NAME).read_text()) for d in (pulled, converted))
    assert a.pop("store_id") != b.pop("store_id")
    assert a.pop("source")["repo_id"] == REPO and "model_dir" in b.pop("source")
    assert a == b


def test_a_pull_is_convert_of_the_folder_and_holds_the_store_and_one_weight_file(hub, tiny_repo, tmp_path):
    model, converted = tiny_repo
    out = tmp_path / "store"
    disk: list[int] = []
    events: list[PullEvent] = []

    def watch(e: PullEvent) -> None:
        events.append(e)
        disk.append(folder_bytes(out))

    manifest = pull_model(REPO, out, endpoint=hub.url, on_event=watch)
    assert_same_store(out, converted)
    assert manifest.source["revision"] == hub.repos[REPO].commit
    assert not (out / PULL_DIR).exists() and not (out.parent / f"{out.name}.source").exists()
    # Each weight file was placed and removed before the next one was fetched.
    steps = [(e.kind, e.file) for e in events if e.kind in ("downloaded", "placed", "removed") and e.file in SHARDS]
    assert steps == [(k, f) for f in SHARDS for k in ("downloaded", "placed", "removed")]
    # Every file fetched once, its header read once (a range request) beforehand.
    for name in SHARDS + ["config.json", "tokenizer.json"]:
        assert len(hub.gets(name)) == 1, name
    largest = max((model / f).stat().st_size for f in SHARDS)
    store = folder_bytes(out)
    print(f"peak disk {max(disk)} B; store {store} B, largest weight file {largest} B")
    assert max(disk) <= (store + largest) * 1.05
    assert events[-1].kind == "done" and events[-1].done == events[-1].total


def test_a_cut_connection_continues_where_it_was_cut(hub, tiny_repo, tmp_path, small_chunks):
    hub.cut[SHARDS[1]] = 20_000
    pull_model(REPO, tmp_path / "store", endpoint=hub.url)
    first, again = hub.gets(SHARDS[1])
    assert first.range is None and again.range is not None
    resumed_at = int(again.range.removeprefix("bytes=").split("-")[0])
    assert 0 < resumed_at <= 20_000
    assert_same_store(tmp_path / "store", tiny_repo[1])


def test_a_file_that_does_not_match_its_hash_is_fetched_again(hub, tiny_repo, tmp_path, capsys):
    hub.corrupt[SHARDS[0]] = 1
    pull_model(REPO, tmp_path / "store", endpoint=hub.url)
    assert len(hub.gets(SHARDS[0])) == 2
    assert "not the hub's" in capsys.readouterr().err
    assert_same_store(tmp_path / "store", tiny_repo[1])


def test_a_file_that_never_matches_its_hash_is_refused_and_not_kept(hub, tmp_path):
    hub.corrupt[SHARDS[2]] = 2
    out = tmp_path / "store"
    with pytest.raises(StoreError, match=r"arrived twice with sha256 .*, not the hub's"):
        pull_model(REPO, out, endpoint=hub.url)
    assert not (out / MANIFEST_NAME).exists()
    assert not list((out / PULL_DIR / "source").glob(f"{SHARDS[2]}*"))  # nothing of it kept
    # The first two files are in the store; a later pull fetches only the third.
    hub.requests.clear()
    pull_model(REPO, out, endpoint=hub.url)
    assert [len(hub.gets(f)) for f in SHARDS] == [0, 0, 1]


class Stop(Exception):
    pass


def test_a_stopped_pull_continues_without_fetching_what_it_has(hub, tiny_repo, tmp_path, small_chunks):
    """Stopped half way through the second weight file (as Ctrl-C stops it): the next
    pull fetches neither the first again nor the part of the second it has."""
    out = tmp_path / "store"
    got = []

    def stop_in_the_second(e: PullEvent) -> None:
        got.append(e)
        if e.kind == "bytes" and (out / PULL_DIR / "source" / f"{SHARDS[1]}.incomplete").exists():
            if (out / PULL_DIR / "source" / f"{SHARDS[1]}.incomplete").stat().st_size >= 8192:
                raise Stop

    with pytest.raises(Stop):
        pull_model(REPO, out, endpoint=hub.url, on_event=stop_in_the_second)
    state = json.loads((out / PULL_DIR / "state.json").read_text())
    assert state["placed"] == [SHARDS[0]] and not (out / PULL_DIR / "source" / SHARDS[0]).exists()
    hub.requests.clear()
    pull_model(REPO, out, endpoint=hub.url)
    assert hub.gets(SHARDS[0]) == [] and len(hub.gets(SHARDS[2])) == 1
    (again,) = hub.gets(SHARDS[1])
    assert int(again.range.removeprefix("bytes=").split("-")[0]) >= 8192
    assert not [r for r in hub.requests if r.file == "config.json"]  # the small files are there too
    assert_same_store(out, tiny_repo[1])


def hub_env(hub: FakeHub, home: Path) -> dict[str, str]:
    return clean_env(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(home / "hf"),
        HOME=str(home),
        XDG_DATA_HOME=str(home / "data"),
        XDG_STATE_HOME=str(home / "state"),
    )


def test_a_killed_pull_restarts_without_fetching_finished_files(hub, tiny_repo, tmp_path):
    """`moestreamctl pull` killed (SIGKILL) while the second weight file downloads, then
    run again: it fetches the second and third, never the first."""
    env = hub_env(hub, tmp_path)
    hub.stall[SHARDS[1]] = 10_000
    proc = subprocess.Popen(
        [sys.executable, "-m", "moestream.client.cli", "pull", REPO],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert hub.stalled.wait(120), "the pull never reached the second weight file"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        hub.release.set()
    store = default_store_dir(REPO, env=env)
    assert not (store / MANIFEST_NAME).exists()
    done = ctl("pull", REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [len(hub.gets(f)) for f in SHARDS] == [1, 2, 1]
    assert f"{REPO} at {hub.repos[REPO].commit[:12]}: {store}" in done.stderr
    assert_same_store(store, tiny_repo[1])
    # Pulled already: nothing is fetched again.
    before = len(hub.requests)
    again = ctl("pull", REPO, env=env, timeout=300)
    assert again.returncode == 0 and [r.file for r in hub.requests[before:]] == [], again.stderr


@pytest.mark.parametrize("arch", ["qwen3", "dbrx"])
def test_a_repository_that_is_no_moe_model_is_refused_from_its_config(arch, tiny_model, tmp_path):
    """A dense model, and one whose experts are a module each: refused by `pull` (the
    command's message, for one) and by `plan`, from config.json alone."""
    from moestream.daemon.planning.repo import repo_shape

    why = "no MoE layers" if arch == "qwen3" else "one module per expert"
    with FakeHub() as hub:
        hub.add(f"tiny/{arch}", tiny_model(arch, "bf16"))
        with pytest.raises(StoreError, match=f"tiny/{arch}: .*{why}.*; nothing was downloaded but its config"):
            pull_model(f"tiny/{arch}", tmp_path / "store", endpoint=hub.url)
        with pytest.raises(StoreError, match=why):
            with repo_shape(f"tiny/{arch}", endpoint=hub.url):
                pass
        if arch == "qwen3":
            out = ctl("pull", f"tiny/{arch}", env=hub_env(hub, tmp_path), timeout=300)
            assert out.returncode == 1 and why in out.stderr and "Traceback" not in out.stderr, out.stderr
    # Neither the weights nor their headers were asked for.
    assert not [r for r in hub.requests if r.file.endswith(".safetensors")]


def test_an_architecture_mlx_lm_does_not_know_is_refused_from_its_config(tiny_model, tmp_path):
    folder = tmp_path / "repo"
    shutil.copytree(tiny_model("qwen3_moe", "4bit"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no_such_moe"}))
    with FakeHub() as hub:
        hub.add("tiny/unknown", folder)
        with pytest.raises(StoreError, match="mlx-lm cannot load this model"):
            pull_model("tiny/unknown", tmp_path / "store", endpoint=hub.url)
    assert not [r for r in hub.requests if r.file.endswith(".safetensors")]


def test_a_missing_repository_or_revision_says_so(hub, tmp_path):
    with pytest.raises(StoreError, match="tiny/none: no such repository"):
        pull_model("tiny/none", tmp_path / "a", endpoint=hub.url)
    with pytest.raises(StoreError, match="no such revision"):
        pull_model(REPO, tmp_path / "b", revision="v9", endpoint=hub.url)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="is not empty and is no pull in progress"):
        pull_model(REPO, tmp_path / "c", endpoint=hub.url)
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


def test_a_second_pull_into_the_same_folder_is_refused_while_the_first_runs(hub, tmp_path):
    import fcntl

    work = tmp_path / "store" / PULL_DIR
    work.mkdir(parents=True)
    with open(work / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running pull holds it
        with pytest.raises(StoreError, match="another pull into .* is running"):
            pull_model(REPO, tmp_path / "store", endpoint=hub.url)
    pull_model(REPO, tmp_path / "store", endpoint=hub.url)  # the lock dropped: it goes ahead
    assert (tmp_path / "store" / MANIFEST_NAME).is_file()


def test_keep_source_keeps_the_downloaded_folder_beside_the_store(hub, tiny_repo, tmp_path):
    out = tmp_path / "store"
    pull_model(REPO, out, endpoint=hub.url, keep_source=True)
    assert_same_store(out, tiny_repo[1])
    kept = tmp_path / "store.source"
    for f in SHARDS + ["config.json", "tokenizer.json"]:
        assert (kept / f).read_bytes() == (tiny_repo[0] / f).read_bytes()


def test_repo_ids_and_the_default_store_folder(tmp_path):
    assert is_repo_id("mlx-community/Qwen3-30B-A3B-4bit") and not is_repo_id("demo") and not is_repo_id(None)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not is_repo_id(tmp_path / "owner" / "name") and not is_repo_id("a/../b")
    env = {"HOME": "/home/u"}
    assert default_store_dir("o/n", env=env) == Path("/home/u/.local/share/moestream/stores/o--n")
    assert default_store_dir("o/n", "v2", env={**env, "XDG_DATA_HOME": "/d"}) == Path("/d/moestream/stores/o--n@v2")


def plan_json(*args: str, env: dict[str, str]) -> dict:
    out = ctl("plan", *args, "--json", env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_plan_of_a_repository_is_the_plan_of_its_store_after_the_pull(hub, tmp_path):
    """`plan REPO_ID` before the download and `plan --model STORE` after the pull: the same
    sizes to the byte, forecasts within 5% (here the same probes, kept between the two)."""
    env = hub_env(hub, tmp_path)
    save_bandwidths(tmp_path / "state" / "moestream", Bandwidths(2e9, 1e10, "host memcpy", "given"))
    options = ("--no-probe", "--capacity", "0.5", "--memory", "48G", "--disk-bandwidth", "1G")
    before = plan_json(REPO, *options, env=env)
    assert not [r for r in hub.requests if r.file.endswith(".safetensors") and r.range is None]
    assert ctl("pull", REPO, env=env, timeout=300).returncode == 0
    after = plan_json("--model", str(default_store_dir(REPO, env=env)), *options, env=env)
    store = default_store_dir(REPO, env=env)
    on_disk = sum(f.stat().st_size for f in store.rglob("*") if f.is_file() and f.name != MANIFEST_NAME)
    for key in ("store_bytes", "expert_file_bytes", "resident_bytes", "expert_bytes", "pool_bytes"):
        assert before[key] == after[key], key
    assert before["store_bytes"] == on_disk
    assert (before["slots_per_layer"], before["kv_bytes_per_1k_tokens"]) == (
        after["slots_per_layer"],
        after["kv_bytes_per_1k_tokens"],
    )
    for forecast in ("decode", "ttft"):
        for key in ("tokens_per_s", "bound_tokens_per_s"):
            assert before[forecast][key] == pytest.approx(after[forecast][key], rel=0.05), (forecast, key)
    assert before["bandwidths"]["read_bytes_per_s"] == 2**30 and before["pool_probe"] is not None


def q30_hub(hub: FakeHub) -> None:
    """The q30 repository (tests/data/hub): its config and index, and each weight file as
    its header over zeros."""
    files: dict[str, bytes | Sparse] = {
        n: (Q30 / n).read_bytes() for n in ("config.json", "model.safetensors.index.json")
    }
    for name, h in json.loads((Q30 / "headers.json").read_text()).items():
        head = h["header"].encode()
        files[name] = Sparse(struct.pack("<Q", len(head)) + head, h["size"])
    hub.add_files(Q30_REPO, files)


def test_plan_of_the_q30_repository_for_a_48gb_mac_with_a_6gbs_disk(tmp_path, monkeypatch):
    """Qwen3-30B-A3B at 4 bits on a 48 GB Mac with a 6 GiB/s disk: every expert fits beside
    the context, and the plan says so from the config and headers alone (the compute
    probe's figures given: probing this shape takes minutes on a CPU)."""
    from moestream.daemon.planning.plan import fit_to_memory, mac_memory, make_plan, plan_shape
    from moestream.daemon.planning.repo import repo_shape
    from moestream.shared.settings import Settings

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    state = tmp_path / "state" / "moestream"
    with FakeHub() as hub:
        q30_hub(hub)
        with repo_shape(Q30_REPO, endpoint=hub.url) as shape:
            assert shape.dtype == "bfloat16" and len(shape.manifest.layers) == 48
            # 0.5 ms a layer and 2 ms of embeddings and head per token, as a GPU might take.
            probe = ComputeProbe(
                (4, 16), (0.004, 0.010), (4e-4, 1e-3), (0.0045, 0.012), (4.4e-4, 1.1e-3), 0.0, "gpu", "bfloat16"
            )
            save_compute(state, probe_key(shape.manifest.config, shape.dtype), probe)
            save_bandwidths(state, Bandwidths(3e9, 1e11, "host memcpy", "given"))
            got = plan_shape(shape, Settings(), probe=False, memory=mac_memory(48 << 30), disk_bandwidth=6 << 30)
        out = ctl(
            "plan", Q30_REPO, "--memory", "48G", "--disk-bandwidth", "6G", "--no-probe", env=hub_env(hub, tmp_path)
        )
        assert out.returncode == 0, out.stderr
        assert not [r for r in hub.requests if r.file.endswith(".safetensors") and not r.range]
    print(out.stdout)
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"{Q30_REPO} at ") and "qwen3_moe, 48 MoE layers x 128 experts (top-8" in lines[0]
    assert "store      16.0 GiB on disk" in out.stdout and "a 48.0 GiB Mac's GPU share" in out.stdout
    assert "disk 6.0 GiB/s" in out.stdout and "decode     38.5 tok/s" in out.stdout and "TTFT " in out.stdout
    # Each expert: 3 projections of 768 x 2048 at 4 bits, with bf16 scales and biases per 64.
    assert got.expert_bytes == 3 * (768 * 2048 // 2 + 2 * 768 * 2048 // 64 * 2) and got.slots_per_layer == 128
    assert got.context.tokens == 40960 and got.decode.bound_by == "compute" and got.fitted_to is None
    assert got.decode.tokens_per_s == pytest.approx(1 / (0.004 + 44 * 0.0005))
    assert 16 * 2**30 < got.store_bytes < 17 * 2**30
    # A 16 GB Mac holds a share of the experts: the pool is sized to fit it, and the plan says how.
    fitted, why = fit_to_memory(shape, Settings(), mac_memory(16 << 30))
    small = make_plan(shape, fitted, Bandwidths(6 << 30, 1e11, "given", "given"), probe, {}, "uniform")
    assert 8 <= small.slots_per_layer < 128 and "16.0 GiB Mac" in why
    assert small.decode.terms_s["disk"] > 0 and small.decode.tokens_per_s < got.decode.tokens_per_s


def hf_layout(model: Path, folder: Path) -> Path:
    """`model` (an unquantized qwen3_moe in mlx layout) in the Hugging Face layout: one
    module per expert (`mlp.experts.E.gate_proj.weight`), which mlx-lm's sanitize stacks."""
    import mlx.core as mx

    shutil.copytree(model, folder)
    for path in sorted(folder.glob("model*.safetensors")):
        weights = mx.load(str(path))
        out = {}
        for name, a in weights.items():
            if ".mlp.switch_mlp." in name:
                for e in range(a.shape[0]):
                    out[name.replace(".switch_mlp.", f".experts.{e}.")] = a[e]
            else:
                out[name] = a
        mx.save_safetensors(str(path), out, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: p.name for p in sorted(folder.glob("model*.safetensors")) for k in mx.load(str(p))}
    index.write_text(json.dumps(data))
    return folder


def test_a_model_that_sanitize_restacks_is_converted_whole_once_downloaded(tiny_model, tmp_path, capsys):
    """Per-expert tensors in the Hugging Face layout are stacked by mlx-lm's sanitize, so
    no downloaded tensor is a stacked expert tensor to place: the pull downloads the whole
    model and converts it at the end, and says so; the store is still `convert`'s."""
    folder = hf_layout(tiny_model("qwen3_moe", "bf16", shards=3), tmp_path / "hf")
    converted = tmp_path / "converted"
    convert_model(folder, converted)
    with FakeHub() as hub:
        hub.add(REPO, folder)
        pull_model(REPO, tmp_path / "store", endpoint=hub.url)
    assert "converted once downloaded whole" in capsys.readouterr().err
    assert "switch_mlp" in json.loads((converted / MANIFEST_NAME).read_text())["moe_layers"][0]["module_path"]
    assert_same_store(tmp_path / "store", converted)
    assert not (tmp_path / "store" / PULL_DIR).exists()


def test_start_with_a_repository_pulls_it_then_serves_it(hub, tmp_path):
    """`start --model OWNER/NAME`: the store is pulled where `pull` puts it, then served;
    started again, it is not fetched again."""
    env = hub_env(hub, tmp_path)
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mspull-"))
    try:
        out = ctl("start", "--model", REPO, "--runtime-dir", str(rt), env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        store = default_store_dir(REPO, env=env)
        assert f"{REPO} at " in out.stderr and f"model {store}" in out.stderr
        said = ctl("generate", "--runtime-dir", str(rt), "--max-tokens", "4", "--temp", "0", "hello", env=env)
        assert said.returncode == 0, said.stderr
        assert ctl("stop", "--runtime-dir", str(rt), env=env).returncode == 0
        before = len(hub.requests)
        again = ctl("start", "--model", REPO, "--runtime-dir", str(rt), env=env, timeout=300)
        assert again.returncode == 0 and len(hub.requests) == before, again.stderr
    finally:
        ctl("stop", "--runtime-dir", str(rt), env=env)
        shutil.rmtree(rt, ignore_errors=True)
    missing = ctl("start", "--model", "tiny/none", "--runtime-dir", str(rt), env=env)
    assert missing.returncode == 1 and "no such folder here, and pulling it failed" in missing.stderr
