"""The CUDA copier's copy kernel, as far as a machine without CUDA can check it: the
PTX the package carries was generated from the kernel source beside it (same span
count, a parameter laid out as the C++ side fills it), and the setting that turns it on
loads and is reported. Its bytes are checked on the GPU machine
(tests/bench/gpu_copy_check.py: `kernel` and `layer_prefetch.kernel`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from moestream._native import CudaCopier
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared.settings import Settings, SettingsError

NATIVE = Path(__file__).resolve().parent.parent / "native"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_copy_kernel", NATIVE / "gen_copy_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_carried_ptx_matches_its_generator_and_the_cpp_layout():
    header = (NATIVE / "copy_kernel_ptx.h").read_text()
    gen = _generator()
    spans = int(re.search(r"kCopyKernelMaxSpans = (\d+);", header).group(1))
    assert spans == gen.MAX_SPANS
    assert f"Span s[{spans}]" in gen.KERNEL
    # The entry point takes one parameter of exactly count (8 bytes) + spans x 24 bytes,
    # which is what device_copy.cpp's KernelSpans static_asserts for the C++ side.
    name = re.search(r'kCopyKernelName = "(\w+)";', header).group(1)
    param = re.search(rf"\.entry {name}\(\\n\"\s*\"\s*\.param \.align 8 \.b8 {name}_param_0\[(\d+)\]", header)
    assert param is not None, "the PTX has no entry point of that name with one byte-array parameter"
    assert int(param.group(1)) == 8 + 24 * spans
    # Forward-compatible: the driver compiles it for newer GPUs, and drivers from CUDA
    # 11.0 on read this PTX version.
    assert '".target sm_70\\n"' in header and '".version 7.0\\n"' in header


def test_copy_kernel_setting_parses_and_is_harmless_without_cuda(tmp_path: Path):
    assert Settings().copy_kernel is True  # faster on the H200 (RESULTS.md); no copier, no effect
    assert Settings().replace(copy_kernel="off").copy_kernel is False  # `bench decode --no-copy-kernel`
    assert Settings().replace(copy_kernel="on").copy_kernel is True
    with pytest.raises(SettingsError, match="copy_kernel"):
        Settings().replace(copy_kernel="sometimes")
    with pytest.raises(ImportError, match="CUDA is not available"):
        CudaCopier()


def test_a_model_loads_with_copy_kernel_where_there_is_no_copier(tmp_path: Path):
    from tiny_models import make_tiny_model

    from moestream.daemon.store.convert import convert_model

    src = make_tiny_model(tmp_path / "m", "qwen3_moe")
    convert_model(src, tmp_path / "s")
    sm = load_streaming_model(tmp_path / "s", Settings(capacity=0.5, copy_kernel=True, prefetch="off"))
    try:
        admission = sm.pool_stats().admission
        assert admission["mode"] == "direct" and "copy_kernel" not in admission
    finally:
        sm.close()
