"""`refbert exercise init`: the files it writes, an unsolved file failing as "not written yet", a file solved from
the oracle passing `check --ops` and `--model`, and each typical mistake failing on the op and tensor it breaks,
with the shape-of-the-error line that points at it (refbert.testing.explain, computed from the difference)."""
import re

import numpy as np
import pytest

from refbert import testing as T
from refbert.backends import load_module
from refbert.cli import main
from refbert.exercise import ORDER


def _init(tmp_path, *extra):
    assert main(["exercise", "init", str(tmp_path / "ex"), *extra]) == 0
    return tmp_path / "ex"


SOLVED = "\nfrom refbert import ops as _oracle  # noqa: E402\n" + "".join(
    f"\n\ndef {op}_backward(dout, cache):\n    return _oracle.{op}_backward(dout, cache)\n" for op in ORDER)

MISTAKES = {
    "layernorm": ("dx", "constant within each row", '''
def layernorm_backward(dout, cache):          # the mean's path forgotten: no c2
    x, w, mean, rstd = cache
    xhat = (x - mean) * rstd
    lead = tuple(range(x.ndim - 1))
    wdy = dout * w
    c1 = (wdy * xhat).mean(-1, keepdims=True)
    return (wdy - xhat * c1) * rstd, (dout * xhat).sum(lead), dout.sum(lead)
'''),
    "softmax": ("dx", ("the error is the forward's output times an amount per row",), '''
def softmax_backward(dout, cache):            # the diagonal of the Jacobian only: no row sum
    p, scale = cache
    return p * dout * scale
'''),
    "linear": ("dw", ("the expected shape transposed",
                      "got.T equals the expected gradient (within 1e-3): you computed the transpose"), '''
def linear_backward(dout, cache):             # dw transposed
    x, w, has_b = cache
    d2, x2 = dout.reshape(-1, w.shape[0]), x.reshape(-1, x.shape[-1])
    g = (dout @ w, x2.T @ d2)
    return g + (d2.sum(0),) if has_b else g
'''),
    "gelu": ("dx", ("(got - expected) = dout * g(x)", "g(-1) = 0.242, g(0) = 8.41e-09, g(1) = -0.242",
                    "g is odd in x; g -> 0 for |x| > 4"), '''
def gelu_backward(dout, cache):               # d/dx x Phi(x) = Phi(x): the density term x phi(x) forgotten
    x, out, approximate = cache
    if approximate == "none":
        return dout * ndtr(x)
    return _oracle.gelu_backward(dout, cache)
'''),
    "dropout": ("dx", ("got = 0.7 x expected everywhere: a uniform factor, = 1 - p (p = 0.3)",), '''
def dropout_backward(dout, cache):            # the 1/(1 - p) forgotten
    keep, scale, shape, dtype = cache
    return dout.copy() if keep is None else dout * keep
'''),
}


def test_init_writes_the_exercises(tmp_path):
    ex = _init(tmp_path)
    text = (ex / "ops.py").read_text()
    for op in ORDER:
        assert f"def {op}_forward(" in text and f"def {op}_backward(" in text
        body = text.split(f"def {op}_backward(")[1].split("\ndef ")[0]
        assert "raise NotImplementedError" in body and "return" not in body.split('"""')[2]   # blank: no answer
    readme = (ex / "README.md").read_text()
    assert [readme.index(f"**{op}**") for op in ORDER] == sorted(readme.index(f"**{op}**") for op in ORDER)
    assert f"refbert check --ops {ex}/ops.py" in readme and "--model" in readme and "docs/backprop.md" in readme
    with pytest.raises(SystemExit):
        main(["exercise", "init", str(ex), "--ops", "nonsense"])
    assert main(["exercise", "init", str(ex)]) == 2                   # exists: refused, one line
    ex2 = _init(tmp_path / "two", "--ops", "attention", "cross_entropy")
    text = (ex2 / "ops.py").read_text()
    assert "def softmax_backward" not in text and "from refbert.ops import softmax_backward, softmax_forward" in text


def test_unsolved_fails_as_not_written_yet(tmp_path, capsys):
    ex = _init(tmp_path, "--ops", "dropout")
    assert main(["check", "--ops", str(ex / "ops.py"), "--examples", "1", "--no-bench", "--dtypes", "float32"]) == 1
    out = capsys.readouterr().out
    assert "ops.py: dropout;" in out and "not written yet (NotImplementedError: dropout_backward)" in out
    assert re.search(r"dropout\s+out\s+float32.*pass", out)           # the given forward passes


def test_a_solved_exercise_passes_ops_and_model(tmp_path, capsys):
    """The backwards written from the oracle's, on the exercise's own forwards and caches: every op and dtype, then
    the whole model (both heads, both configs, dropout on)."""
    ex = _init(tmp_path)
    path = ex / "solved.py"
    path.write_text((ex / "ops.py").read_text() + SOLVED)
    code = main(["check", "--ops", str(path), "--model", "--examples", "1", "--no-bench"])
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    assert "own ops: attention, cross_entropy, dropout, gelu, layernorm, linear, softmax" in out
    assert out.count(" pass") >= 7 * 2 + 8 and "0 failed" in out


@pytest.mark.parametrize("op", list(MISTAKES))
def test_each_typical_mistake_fails_on_its_op_and_says_how(tmp_path, op):
    tensor, phrases, body = MISTAKES[op]                   # (the lines the README quotes, whole)
    ex = _init(tmp_path)
    path = ex / f"mistake_{op}.py"
    path.write_text((ex / "ops.py").read_text() + SOLVED + body)
    module = load_module(str(path))
    f, b = T.module_ops(module)[op]
    rep = T.check_op(op, f, b, examples=1)
    failing = {r["tensor"] for r in rep.rows if not r["ok"]}
    assert failing == {tensor}, str(rep)
    text = str(rep)
    phrases = (phrases,) if isinstance(phrases, str) else phrases
    assert f"FAIL {op} {tensor} (float32)" in text and all(p in text for p in phrases), text
    assert np.isfinite([r["ulps"] for r in rep.rows if r["ok"]]).all()


def test_a_mistake_in_the_model_names_the_first_tensor_it_spoils(tmp_path):
    """LayerNorm's backward without the mean's path, in the whole model: the first wrong gradient in the order the
    backward makes them is the MLM transform's dense weight (its LayerNorm's own dw, db are right), in the head."""
    ex = _init(tmp_path)
    path = ex / "mistake.py"
    path.write_text((ex / "ops.py").read_text() + SOLVED + MISTAKES["layernorm"][2])
    _, runs = T.check_model_ops(str(path), dtypes=("float32",), heads=("BertForPreTraining",),
                            configs={"tiny": T.model_configs()["tiny"]})
    (run,) = runs
    assert not run["ok"]
    first = run["first_failure"]
    assert first["where"] == "head" and first["key"] == "grad/cls.predictions.transform.dense.weight", first
    ok = {r["key"] for r in run["rows"] if r["ok"]}
    assert "grad/cls.predictions.transform.LayerNorm.weight" in ok and "output/prediction_logits" in ok
