"""Hypothesis profiles: "ci" (the default) is derandomized with a bounded number of examples and no deadline, so a
slow example never flakes CI and a failure reproduces; HYPOTHESIS_PROFILE=dev explores more, randomly.

Skips under CI (the environment variable CI set, as CI runners set it; .ci/run installs the dev extra and finds the
CUDA toolkit): a test that skips there would pass unseen, so every skip under CI is a failure — a test skipped
whole, a file skipped whole (an error), a parity peer missing (tests/peers.py: fixtures `torch` and
`transformers`, or `pytest.importorskip`) — except the tests CI_MAY_SKIP lists, each with the message its skip
must match and the reason CI cannot run it. Outside CI every skip stays a skip."""
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from peers import in_ci, peer

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_GPU = r"GPU|CUDA device|cupy"
# file::test (any parameters) -> (what its skip message must say, why CI may skip it). CI runs on a CPU machine:
# no GPU, no CuPy (the cuda extra). Anything else that skips under CI fails, and so does a listed test that skips
# for another reason.
CI_MAY_SKIP = {
    "test_cuda_sim.py::test_gpu_every_version_matches_oracle": (_GPU, "the kernels on a real GPU"),
    "test_cuda_backend_sim.py::test_gpu_whole_model_equals_numpy_backend": (_GPU, "the cuda backend on a GPU"),
    "test_cuda_backend_sim.py::test_gpu_outputs_pass_to_torch_and_numba_without_copies":
        (_GPU + "|PyTorch with CUDA", "CuPy and CUDA PyTorch sharing GPU memory"),
    "test_cuda_backend_sim.py::test_cuda_backend_without_gpu_or_simulator_is_a_clear_error":
        ("a GPU is present", "the error seen without a GPU, on a machine that has one"),
    "test_cuda_backend_sim.py::test_bench_cuda_skips_cleanly_without_gpu":
        ("a GPU is present", "the bench without a GPU, on a machine that has one"),
    "test_cuda_train_sim.py::test_gpu_pretrain_cuda_resumed_equals_numpy": (_GPU, "pretrain --backend cuda on a GPU"),
    "test_cuda_nvcc.py::test_cuda_c_matches_oracle": (_GPU, "the CUDA C kernels launched through CuPy on a GPU"),
    "test_cuda_blas.py::test_gpu_lt_bias_gemm_equals_gemm_and_add": (_GPU, "cublasLt's bias GEMM on a GPU"),
    "test_cuda_blas.py::test_lt_constants_match_the_header": ("cublasLt.h", "the CUDA toolkit's cuBLAS header (a "
                                                              "CPU machine without it: CUBLASLT_H=<path> runs it)"),
    # tests/test_cuda_mixed.py: the [gpu] parameter of each (its [emu] and [sim] ones run in CI)
    "test_cuda_mixed.py::test_device_rounding_is_the_spec_bit_for_bit": (_GPU, "the rounding kernels on a GPU"),
    "test_cuda_mixed.py::test_linear_and_attention_equal_the_spec": (_GPU, "cuBLAS's 16-bit GEMMs on a GPU"),
    "test_cuda_mixed.py::test_whole_model_mixed_equals_the_numpy_spec": (_GPU, "the mixed model on a GPU"),
    "test_cuda_mixed.py::test_attention_s3_flash_equals_the_spec": (_GPU, "the S3 flash kernels on a GPU"),
    "test_cuda_mixed.py::test_attention_s4_gives_s3s_bits": (_GPU, "S4 against S3, bit for bit, on a GPU"),
    "test_cuda_mixed.py::test_pretrain_cuda_fp16_mixed_resumed_equals_numpy_spec":
        (_GPU, "pretrain --mixed-precision fp16 on a GPU"),
    "test_cuda_graph.py::test_replay_equals_the_eager_step": (_GPU, "a CUDA graph's replay on a GPU"),
    "test_cuda_graph.py::test_replay_at_bert_base_shapes": (_GPU, "BERT-base's CUDA graph on a GPU"),
    "test_cuda_mixed.py::test_precision_study_of_the_cuda_mixed_step": (_GPU, "the GPU's mixed step against float64"),
    "test_cuda_launch.py::test_launch_versions_give_the_same_bits": (_GPU, "packed launches against CuPy's on a GPU"),
    "test_cuda_ptx.py::test_numba_cache_round_trip_on_gpu": (_GPU, "Numba's disk cache on a GPU, two processes"),
    # tests/test_cuda_optim.py: the [gpu] parameter of each (the [emu] one runs in CI)
    "test_cuda_optim.py::test_adamw_and_unscale_are_the_spec_bit_for_bit": (_GPU, "the optimizer kernels on a GPU"),
    "test_cuda_optim.py::test_clip_grad_norm_norm_and_scaling": (_GPU, "the optimizer kernels on a GPU"),
    "test_cuda_optim.py::test_bad_gradients_refused_by_name_before_anything_is_written":
        (_GPU, "the optimizer kernels on a GPU"),
    # the dev extra allows transformers >= 4.40; these compare with a Python tokenizer only some versions have
    "test_tokenization.py::test_bert_tokenizer_never_split_as_hf_python":
        ("no Python BERT tokenizer in this transformers", "a transformers without a Python BERT tokenizer"),
    "test_tokenization.py::test_documented_slow_fast_differences":
        ("documents transformers 5's Python tokenizer", "differences of transformers 5's Python tokenizer only"),
}


@pytest.fixture
def torch():
    return peer("torch")


@pytest.fixture
def transformers():
    return peer("transformers")


_PEER_SKIP = re.compile(r"could not import '(torch|transformers)'")


def _key(path, name=None):
    """CI_MAY_SKIP's key of a test (file::function, parameters aside) or of a file."""
    return Path(str(path)).name + ("" if name is None else f"::{name}")


def _ci_failure(key, message):
    """None if CI may skip `key` with this message, else why the skip fails."""
    if _PEER_SKIP.search(message):
        return f"{message}: CI runs every parity test (pip install -e '.[dev]')"
    pattern, _ = CI_MAY_SKIP.get(key, (None, None))
    if pattern is not None and re.search(pattern, message):
        return None
    return (f"skipped under CI ({message}): CI runs every test but those tests/conftest.py CI_MAY_SKIP lists"
            + ("" if pattern is None else f", and this one only for a skip matching {pattern!r}"))


def _message(longrepr):
    """The reason of a skip report: longrepr is (file, line, 'Skipped: reason') or a text."""
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        why = _ci_failure(_key(item.path, getattr(item, "originalname", item.name)), _message(report.longrepr))
        if why is not None:
            report.outcome = "failed"
            report.longrepr = why


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped:
        why = _ci_failure(_key(collector.path), _message(report.longrepr))
        if why is not None:                       # a whole file skipped: an error under CI
            report.outcome = "failed"
            report.longrepr = why


# The test that runs `refbert check` compiles every Numba kernel version on a cold cache, in one process a core
# (refbert.check.kernel_rows; about 3 minutes on 2 cores where one process takes 6). Run first, it leaves a warm cache
# (Numba's cache=True) for every later test that calls the same kernels, which would otherwise compile them one at a
# time on one core (the backend parity tests alone: about 50 s). The files whose tests call the Numba CPU kernels
# (NUMBA_CPU) come next, the rest after them. Under pytest-xdist (the README's `-n auto --dist worksteal`) the first
# worker starts on that first half, the second on the rest (the CUDA simulators, g++ and nvcc's builds: no Numba CPU
# kernel), so that it does not compile the same kernels beside the check; an idle worker then takes half of the
# other's queue. Only the order changes; every test still runs, and each file's tests keep their order.
FIRST = "tests/test_cli.py::test_refbert_check_lists_every_op_and_exits_0"
NUMBA_CPU = re.compile(r"tests/test_(kernels_\w+|backend_parity|bench|cli|hf_semantics|mixed|testing|train)\.py::")


def pytest_collection_modifyitems(session, config, items):
    items[:] = sorted(items, key=lambda i: 0 if i.nodeid == FIRST else 1 if NUMBA_CPU.match(i.nodeid) else 2)
