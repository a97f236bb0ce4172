"""Shared fixtures, and the session switches of the machine matrix (``scripts/test_matrix.sh``).

``SMART_BATCHING_TEST_MKLDNN=0`` turns torch's oneDNN kernels off for the test session
(``torch.backends.mkldnn.enabled = False``: bf16 products take ATen's reference GEMM, as on a CPU without
AVX-512); subprocesses the tests start keep their own default. ``SMART_BATCHING_CPU_HALF`` (read by
:func:`smart_batching.compat.cpu_half_matmul`) forces the CPU half-precision path the library decides on;
the ``cpu_half_path`` fixture sets it per test.
"""

from __future__ import annotations

import os

import pytest

from smart_batching.compat import CPU_HALF_ENV, CPU_HALF_PATHS

MKLDNN_ENV = "SMART_BATCHING_TEST_MKLDNN"
# What the machine matrix varies; the test report's header names those set.
MATRIX_ENV = (CPU_HALF_ENV, MKLDNN_ENV, "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS")


def pytest_configure(config):
    value = os.environ.get(MKLDNN_ENV, "")
    if value not in ("", "0", "1"):
        raise pytest.UsageError(f"{MKLDNN_ENV}={value!r}: set it to 0 (oneDNN off) or 1, or unset it")
    if value == "0":
        import torch

        torch.backends.mkldnn.enabled = False


def pytest_report_header(config):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = [f"{name}={os.environ[name]}" for name in MATRIX_ENV if os.environ.get(name)]
    return f"machine matrix: usable cores {cores}; {', '.join(settings) or 'no switch set'}"


@pytest.fixture(params=CPU_HALF_PATHS)
def cpu_half_path(request, monkeypatch):
    """The CPU half-precision path (``"native"``, ``"emulated"``, ``"reference"``) forced for one test
    through ``SMART_BATCHING_CPU_HALF``, whatever this CPU can do: a test that takes it runs under each
    of the three (``@pytest.mark.parametrize("cpu_half_path", [...], indirect=True)`` picks some). It
    changes what the library decides (the ``precision.cpu_half`` warning, the dtype of its own matrix
    products), not torch's kernels; a test that needs the reference kernels too turns oneDNN off."""
    monkeypatch.setenv(CPU_HALF_ENV, request.param)
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module of tiny models: faster, and far faster on a busy CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def quiet_hf():
    """No datasets progress bars and only transformers' errors for a module of HF trainers (the trainer
    tests' output stays readable); the bars come back after."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    yield
    datasets.enable_progress_bars()


@pytest.fixture(autouse=True)
def _fresh_fallbacks():
    """Each test sees its own fallback warnings and counts (they warn once per process otherwise)."""
    from smart_batching.fallbacks import reset_fallbacks

    reset_fallbacks()
    yield


@pytest.fixture
def tiny_llama_and_args(tmp_path):
    """``make(max_steps) -> (model, args)``: a one-layer random Llama (vocabulary 64, seed 0) and CPU
    ``TrainingArguments`` for a few steps, for tests that only need a real Trainer to run."""

    def make(max_steps: int = 1):
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=600,
        )  # fmt: skip
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to=[], max_steps=max_steps,
            save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config), args

    return make
