"""The test suite's own rules (tests/conftest.py, tests/peers.py): a test that needs a missing parity peer skips on
its own, not with its whole file; under CI every skip fails (a file skipped whole is an error) except the tests
CI_MAY_SKIP lists, and those only for the skip message it gives them."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# a throwaway test file, run with the real conftest.py and peers.py, where torch and transformers cannot be imported
TESTS = '''
import sys
sys.modules["torch"] = None            # import torch -> ImportError, as if it were not installed
sys.modules["transformers"] = None
import pytest
from peers import peer


def test_fixture(torch):
    pass


def test_importorskip():
    pytest.importorskip("transformers")


def test_peer_call():
    peer("torch")


def test_needs_neither():
    pass
'''


def run(folder, ci, *files):
    for name in ("conftest.py", "peers.py"):
        shutil.copy(HERE / name, folder / name)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                         capture_output=True, text=True, cwd=folder, env=env, timeout=120)
    return res.returncode, res.stdout.splitlines()[-1], res.stdout


def test_missing_peer_skips_one_test_and_fails_under_ci(tmp_path):
    (tmp_path / "test_throwaway.py").write_text(TESTS)
    (tmp_path / "test_module_level.py").write_text('import sys\nsys.modules["torch"] = None\nimport pytest\n'
                                                   'pytest.importorskip("torch")\n\n\ndef test_x():\n    pass\n')
    # without CI: each test that needs a peer skips alone (test_needs_neither runs), the module-level one whole
    code, last, out = run(tmp_path, None, "test_throwaway.py", "test_module_level.py")
    assert code == 0 and "1 passed, 4 skipped" in last, out
    # under CI they fail: the fixture's failure shows as an error in setup, the other two as failures
    code, last, out = run(tmp_path, "true", "test_throwaway.py")
    assert code != 0 and "2 failed, 1 passed, 1 error" in last, out
    assert out.count("CI runs every parity test") >= 3
    code, last, out = run(tmp_path, "true", "test_module_level.py")     # a file skipped whole: a collection error
    assert code != 0 and "error" in last and "could not import 'torch'" in out, out


SKIPS = '''
import pytest


@pytest.mark.skipif(True, reason="numba-cuda not installed")
def test_marked():
    pass


def test_called():
    pytest.skip("nvcc not on PATH")


def test_importorskip():
    pytest.importorskip("no_such_module_for_refbert")


@pytest.mark.xfail(reason="a known failure, not a skip", strict=True)
def test_xfail():
    assert False


def test_runs():
    pass
'''

# the name of a test CI_MAY_SKIP lists: it may skip under CI for its listed reason (no GPU), for no other
ALLOWED = '''
import pytest


@pytest.mark.parametrize("why", ["no CUDA device: cudaErrorNoDevice", "could not import 'cupy'",
                                 "numba-cuda not installed"])
def test_cuda_c_matches_oracle(why):
    pytest.skip(why)
'''


def test_every_skip_fails_under_ci_unless_listed(tmp_path):
    (tmp_path / "test_skips.py").write_text(SKIPS)
    (tmp_path / "test_cuda_nvcc.py").write_text(ALLOWED)
    (tmp_path / "test_whole_file.py").write_text('import pytest\npytest.importorskip("no_such_module_for_refbert")\n'
                                                 '\n\ndef test_x():\n    pass\n')
    files = ("test_skips.py", "test_cuda_nvcc.py", "test_whole_file.py")
    code, last, out = run(tmp_path, None, *files)                    # outside CI: skips are skips
    assert code == 0 and "1 passed, 7 skipped, 1 xfailed" in last, out
    code, last, out = run(tmp_path, "true", *files[:2])
    # the skipif mark skips in setup, so its failure shows as an error; the other three as failures
    assert code != 0 and "3 failed, 1 passed, 2 skipped, 1 xfailed, 1 error" in last, out
    for name in ("test_marked", "test_called", "test_importorskip", "test_cuda_c_matches_oracle[numba-cuda not "):
        assert re.search(rf"(FAILED|ERROR) \S+::{re.escape(name)}", out), name
    assert out.count("skipped under CI") >= 4
    assert "this one only for a skip matching" in out                 # the listed test, skipped for another reason
    code, last, out = run(tmp_path, "true", files[2])                 # a file skipped whole: a collection error
    assert code != 0 and "1 error" in last and "skipped under CI (could not import" in out, out


def test_ci_may_skip_lists_real_tests_with_reasons():
    """Every entry of CI_MAY_SKIP names a test function of its file, with a skip pattern and a reason."""
    from conftest import CI_MAY_SKIP
    assert CI_MAY_SKIP
    for key, (pattern, reason) in CI_MAY_SKIP.items():
        file, name = key.split("::")
        assert re.search(rf"^def {re.escape(name)}\(", (HERE / file).read_text(), re.M), key
        assert re.compile(pattern) and reason.strip(), key


def test_what_counts_as_ci(monkeypatch):
    from peers import in_ci
    for value, want in ((None, False), ("", False), ("0", False), ("false", False), ("true", True), ("1", True)):
        if value is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", value)
        assert in_ci() is want, value


def test_collection_puts_the_check_first_then_the_numba_cpu_files():
    """The order conftest.py gives the collection: `refbert check`'s test (the cold compile of every Numba kernel),
    then the files that call the Numba CPU kernels, then the rest, each group and each file in its own order. Every
    file NUMBA_CPU names exists (a renamed file would fall silently into the last group)."""
    import conftest
    names = ["tests/test_ops.py::a", "tests/test_kernels_gelu.py::b", "tests/test_cli.py::c", conftest.FIRST,
             "tests/test_cuda_sim.py::d", "tests/test_kernels_gelu.py::e", "tests/test_ops.py::f"]
    items = [type("Item", (), {"nodeid": n})() for n in names]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == [conftest.FIRST, "tests/test_kernels_gelu.py::b", "tests/test_cli.py::c",
                                         "tests/test_kernels_gelu.py::e", "tests/test_ops.py::a",
                                         "tests/test_cuda_sim.py::d", "tests/test_ops.py::f"]
    alternatives = re.search(r"test_\((.*?)\)", conftest.NUMBA_CPU.pattern).group(1).split("|")
    files = [p.name for p in HERE.glob("test_*.py")]
    for alt in alternatives:
        assert any(re.fullmatch(rf"test_{alt}\.py", f) for f in files), alt
