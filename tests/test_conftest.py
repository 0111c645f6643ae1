"""The test suite's own rules (tests/conftest.py, tests/peers.py): a test that needs a missing parity peer skips on
its own, not with its whole file, and fails instead of skipping under CI."""
import os
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


def test_what_counts_as_ci(monkeypatch):
    from peers import in_ci
    for value, want in ((None, False), ("", False), ("0", False), ("false", False), ("true", True), ("1", True)):
        if value is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", value)
        assert in_ci() is want, value
