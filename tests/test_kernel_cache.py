"""MLX's CUDA kernel cache in a folder of the user's own (shared/kernel_cache.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_cli import clean_env, ctl

from moestream.shared.kernel_cache import ENV, KernelCacheError, _mlx_version, use_kernel_cache


def _no_warning(why: str) -> None:
    raise AssertionError(f"unexpected warning: {why}")


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_the_default_is_a_private_folder_per_mlx_version_under_the_users_cache(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    used = use_kernel_cache(None, env, _no_warning)
    assert used == tmp_path / "cache" / "moestream" / "kernels" / f"mlx-{_mlx_version()}"
    assert env[ENV] == str(used) and used.is_dir()
    assert _mode(used) == 0o700 and _mode(used.parent) == 0o700
    # Once made, the same folder is taken again.
    again = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert use_kernel_cache(None, again, _no_warning) == used


def test_a_folder_the_environment_names_stands(tmp_path):
    env = {ENV: "/somewhere/the/user/chose", "XDG_CACHE_HOME": str(tmp_path)}
    assert use_kernel_cache(tmp_path / "mine", env, _no_warning) is None
    assert env[ENV] == "/somewhere/the/user/chose" and not (tmp_path / "mine").exists()


def test_a_symlinked_or_open_folder_is_refused_with_what_to_do(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(KernelCacheError, match="symlink"):
        use_kernel_cache(link, {}, _no_warning)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    env: dict[str, str] = {}
    with pytest.raises(KernelCacheError, match="chmod 700"):
        use_kernel_cache(shared, env, _no_warning)
    assert ENV not in env


def test_a_default_folder_that_cannot_be_made_is_a_warning_and_a_given_one_an_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be made under a file, not even by root
    warnings: list[str] = []
    env = {"XDG_CACHE_HOME": str(blocker)}
    assert use_kernel_cache(None, env, warnings.append) is None
    assert ENV not in env and len(warnings) == 1 and "--kernel-cache-dir" in warnings[0]
    with pytest.raises(KernelCacheError, match="cannot create the kernel cache folder"):
        use_kernel_cache(blocker / "kernels", {}, warnings.append)
    assert len(warnings) == 1


def test_the_daemon_makes_its_kernel_cache_and_refuses_a_link(pool_store):
    # Without the variable, which a test run in this process may have set (as the daemon's
    # own process and `generate --local` do).
    env = {k: v for k, v in clean_env().items() if k != ENV}
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="mskc"))
    try:
        folder, rt = root / "kernels", root / "rt"
        out = ctl(
            "start", "--model", str(pool_store), "--runtime-dir", str(rt), "--kernel-cache-dir", str(folder), env=env
        )
        assert out.returncode == 0, out.stdout + out.stderr
        try:
            assert _mode(folder / f"mlx-{_mlx_version()}") == 0o700
        finally:
            assert ctl("stop", "--runtime-dir", str(rt), env=env).returncode == 0
        (root / "target").mkdir()
        (root / "link").symlink_to(root / "target")
        link = root / "link"
        out = ctl(
            "start", "--model", str(pool_store), "--runtime-dir", str(rt), "--kernel-cache-dir", str(link), env=env
        )
        assert out.returncode != 0
        assert "kernel cache folder" in out.stdout + out.stderr and str(link) in out.stdout + out.stderr
        # Where the default folder cannot be made, the daemon starts all the same and says why.
        (root / "a-file").write_text("")
        unusable = {**env, "XDG_CACHE_HOME": str(root / "a-file")}
        out = ctl("start", "--model", str(pool_store), "--runtime-dir", str(rt), env=unusable)
        assert out.returncode == 0, out.stdout + out.stderr
        try:
            assert "warning: cannot create the kernel cache folder" in (rt / "daemon.log").read_text()
        finally:
            assert ctl("stop", "--runtime-dir", str(rt), env=env).returncode == 0
    finally:
        shutil.rmtree(root)


def test_the_daemons_main_sets_it_before_anything_imports_mlx():
    """The variable is set in `main`, so the module that runs it must not import MLX first."""
    check = "import sys, moestream.daemon.main; print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, env=clean_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
