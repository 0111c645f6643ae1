"""`refbert check` as a user runs it, and the README/CI contract."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refbert import check, ops
from refbert.config import HEADS
from refbert.gradcheck import TOLERANCE

ROOT = Path(__file__).resolve().parents[1]


def test_refbert_check_lists_every_op_and_exits_0():
    # (the timeout guards against a hang, it times nothing: a cold compile of every kernel version shares the cores
    # with the suite's other workers, 3 to 5 minutes on 2 cores)
    res = subprocess.run([sys.executable, "-m", "refbert", "check"], capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout + res.stderr
    for op in ("linear", "embedding", "layernorm", "softmax", "gelu (exact erf)", "gelu (tanh)", "tanh", "dropout",
               "add", "attention", "cross_entropy", "mse"):
        assert re.search(rf"^{re.escape(op)}", res.stdout, re.M), op
    assert "FAIL" not in res.stdout and " 0 failed" in res.stdout
    kernel_lines = re.findall(r"^(\w+ v\d+)\s+(float\d+)\s", res.stdout, re.M)    # the numba kernels' table
    assert len(kernel_lines) == len(set(kernel_lines)), "a kernel version listed twice"
    if kernel_lines:               # the kernels' progress (minutes on a cold cache) on stderr, one line per file
        assert "compiles on its first call" in res.stderr
        n = len(re.findall(r"^  \[\d+/(\d+)\] \w+: \d+ version", res.stderr, re.M))
        assert n == int(re.search(r"^  \[\d+/(\d+)\]", res.stderr, re.M).group(1)) >= 5, res.stderr
        assert "kernels checked in" in res.stderr
        assert "version(s)" not in res.stdout and "compiles" not in res.stdout      # the table stays clean


def test_kernel_rows_are_the_same_in_one_process_and_side_by_side():
    """refbert check compiles and checks the kernel versions in worker processes (a cold cache's minutes, shared
    out); the rows, in file order, are those of one process checking them in turn."""
    pytest.importorskip("numba")
    lines = []
    two = check.kernel_rows(progress=lines.append, jobs=2)
    assert "2 processes side by side" in lines[0] and len(re.findall(r"checked \(", "\n".join(lines))) >= 5, lines
    assert two == check.kernel_rows(jobs=1)


def test_kernel_rows_check_the_threaded_build_too(monkeypatch):
    """Layernorm v3 runs a build compiled with parallel=True from PARALLEL_MIN elements on and its one-thread twin
    below: the check's shapes are small, so its rows must run the threaded build as well (check._builds). A
    threaded forward that is wrong (one added to every output; the twin left right) fails the rows of v3 and of no
    other version."""
    pytest.importorskip("numba")
    from refbert_kernels import layernorm as K
    real = K._forward_v3_serial

    def wrong(x2, a2, mask, w, b, eps, out, mean, rstd):         # the threaded build's call, one added after
        real(x2, a2, mask, w, b, eps, out, mean, rstd)
        out += 1
    monkeypatch.setattr(K, "_forward_v3", wrong)
    index = [s.name for s in check._kernel_specs()].index("layernorm")
    assert check._builds(check._kernel_specs()[index], 3) == (None, 0)
    for v in (2, 3):
        rows = check._version_rows((index, v))[1]
        assert [ok for *_, ok in rows] == [v != 3] * 2, rows


def test_refbert_check_fails_on_a_wrong_backward(monkeypatch, capsys):
    good = check.op_cases

    def broken():
        cases = good()
        for c in cases:
            if c.op == "tanh":
                c.backward = lambda d, cache: ops.tanh_backward(d, cache) * 1.01
        return cases
    monkeypatch.setattr(check, "op_cases", broken)
    assert check.main() == 1
    out = capsys.readouterr().out
    assert re.search(r"^tanh .*FAIL$", out, re.M) and "1 failed" in out


def test_check_tolerance_is_1e7_in_both_directions():
    """The op table's verdict at its stated tolerance (gradcheck.TOLERANCE = 1e-7): tanh's backward scaled by
    1 + 6e-7 has relative error 3e-7 (|a - n| / (|a| + |n|) = 6e-7 / 2), 3x the tolerance, and fails; by 1 + 2e-8,
    1e-8, it passes (float64 centred differences here are good to ~1e-10)."""
    assert TOLERANCE == 1e-7
    (case,) = [c for c in check.op_cases() if c.op == "tanh"]
    for factor, ok in ((1 + 6e-7, False), (1 + 2e-8, True)):
        case.backward = lambda d, cache, f=factor: ops.tanh_backward(d, cache) * f
        ((_, _, _, err, passed),) = check.run([case])
        assert passed == ok and (2e-7 < err < 4e-7 if not ok else err < 2e-8), (factor, err)


def test_check_model_rows_fail_on_a_wrong_layernorm_weight_gradient(monkeypatch):
    """Every head's whole-model row reports its worst parameter: the numpy backend's layernorm dw 0.1% off makes
    every head fail, at least 10x over the tolerance (one random direction: the share of dw in it varies by head),
    and the worst parameter named is a LayerNorm weight."""
    from refbert.backends import get_backend
    B = get_backend("numpy")
    right = B.layernorm_backward

    def wrong(dout, cache):
        dx, dw, db = right(dout, cache)
        return dx, dw * 1.001, db
    monkeypatch.setattr(B, "layernorm_backward", wrong)
    rows = check.model_rows()
    assert len(rows) == len(HEADS)
    for op, _, worst, err, ok in rows:
        assert not ok and err > 10 * TOLERANCE and worst.endswith("LayerNorm.weight"), (op, worst, err)


def _bash_blocks():
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)


def test_readme_opens_with_the_two_setup_blocks():
    blocks = _bash_blocks()
    assert len(blocks) >= 2
    assert "refbert check" in blocks[0] and "pip install" in blocks[0]
    assert '".[dev]"' in blocks[1] and "pytest" in blocks[1]


def test_ci_runs_the_readme_test_block():
    printed = subprocess.run(["bash", str(ROOT / ".ci/run"), "--print"], capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == _bash_blocks()[1].strip()


def _python_at_root(code, **env):
    """`python -c code` from the repository's root, where Python puts the root first on sys.path."""
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=120)


def test_import_kernels_from_the_root_gets_the_installed_package(tmp_path):
    """`kernels` is Hugging Face's PyPI package (transformers >= 5.25 requires it and imports it): from the root,
    where `import kernels` finds this repository's kernels/ first, that folder hands over to the installed package.
    A stand-in package on PYTHONPATH (after the root, before site-packages) plays the installed one, submodule
    included; refbert_kernels still imports as itself beside it. Two threads import it at once, the second while
    the first is inside the stand-in's code (it sleeps): both get it whole, the second having waited. Without the
    hand-over, `kernels` would be our folder: no MARK."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("import time\ntime.sleep(0.5)\nMARK = 'installed'\n")
    (tmp_path / "kernels" / "layer.py").write_text("WHAT = 'a submodule'\n")
    res = _python_at_root(
        "import threading, time\n"
        "seen = []\n"
        "def get():\n    import kernels\n    seen.append(getattr(kernels, 'MARK', None))\n"
        "first = threading.Thread(target=get)\nfirst.start()\ntime.sleep(0.2)\nget()\nfirst.join()\n"
        "import kernels, kernels.layer, refbert_kernels, refbert_kernels.layernorm as L\n"
        "print(seen, kernels.MARK, kernels.layer.WHAT, kernels.__file__, refbert_kernels.__name__, L.__name__, "
        "sep='|')", PYTHONPATH=str(tmp_path))
    assert res.returncode == 0, res.stderr
    seen, mark, what, where, ours, layernorm = res.stdout.strip().split("|")
    assert seen == "['installed', 'installed']", seen
    assert (mark, what, Path(where)) == ("installed", "a submodule", tmp_path / "kernels" / "__init__.py")
    assert (ours, layernorm) == ("refbert_kernels", "refbert_kernels.layernorm")


def test_import_kernels_from_the_root_without_the_package_is_an_empty_namespace():
    """No `kernels` installed (site-packages taken off sys.path, transformers imported before): `kernels` is what
    Python makes of a folder without a package, an empty namespace (no __file__, nothing to import from it), which
    transformers' availability check reads as not installed (it finds this folder by importlib.util.find_spec, then
    imports it), where raising would break it."""
    res = _python_at_root(
        "import sys\nfrom transformers.utils import import_utils as u\n"
        "sys.path = [p for p in sys.path if 'site-packages' not in p]\n"
        "import kernels\nprint(kernels.__file__, list(kernels.__path__), sep='|')\n"
        "try:\n    from kernels import CUDAProperties\nexcept ImportError as e:\n    print('ImportError')\n"
        "print(u._is_package_available('kernels', return_version=True)[0])")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["None|[]", "ImportError", "False"], res.stdout


def test_transformers_imports_from_the_root():
    """The failure that the hand-over fixes, as a user meets it: a BERT built by transformers from the repository's
    root (transformers >= 5.25 imports `kernels` while it builds a model)."""
    res = _python_at_root("from transformers import BertConfig, BertModel\n"
                          "BertModel(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, "
                          "intermediate_size=8, vocab_size=10))\nprint('built')")
    assert res.returncode == 0 and res.stdout.strip() == "built", res.stderr[-2000:]


def test_refbert_trace_prints_every_layer_and_passes():
    res = subprocess.run([sys.executable, "-m", "refbert", "trace"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for part in ("-- embeddings", "-- encoder layer 0", "-- encoder layer 1", "-- pooler", "-- heads",
                 "bert.encoder.layer.1.attention.self.query", "cls.predictions.decoder (tied to word_embeddings)",
                 " 0 spot check(s) above"):
        assert part in res.stdout, part
    # no bare nan: the decoder's call on all rows has no gradient and says so; the key biases are flagged and
    # explained (zero in exact arithmetic), and no other gradient is
    assert "nan" not in res.stdout
    assert re.search(r"^linear +cls\.predictions\.decoder .* — +forward only +-$", res.stdout, re.M)
    flagged = re.findall(r"^\w+ +(\S+) .*\d\*", res.stdout, re.M)
    assert flagged == ["bert.encoder.layer.0.attention.self.key", "bert.encoder.layer.1.attention.self.key"]
    assert "zero in exact arithmetic" in res.stdout and "softmax(s + c) = softmax(s)" in res.stdout


def test_trace_key_bias_gradient_is_rounding_noise():
    """What trace's note says, measured: each key bias's gradient is float64 rounding (~eps of the weight's, as a
    zero sum computed), every other bias's is not; in float32 the same holds at float32's eps."""
    from refbert import trace
    for dtype in (np.float64, np.float32):
        records, _ = trace.trace(dtype=dtype)
        linears = [r for r in records if r["op"] == "linear" and r.get("n_grads") == 3]
        for r in linears:
            dx, dw, db = r["grad_norms"]
            if r["where"].endswith("attention.self.key"):
                assert db <= trace.noise_floor(dtype) * dw, (r["where"], db, dw)
            else:
                assert db > 1e-3 * dw, (r["where"], db, dw)          # a real gradient: far above the noise
        assert sum(r["where"].endswith("attention.self.key") for r in linears) == 2


def test_refbert_trace_catches_a_wrong_op(monkeypatch, capsys):
    from refbert import trace
    from refbert.backends import get_backend
    get_backend("numpy")        # built before the patch, so it never holds the wrong function past this test
    right = ops.gelu_backward   # (bias_gelu, composed over refbert.ops, looks gelu_backward up at each call)
    monkeypatch.setattr(ops, "gelu_backward", lambda d, c: right(d, c) * 1.001)
    assert trace.main() == 1
    out = capsys.readouterr().out
    assert re.search(r"^bias_gelu .* [0-9.]+e-0[1-4]$", out, re.M)  # bias_gelu composes gelu: its rows fail


def test_refbert_trace_checks_every_gradient_of_a_call_not_only_the_first(monkeypatch, capsys):
    """The spot check covers each differentiable input of a call: a linear backward whose dw alone is 0.1% off
    (dx and db right) fails the linear rows, and only those (FD in float64 resolves 1e-3 far above TOLERANCE)."""
    from refbert import trace
    from refbert.backends import get_backend
    B = get_backend("numpy")                 # the backend trace wraps: it holds linear_backward since it was built
    right = B.linear_backward

    def wrong_dw(dout, cache, *a, **k):
        dx, dw, *db = right(dout, cache, *a, **k)                    # (dx, dw) without a bias
        return (dx, dw * 1.001, *db)
    monkeypatch.setattr(B, "linear_backward", wrong_dw)
    assert trace.main() == 1
    out = capsys.readouterr().out
    failing = re.findall(r"^(\w+) .* ([0-9.]+e-0[1-4])$", out, re.M)
    assert failing and {op for op, _ in failing} == {"linear"}, failing


def test_readme_python_examples_run():
    for block in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S):
        exec(compile(block, "README.md", "exec"), {})


def test_output_piped_into_head_ends_quietly():
    # `refbert ... | head -n 1`: the reader goes away; the command must stop without "Broken pipe" or a traceback.
    # A command stand-in prints far more than a pipe holds, so that a write fails once head has gone.
    script = ("import sys\nfrom refbert import cli\n"
              "cli.run = lambda args: [print('row', i) for i in range(200_000)] and 0\n"
              "sys.exit(cli.main(['check']))\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()                                   # what head does after its line
    err = p.stderr.read().decode()
    code = p.wait(timeout=120)
    p.stderr.close()
    assert first == b"row 0\n"
    assert err == "" and code == 1, err                # 1, as Python's own recipe exits on EPIPE


def test_ci_smoke_runs_every_extra_alone():
    """.ci/run runs the README's block 2 first, then .ci/smoke_extras.sh, which installs each extra of setup.py
    (but dev, the suite's own) in a fresh environment: a new extra without a smoke run fails here."""
    import ast
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    extras = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call) for kw in node.keywords
                  if kw.arg == "extras_require")
    names = {ast.literal_eval(k) for k in extras.keys} - {"dev"}
    smoke = (ROOT / ".ci/smoke_extras.sh").read_text(encoding="utf-8")
    fresh = set(re.findall(r'^\s*fresh \w+ "([\w,]+)"$', smoke, re.M))
    assert names == fresh, (names, fresh)
    assert re.search(r'^\s*step base "\$work/base/bin/pip" install -q "\$wheel"$', smoke, re.M)  # no extra at all
    run = (ROOT / ".ci/run").read_text(encoding="utf-8")
    assert run.index('bash -e -c "$block"') < run.index("bash .ci/smoke_extras.sh")
