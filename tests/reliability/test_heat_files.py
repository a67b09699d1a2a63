"""Heat files an attacker on the same machine (or a mistake) put in place: ids past the
model's experts, a FIFO, a symlink to /dev/zero, a huge file, a symlink planted at the
lock file, a store folder of another user. Each time the daemon starts, serves exactly
what `generate --local` gives, sets the bad file aside, and touches nothing else."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from moestream.client.client import Client
from moestream.shared.heat_file import MAX_HEAT_BYTES, NotAHeatFile, peek_usage, read_usage, write_usage

from .conftest import CASES

NOBODY = 65534


def _served_exactly(d, reference):
    """The daemon's status after it served CASES[0] as `generate --local` does, and the
    request's routed expert count (what its heat sends, once every push is out)."""
    prompt, max_tokens = CASES[0]
    with Client(d.paths, timeout=30) as c:
        done = c.complete(prompt, max_tokens=max_tokens)
        status = c.status()
    ref = reference[(prompt, max_tokens)]
    assert (done.text, tuple(done.tokens)) == (ref.text, ref.tokens)
    assert done.stats.routed_experts > 0
    return status, done.stats.routed_experts


def _set_aside(store: Path) -> list[Path]:
    return sorted(store.glob("pool_usage.json.corrupt-*"))


def test_expert_ids_past_the_layer_are_set_aside(store_copy, rel_reference, start_daemon):
    (store_copy / "pool_usage.json").write_text(json.dumps({"0": {"3": 9, "99": 5}, "1": {"2": 4}}))
    d = start_daemon(store_copy)
    status, _ = _served_exactly(d, rel_reference)
    assert len(_set_aside(store_copy)) == 1
    assert "past the layer's 16 experts" in (status.autopin["problem"] or "")


def test_a_fifo_heat_file_and_a_planted_lock_symlink(store_copy, rel_reference, start_daemon, workdir):
    os.mkfifo(store_copy / "pool_usage.json")
    victim = workdir / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, store_copy / "pool_usage.json.lock")
    tic = time.monotonic()
    d = start_daemon(store_copy)
    assert time.monotonic() - tic < 30
    status, _ = _served_exactly(d, rel_reference)
    assert victim.read_text() == "precious\n"
    assert len(_set_aside(store_copy)) == 1
    assert "not a regular file" in (status.autopin["problem"] or "")
    # The keeper refuses the lock, says why, and serving goes on.
    deadline = time.monotonic() + 10
    while "lock file" not in d.tail(20000) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "symbolic link" in d.tail(20000) or "Too many levels" in d.tail(20000), d.tail()


def test_a_heat_file_linked_to_dev_zero_is_not_read(store_copy, rel_reference, start_daemon):
    os.symlink("/dev/zero", store_copy / "pool_usage.json")
    d = start_daemon(store_copy)
    status, _ = _served_exactly(d, rel_reference)
    assert "symbolic link" in (status.autopin["problem"] or "")
    assert Path("/dev/zero").exists() and _set_aside(store_copy)


def test_huge_or_junk_heat_files_are_set_aside_unread(tmp_path):
    big = tmp_path / "pool_usage.json"
    with open(big, "wb") as f:
        f.truncate(MAX_HEAT_BYTES + 1)  # sparse: nothing is written
    tic = time.perf_counter()
    load = read_usage(big)
    assert "over the limit" in load.problem and load.set_aside is not None and not big.exists()
    # A valid file whose layers the model does not have.
    big.write_text(json.dumps({str(layer): {"0": 1} for layer in range(5000)}))
    load = read_usage(big, {0: 16, 1: 16})
    assert "not a MoE layer" in load.problem and load.counts == {}
    assert time.perf_counter() - tic < 2


def test_heat_is_never_written_into_another_users_store_folder(store_copy, rel_reference, start_daemon, workdir):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the store folder to another uid")
    os.chown(store_copy, NOBODY, NOBODY)
    state = workdir / "state"
    d = start_daemon(store_copy, env={"XDG_STATE_HOME": str(state), "MOESTREAM_HEAT_FLUSH_SECONDS": "0.1"})
    _served_exactly(d, rel_reference)
    d.stop()
    assert not list(store_copy.glob("pool_usage.json*")), list(store_copy.iterdir())
    assert list(state.glob("moestream/heat/*/pool_usage.json"))
    assert "not beside the store" in d.paths.log.read_text()


def _heat(d, until=lambda heat: True, timeout: float = 15.0) -> dict:
    """The daemon's heat status once `until(heat)` holds (the snapshot lags a little)."""
    deadline = time.monotonic() + timeout
    with Client(d.paths, timeout=30) as c:
        while True:
            heat = c.status().heat
            if until(heat) or time.monotonic() > deadline:
                return heat
            time.sleep(0.05)


def _file_total(store: Path) -> int:
    return sum(sum(experts.values()) for experts in read_usage(store / "pool_usage.json").counts.values())


@pytest.mark.slow  # three daemon starts: about 20 s; test_heat.py checks the keeper's side in 2 s
def test_a_second_daemon_on_the_store_keeps_its_heat_until_the_lock_frees(store_copy, rel_reference, start_daemon):
    """Two daemons on one store: the second's keeper cannot have the heat file's lock.
    `status` says so (never "running"), and its counts are kept, in a file of its own
    when it stops first, and all of them merged into pool_usage.json once the lock frees."""
    env = {"MOESTREAM_HEAT_FLUSH_SECONDS": "0.2"}
    first = start_daemon(store_copy, "rt1", env=env)
    second = start_daemon(store_copy, "rt2", env=env)
    # A request's counts go out in several pushes (one every flush, and one after it ends),
    # so each daemon's figure is read once all its requests' routings are sent: a loaded
    # machine once read it between two pushes (file 528 against 404 counted).
    _, routed = _served_exactly(second, rel_reference)
    waiting = _heat(second, lambda h: h.get("sent_counts", 0) >= routed)
    assert waiting["state"] == "waiting" and "lock" in waiting["note"], waiting
    sent = [waiting["sent_counts"]]
    assert second.stop(30.0) == 0
    assert list(store_copy.glob("pool_usage.json.pending-*")), sorted(p.name for p in store_copy.iterdir())

    second = start_daemon(store_copy, "rt2", env=env)
    _, routed = _served_exactly(second, rel_reference)
    sent.append(_heat(second, lambda h: h.get("sent_counts", 0) >= routed)["sent_counts"])
    _, routed = _served_exactly(first, rel_reference)
    first_heat = _heat(first, lambda h: h.get("unconfirmed_counts") == 0 and h.get("sent_counts", 0) >= routed)
    assert first_heat["state"] == "running" and first_heat["dropped_counts"] == 0, first_heat
    sent.append(first_heat["sent_counts"])
    assert first.stop(30.0) == 0

    # The lock is free: the second daemon's keeper takes it and merges everything.
    merged = _heat(second, lambda h: h["state"] == "running" and h.get("unconfirmed_counts") == 0)
    assert merged["state"] == "running" and merged["dropped_counts"] == 0, merged
    assert _file_total(store_copy) == sum(sent), (sent, merged)
    assert not list(store_copy.glob("pool_usage.json.pending-*"))
    with Client(first.paths if first.alive() else second.paths) as c:
        assert c.status().heat["state"] == "running"


def test_the_read_only_readers_refuse_what_the_daemon_sets_aside(tmp_path):
    """`plan`, `heatmap` and the dashboard read heat through `peek_usage`: a link, a FIFO
    (no blocking), a huge file are refused with a reason; nothing is moved aside."""
    good = tmp_path / "good.json"
    write_usage(good, {0: {1: 2}})
    assert peek_usage(good) == {0: {1: 2}}
    link = tmp_path / "link.json"
    link.symlink_to(good)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(MAX_HEAT_BYTES + 1)
    for path, why in ((link, "symbolic link"), (fifo, "not a regular file"), (huge, "over the limit")):
        with pytest.raises(NotAHeatFile, match=why):
            peek_usage(path)
    with pytest.raises(FileNotFoundError):
        peek_usage(tmp_path / "missing.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.json", "good.json", "huge.json", "link.json"]
