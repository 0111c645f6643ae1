"""refbert.testing (check_op, bench_op, the shape of an error), refbert.backends (any module as the model's ops) and
`refbert check --ops FILE [--model]`.

What is proven here, and how:
- the oracle's own functions, given as "yours", pass every op's cases (the harness accepts what is right), and each
  of the synthetic mistakes below fails on the tensor it breaks (it rejects what is wrong); the shape-of-the-error
  lines are checked on differences built from known patterns, never from the code under test;
- refbert's own Numba kernels (the version each backend runs) pass the same check the user gets;
- a set of ops written with PyTorch (tests/data/torch_ops.py: autograd backward, refbert's Philox masks) passes
  `check --ops` in float32 and float64 and `--model` (two heads, two configs, dropout on, every tensor), through
  the array conversion (declared "torch");
- a layernorm written as Numba CUDA kernels with CuPy-style launchers (tests/data/cuda_layernorm_ops.py) passes
  `check --ops --model` in Numba's CUDA simulator. There the arrays are NumPy's: CuPy creates no array without a
  CUDA driver (cupy-cuda12x 14.2 on this machine: CUDARuntimeError cudaErrorInsufficientDriver), so the CuPy side of
  refbert.backends.convert is not exercised without a GPU; its torch side (DLPack, zero copy) is, below;
- a module as the model's backend: its ops are what the model runs, the composed ops (residual LayerNorm, bias +
  GELU, attention) are built from its basic ones, the rest are the oracle's, and with the oracle's functions inside
  the outputs are the numpy backend's bit for bit.
Hypothesis draws few shapes here (examples=2..3), under the ci profile's derandomized settings.
"""
import json
import math
import types

import numpy as np
import pytest

import refbert
from refbert import ops
from refbert import testing as T
from refbert.backends import Backend, ProbeError, convert, get_backend

import cudachild

DATA = __import__("os").path.join(__import__("os").path.dirname(__file__), "data")


def oracle_pair(op):
    return getattr(ops, f"{op}_forward"), getattr(ops, f"{op}_backward")


# ----------------------------------------------------------------------------------------------------------------
# check_op accepts what is right ...

@pytest.mark.parametrize("op", T.OPS)
def test_the_oracle_passes_its_own_check(op):
    """Every op of refbert.ops, handed in as "yours" (probed as NumPy): every case passes, float32 and float64."""
    for dtype in ("float32", "float64"):
        rep = T.check_op(op, *oracle_pair(op), dtype=dtype, examples=2)
        assert rep.passed, str(rep)
        assert {r["tensor"] for r in rep.rows} >= {"out"}
        # (no check of the oracle's float32 error against refbert's float32 noise here: that noise is measured on
        # runs that include this very oracle on these inputs, so the comparison could not fail)


def test_only_a_backward_or_only_a_forward():
    f, b = oracle_pair("layernorm")
    rep = T.check_op("layernorm", backward=b, examples=1)
    assert rep.passed and {r["tensor"] for r in rep.rows} == {"dx", "dw", "db"} and rep.given == "backward only"
    rep = T.check_op("layernorm", forward=f, examples=1)
    assert rep.passed and {r["tensor"] for r in rep.rows} == {"out"} and rep.given == "forward only"
    with pytest.raises(ValueError, match="expected a forward, a backward or both"):
        T.check_op("layernorm")
    with pytest.raises(ValueError, match="argument 'op' expected one of"):
        T.check_op("layer_norm", f, b)
    with pytest.raises(ValueError, match="argument 'dtype' expected"):
        T.check_op("layernorm", f, b, dtype="float16")


def test_the_report_table_and_json():
    rep = T.check_op("softmax", *oracle_pair("softmax"), examples=2)
    text = str(rep)
    assert text.splitlines()[0].split()[:4] == ["op", "tensor", "dtype", "cases"]
    assert "softmax  out" in text and "softmax  dx" in text and "pass" in text
    data = json.loads(rep.to_json())
    assert data["passed"] is True and data["op"] == "softmax"
    labels = [c["label"] for c in data["cases"]]
    assert "a fully padded row" in labels and "logits 1e4" in labels and "T = 1" in labels
    assert any(lab.startswith("drawn") for lab in labels)           # hypothesis-drawn shapes beside the edges


def test_numba_kernels_pass_the_same_check():
    """refbert's own fused kernels (the version the numba backend runs) pass what a user's kernel must pass."""
    pytest.importorskip("numba")
    B = get_backend("numba")
    for op in B.KERNELS:
        f, b = getattr(B, f"{op}_forward"), getattr(B, f"{op}_backward")
        rep = T.check_op(op, f, b, dtype="float32", examples=1)
        assert rep.passed, str(rep)


# ----------------------------------------------------------------------------------------------------------------
# ... and rejects what is wrong, saying where and how

def _ce_without_dloss(dloss, cache):
    return ops.cross_entropy_backward(1.0, cache)


def _transposed_attention(dout, cache):
    dq, dk, dv = ops.attention_backward(dout, cache)
    return dk, dq, dv


def _gelu_plus_x(dout, cache):
    x, out, approximate = cache
    return ops.gelu_backward(dout, cache) + 0.5 * dout * x


@pytest.mark.parametrize("op, backward, tensor, phrase", [
    ("cross_entropy", _ce_without_dloss, "dlogits", "uniform factor, = 1/dloss (dloss = 0.75)"),
    ("attention", _transposed_attention, "dq", "worst elements"),
    ("gelu", _gelu_plus_x, "dx", "g(x) = 0.5 x"),
])
def test_a_wrong_backward_fails_on_its_tensor(op, backward, tensor, phrase):
    rep = T.check_op(op, backward=backward, examples=1)
    assert not rep.passed
    bad = {r["tensor"] for r in rep.rows if not r["ok"]}
    assert tensor in bad, str(rep)
    text = str(rep)
    assert f"FAIL {op} {tensor} (float32)" in text and phrase in text, text


def test_nan_dtype_count_and_written_inputs_fail_with_a_reason():
    f, b = oracle_pair("tanh")
    cases = [dict(shape=(3, 7))]
    rep = T.check_op("tanh", f, lambda d, c: b(d, c).astype(np.float64), cases=cases)
    assert "returned float64 for float32 inputs" in str(rep)
    rep = T.check_op("tanh", f, lambda d, c: b(d, c) * np.nan, cases=cases)
    assert not rep.passed and "not finite" in str(rep)
    rep = T.check_op("linear", backward=lambda d, c: ops.linear_backward(d, c)[:2],
                     cases=[dict(lead=(3,), C_in=4, C_out=5)])
    assert "backward returned 2 gradient(s), expected 3 (dx, dw, db)" in str(rep)

    def scribbling_forward(x):
        out, cache = f(x)
        x *= 2                                         # writes into its argument
        return out, cache
    rep = T.check_op("tanh", scribbling_forward, b, cases=cases)
    assert not rep.passed and "wrote into its argument(s) x" in str(rep)

    def raising(dout, cache):
        raise RuntimeError("boom")
    rep = T.check_op("tanh", backward=raising, cases=cases)
    assert "backward raised RuntimeError: boom" in str(rep) and rep.given == "backward only"


def test_hypothesis_shrinks_a_failing_shape():
    """A softmax backward that is wrong only for rows longer than 5: the drawn failure is shrunk to T = 6."""
    pytest.importorskip("hypothesis")
    f, b = oracle_pair("softmax")

    def long_rows_wrong(dout, cache):
        dx = b(dout, cache)
        return dx * 2 if dx.shape[-1] > 5 else dx
    spec = T.SPECS["softmax"]
    res = T.drawn_results(spec, lambda c: T.run_case(spec, c, None, T.adapt(long_rows_wrong, "numpy"),
                                                     np.dtype(np.float32)), 25)
    shrunk = [r for r in res if r.label.startswith("drawn, shrunk")]
    assert shrunk and not shrunk[0].ok and shrunk[0].params["T"] == 6, [(r.label, r.params) for r in res]


# the shape of an error, on differences with a known pattern (generic: no op's answer is written in explain)

def _pattern(got, ref, **context):
    return T.explain(got, ref, context)[-1]


def test_explain_names_each_pattern():
    r = np.random.default_rng(0)
    ref = r.standard_normal((6, 9))
    assert "sign flip" in _pattern(-ref, ref)
    assert "got = 0.7 x expected everywhere: a uniform factor, = 1 - p (p = 0.3)" in \
        _pattern(0.7 * ref, ref, scalars={"p": 0.3})
    sq = r.standard_normal((5, 5))
    assert "transposed" in _pattern(sq.T, sq)
    assert "constant within each row" in _pattern(ref + r.standard_normal((6, 1)), ref)
    assert "along axis 0" in _pattern(ref + r.standard_normal((1, 9)), ref)
    out = r.random((6, 9))
    assert "the forward's output times an amount per row" in _pattern(ref + out * r.standard_normal((6, 1)), ref,
                                                                      out=out)
    x = r.standard_normal((6, 9))
    assert "0.25 x the input" in _pattern(ref + 0.25 * x, ref, x=x)
    assert "affine function of the input" in _pattern(ref + (x - x.mean(-1, keepdims=True)) * 3.0, ref, x=x)
    x, dout = r.standard_normal(400) * 3, r.standard_normal(400)
    line = _pattern(ref[0, 0] + dout * np.exp(-x * x / 2) * 0 + dout * x * np.exp(-x * x / 2),
                    np.full(400, ref[0, 0]), x=x, dout=dout)
    assert "dout * g(x)" in line and "odd in x" in line and "g -> 0 for |x| > 4" in line, line
    zeros = np.where(ref > 0, ref, 0.0)
    assert "where the expected value is 0" in _pattern(np.where(ref > 0, ref, 1.0), zeros)
    assert T.explain_shape(ref.T, ref)[0].endswith("you computed the transpose")
    assert "summed over them it equals the expected gradient" in T.explain_shape(np.stack([ref, ref]), 2 * ref)[0]


def test_ulps_judges_infinities_exactly():
    """A reference +-inf passes only with the same infinity; a NaN or an inf where the reference is finite fails."""
    ref = np.array([1.0, np.inf, -np.inf])
    assert T.ulps(ref, ref, np.float32) == 0.0
    assert T.ulps(np.array([1.0, np.inf, np.inf]), ref, np.float32) == math.inf
    assert T.ulps(np.array([1.0, 3.0, -np.inf]), ref, np.float32) == math.inf
    assert T.ulps(np.array([np.nan]), np.array([1.0]), np.float32) == math.inf
    assert T.ulps(np.array([1.0 + 2 ** -22]), np.array([1.0]), np.float32) == 2.0   # 2 ulps at scale 1
    # a tensor that is 0 in exact arithmetic is judged on the scale of its largest sibling
    assert T.ulps(np.array([1e-17]), np.array([0.0]), np.float64, sibling=2.0) < 1


# ----------------------------------------------------------------------------------------------------------------
# arrays of other libraries

def test_torch_functions_are_probed_and_share_memory(torch):
    a = np.arange(6.0).reshape(2, 3)
    t = convert(a, "torch")
    assert isinstance(t, torch.Tensor) and np.shares_memory(t.numpy(), a)     # DLPack: no copy
    back = convert(t * 2, "numpy")
    assert isinstance(back, np.ndarray) and back[1, 2] == 10
    ro = np.broadcast_to(np.arange(3.0), (2, 3))                              # read-only view: copied, not refused
    assert convert(ro, "torch").shape == (2, 3)

    def softmax_forward(x, scale=1.0, mask=None):              # torch-only code: fails on NumPy, probed to torch
        z = x * scale + (0 if mask is None else mask)
        p = torch.softmax(z, dim=-1)
        return p, (p, scale)

    def softmax_backward(dout, cache):
        p, scale = cache
        return p * (dout - (dout * p).sum(dim=-1, keepdim=True)) * scale
    rep = T.check_op("softmax", softmax_forward, softmax_backward, examples=2)
    assert rep.passed, str(rep)
    assert rep.library == "torch"


def test_a_read_only_array_reaches_torch_as_a_copy(torch):
    """torch.from_dlpack takes a read-only NumPy array without complaint and shares its memory, so a function that
    writes into its argument would change an array NumPy marked unwritable (a broadcast view's one row, or the
    model's); convert() copies it first. A writable array is still shared."""
    a = np.arange(4.0)
    a.flags.writeable = False
    t = convert(a, "torch")
    t[0] = 5.0
    assert a[0] == 0.0
    w = np.arange(4.0)
    convert(w, "torch")[0] = 5.0
    assert w[0] == 5.0


def test_caches_keep_their_field_names_in_another_library(torch):
    """convert_tree keeps a NamedTuple a NamedTuple: a torch softmax_backward reading the oracle forward's cache by
    its field names (cache.p, cache.scale) gets a SoftmaxCache of tensors, and grades as the oracle's."""
    def softmax_backward(dout, cache):
        assert isinstance(cache.p, torch.Tensor), type(cache.p)
        return cache.p * (dout - (dout * cache.p).sum(dim=-1, keepdim=True)) * cache.scale
    softmax_backward.array_library = "torch"
    rep = T.check_op("softmax", backward=softmax_backward, examples=1)
    assert rep.passed, str(rep)


def test_a_probe_restores_the_dropout_generator_between_tries(torch):
    """A torch dropout that draws its keep-mask (refbert's Philox stream) before its first torch-only call: the
    NumPy try draws a stream and fails, so the torch try must start from the generator's state before the call, or
    it would drop other units than the oracle and leave the generator a stream ahead."""
    def dropout_forward(x, p, rng=None, train=True):
        keep = ops.dropout_mask(rng, tuple(x.shape), p, "dropout")          # draws the next stream
        return x.masked_fill(~torch.from_numpy(keep), 0.0) / (1 - p), None  # masked_fill: torch only
    B = Backend(types.SimpleNamespace(dropout_forward=dropout_forward))
    x = np.random.default_rng(0).standard_normal((4, 9))
    rng, ref_rng = refbert.DropoutRNG(5), refbert.DropoutRNG(5)
    got, _ = B.dropout_forward(x, 0.3, rng)
    want, _ = ops.dropout_forward(x, 0.3, ref_rng)
    assert B.dropout_forward.array_library == "torch"
    np.testing.assert_allclose(got, want, rtol=1e-15)     # the same units kept; x / 0.7 against x * (1 / 0.7)
    assert rng.state == ref_rng.state


def test_a_probe_that_fails_alike_everywhere_raises_the_functions_own_error(torch):
    """A function that raises the same error whatever the arrays raises that error (its own message, not a
    ProbeError about array libraries); one that fails differently per library gets a ProbeError naming each try."""
    def tanh_forward(x):
        raise ValueError("tanh: my own message")
    with pytest.raises(ValueError, match="^tanh: my own message$"):
        Backend(types.SimpleNamespace(tanh_forward=tanh_forward)).tanh_forward(np.ones(3))

    def tanh_backward(dout, cache):
        raise TypeError(f"not {type(dout).__name__}")
    with pytest.raises(ProbeError, match="tanh_backward ran with none of numpy: TypeError: not ndarray; "
                                         "torch: TypeError: not Tensor"):
        Backend(types.SimpleNamespace(tanh_backward=tanh_backward)).tanh_backward(np.ones(3), (np.ones(3),))


def test_library_of_tells_torch_cuda_from_torch_cpu():
    """library_of reads a tensor's device: a torch tensor on "cuda" is "torch.cuda" (it goes to and from NumPy
    through the host), on "cpu" "torch". Stand-ins typed as torch's (no GPU here)."""
    from refbert.backends import library_of

    def tensor(device):
        return type("Tensor", (), {"__module__": "torch._stand_in", "device": types.SimpleNamespace(type=device),
                                   "dtype": None})()
    assert library_of(tensor("cuda")) == "torch.cuda" and library_of(tensor("cpu")) == "torch"
    assert library_of(np.zeros(1)) == "numpy" and library_of([1.0]) is None


def test_a_device_backend_gets_the_oracles_composed_ops_not_its_own(torch):
    """A module that keeps the model's arrays itself (to_device; here declared torch) and defines layernorm: its
    residual LayerNorms are the oracle's (on host copies, as the module docstring says), not composed over its
    layernorm, whose refbert.validate checks read NumPy arrays only."""
    mod = types.SimpleNamespace(ARRAY_LIBRARY="torch", to_device=lambda a: a,   # (wrapped: the oracle's own
                                layernorm_forward=lambda *a: ops.layernorm_forward(*a),   # functions are not "own")
                                layernorm_backward=lambda d, c: ops.layernorm_backward(d, c))
    B = Backend(mod)
    assert B.home == "torch" and B.origin["layernorm_forward"] == "own"
    assert B.origin["residual_layernorm_forward"] == "oracle" and B.ops_of("composed") == []


def test_attention_without_probs_is_refused_by_name_under_output_attentions():
    """A module with its own attention_forward but no attention_probs: the model runs, and output_attentions, which
    needs the probabilities after dropout, is a ValueError naming attention_probs (not the oracle reading a cache
    it did not make)."""
    from refbert.check import model_batch, tiny_config
    mod = types.SimpleNamespace(attention_forward=lambda *a: ops.attention_forward(*a),
                                attention_backward=lambda d, c: ops.attention_backward(d, c))
    cfg = tiny_config("BertModel")
    x = model_batch(cfg, "BertModel")
    m = refbert.BertModel(cfg, seed=0, backend=mod)
    m(**x)
    with pytest.raises(ValueError, match="defines attention_forward but not attention_probs"):
        m(**x, output_attentions=True)


def test_a_backend_file_edited_is_loaded_again():
    """load_module runs a .py file once per version: the same path with a new modification time is loaded anew
    (an edited file is what a user grading their op reruns), the same version is the module already loaded."""
    import os
    import tempfile
    from refbert.backends import load_module
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mine.py")
        with open(path, "w") as f:
            f.write("VALUE = 1\n")
        first = load_module(path)
        assert first.VALUE == 1 and load_module(path) is first
        with open(path, "w") as f:
            f.write("VALUE = 2\n")
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))     # a later version, whatever the clock
        assert load_module(path).VALUE == 2


# ----------------------------------------------------------------------------------------------------------------
# any module is a backend

class _Counting(types.ModuleType):
    """A module whose layernorm, gelu_backward and softmax are the oracle's, counted."""

    def __init__(self):
        super().__init__("counting_ops")
        self.calls = {}
        for name in ("layernorm_forward", "layernorm_backward", "gelu_backward", "softmax_forward",
                     "softmax_backward"):
            setattr(self, name, self._count(name, getattr(ops, name)))

    def _count(self, name, fn):
        def call(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **k)
        call.__name__ = name
        return call


def test_a_module_is_the_model_backend_and_its_basic_ops_make_the_composed_ones():
    from refbert.check import model_batch, tiny_config
    mod = _Counting()
    cfg = tiny_config("BertForPreTraining")
    x = model_batch(cfg, "BertForPreTraining")
    outs = []
    for backend in ("numpy", mod):
        m = refbert.BertForPreTraining(cfg, seed=3, dtype=np.float32, backend=backend)
        outs.append((m(**x), m.backward(), m))
    (o_ref, g_ref, _), (o, g, m) = outs
    assert float(o.loss) == float(o_ref.loss)                                  # bit for bit: the same functions
    assert all(np.array_equal(g[k], g_ref[k]) for k in g_ref)
    L = cfg.num_hidden_layers
    # every LayerNorm ran through the module: embeddings, 2 per layer (composed residual ones), the MLM transform
    assert mod.calls["layernorm_forward"] == 1 + 2 * L + 1 and mod.calls["layernorm_backward"] == 1 + 2 * L + 1
    assert mod.calls["gelu_backward"] == L + 1                                 # bias + GELU: the layers and the head
    assert mod.calls["softmax_forward"] == L and mod.calls["softmax_backward"] == L   # inside every attention
    B = m.ops
    assert isinstance(B, Backend) and B.origin["layernorm_forward"] == "own"
    assert B.origin["gelu_forward"] == "oracle" and B.origin["gelu_backward"] == "own"
    assert B.origin["residual_layernorm_forward"] == "composed" and B.origin["attention_backward"] == "composed"
    assert B.linear_forward is ops.linear_forward
    text = B.describe()
    assert "own ops: gelu (backward only), layernorm, softmax" in text
    assert "composed from its own: attention (from softmax), bias_gelu (from gelu), dropout_residual_layernorm " \
           "(from layernorm), residual_layernorm (from layernorm)" in text


def test_half_pairs_in_another_library(torch):
    """A module with only a torch softmax_backward (probed), and one with only a torch layernorm_forward: the
    oracle's other half reads (or makes) a cache of the other library, converted at the call; the model's outputs
    and gradients are the numpy backend's within float64 rounding."""
    from refbert.check import model_batch, tiny_config

    def softmax_backward(dout, cache):
        p, scale = cache
        return p * (dout - (dout * p).sum(dim=-1, keepdim=True)) * scale

    def layernorm_forward(x, w, b, eps=1e-12):
        out = torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)
        mean = x.mean(-1, keepdim=True)
        return out, (x, w, mean, 1 / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps))
    cfg = tiny_config("BertForSequenceClassification")
    x = model_batch(cfg, "BertForSequenceClassification")
    ref = refbert.BertForSequenceClassification(cfg, seed=2, dtype=np.float64)
    ref_out, ref_g = ref(**x), ref.backward()
    for fns in ({"softmax_backward": softmax_backward}, {"layernorm_forward": layernorm_forward}):
        mod = types.SimpleNamespace(**fns)
        m = refbert.BertForSequenceClassification(cfg, seed=2, dtype=np.float64, backend=mod)
        out, g = m(**x), m.backward()
        assert abs(float(out.loss) - float(ref_out.loss)) <= 1e-12 * abs(float(ref_out.loss))
        for k in ref_g:   # float64 rounding in another order: relative to the largest gradient
            assert np.abs(g[k] - ref_g[k]).max() <= 1e-12 * max(np.abs(v).max() for v in ref_g.values()), k
        assert m.ops.ops_of("own") == [next(iter(fns)).rsplit("_", 1)[0]]


def test_backend_from_a_path_and_its_errors(tmp_path, capsys):
    good = tmp_path / "mine.py"
    good.write_text("from refbert.ops import layernorm_forward as _f, layernorm_backward as _b\n"
                    "def layernorm_forward(x, w, b, eps=1e-12):\n    return _f(x, w, b, eps)\n"
                    "def layernorm_backward(dout, cache):\n    return _b(dout, cache)\n")
    B = get_backend(str(good))
    assert B.origin["layernorm_forward"] == "own" and B.ops_of("own") == ["layernorm"]
    model = refbert.BertModel(refbert.BertConfig.preset("tiny"), backend=str(good))
    assert model.ops.ops_of("own") == ["layernorm"]
    model.save_pretrained(tmp_path / "ckpt")
    loaded = refbert.BertModel.from_pretrained(tmp_path / "ckpt", backend=str(good))
    assert loaded.ops.ops_of("own") == ["layernorm"]
    from refbert.cli import main                       # --backend FILE on a command: one line says what is yours
    assert main(["trace", "--backend", str(good)]) == 0
    assert "own ops: layernorm" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected a .py file, got nothing"):
        get_backend(str(tmp_path / "missing.py"))
    txt = tmp_path / "mine.txt"                        # a Python file under another name: refused by name
    txt.write_text(good.read_text())
    with pytest.raises(ValueError, match="mine.txt' expected a .py file, got a file whose name does not end in .py"):
        get_backend(str(txt))
    bad = tmp_path / "broken.py"
    bad.write_text("def layernorm_forward(:\n")
    with pytest.raises(ValueError, match="broken.py' could not be loaded: SyntaxError"):
        get_backend(str(bad))
    with pytest.raises(ValueError, match="backend: expected one of 'numpy', 'numba', 'cuda', got 'tpu'"):
        get_backend("tpu")


def test_numba_and_numpy_backends_are_instances_of_the_mechanism():
    B = get_backend("numpy")
    assert isinstance(B, Backend) and B.ops_of("own") == [] and B.residual_layernorm_forward is \
        ops.residual_layernorm_forward
    pytest.importorskip("numba")
    N = get_backend("numba")
    assert set(N.ops_of("own")) == set(N.KERNELS) and N.tanh_forward is ops.tanh_forward   # tanh: no kernel


# ----------------------------------------------------------------------------------------------------------------
# refbert check --ops FILE [--model]

def _cli(capsys, *args):
    """refbert's command line, in this process: (exit status, stdout, stderr)."""
    from refbert.cli import main
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_check_ops_torch_file_passes_ops_and_model(tmp_path, torch, capsys):
    """The PyTorch-written ops: every op and dtype, then the whole model on them (float32 and float64)."""
    out = tmp_path / "report.json"
    r = _cli(capsys, "check", "--ops", f"{DATA}/torch_ops.py", "--model", "--examples", "1", "--no-bench", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    text = r.stdout
    assert "arrays: torch (declared)" in text
    for op in ("linear", "layernorm", "softmax", "gelu", "dropout", "attention", "cross_entropy"):
        assert f"\n{op} " in text
    assert "composed from its own: bias_gelu (from gelu), dropout_residual_layernorm (from dropout, layernorm), " \
           "residual_layernorm (from layernorm)" in text
    assert text.count("BertForPreTraining ") == 4 and text.count("BertForSequenceClassification ") == 4
    rep = json.loads(out.read_text())
    assert len(rep["model"]["runs"]) == 8 and all(run["ok"] for run in rep["model"]["runs"])
    assert "FAIL" not in text


def test_check_ops_exit_codes(tmp_path, capsys):
    bad = tmp_path / "bad_ops.py"
    bad.write_text("from refbert import ops\n"
                   "def dropout_backward(dout, cache):\n"
                   "    keep, scale, shape, dtype = cache\n"
                   "    return dout.copy() if keep is None else dout * keep   # no 1/(1-p)\n")
    r = _cli(capsys, "check", "--ops", str(bad), "--examples", "1", "--no-bench", "--dtypes", "float32")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL dropout dx (float32)" in r.stdout and "= 1 - p (p = 0.3)" in r.stdout
    empty = tmp_path / "nothing.py"
    empty.write_text("x = 1\n")
    for path, msg in ((empty, "defines no op"), (tmp_path / "missing.py", "expected a .py file, got nothing"),
                      ("no_such_module_xyz", "expected a .py file or an importable module")):
        r = _cli(capsys, "check", "--ops", str(path))
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _cli(capsys, "check", "--model")
    assert r.returncode == 2 and "--model expected --ops FILE" in r.stderr


def test_check_ops_times_what_passes(tmp_path, capsys):
    f = tmp_path / "tanh_ops.py"
    f.write_text("from refbert.ops import tanh_forward, tanh_backward as _b\n"
                 "def tanh_backward(dout, cache):\n    return _b(dout, cache)\n")
    r = _cli(capsys, "check", "--ops", str(f), "--examples", "1", "--dtypes", "float32")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "timing, float32, forward + backward" in r.stdout and "copy bandwidth" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("tanh ") and "shape=" in line)
    assert len(row.split()) >= 8, row


def test_bench_op_writes_md_json_png(tmp_path):
    f, b = oracle_pair("layernorm")
    rep = T.bench_op("layernorm", f, b, shapes=[dict(lead=(64,), C=32)], repeats=2, rounds=1, min_time=0.0,
                     bandwidth=1e10)
    impls = [r["impl"] for r in rep.entries[0]["rows"]]
    assert "yours" in impls and "numpy oracle" in impls and rep.entries[0]["validation"] == "pass"
    paths = rep.save(tmp_path)
    assert paths[0].endswith("layernorm.md") and "| yours |" in open(paths[0]).read()
    assert json.loads(open(paths[1]).read())["op"] == "layernorm"
    wrong = T.bench_op("layernorm", f, lambda d, c: tuple(2 * g for g in b(d, c)), shapes=[dict(lead=(8,), C=4)],
                       repeats=1, rounds=1, min_time=0.0, bandwidth=1e10)
    assert wrong.entries[0]["validation"].startswith("FAIL") and \
        "yours" not in [r["impl"] for r in wrong.entries[0]["rows"]]


@pytest.mark.skipif(__import__("importlib").util.find_spec("numba_cuda") is None, reason="needs numba-cuda")
def test_a_cuda_kernel_op_in_the_simulator():
    """tests/data/cuda_layernorm_ops.py: Numba CUDA kernels launched CuPy-style, in Numba's CUDA simulator, through
    check --ops and --model (the model's residual LayerNorms composed from it)."""
    r = cudachild.run("""
    import sys
    from refbert.cli import main
    sys.exit(main(["check", "--ops", "tests/data/cuda_layernorm_ops.py", "--model", "--examples", "1",
                   "--no-bench", "--dtypes", "float32"]))
    """, sim=True, timeout=600)
    out = cudachild.check(r)
    assert "composed from its own: dropout_residual_layernorm (from layernorm), residual_layernorm (from layernorm)" \
        in out and "layernorm  dx" in out and "0 failed" in out, out


def test_noise_parts_gelu_one_element_is_its_conditioning():
    """noise_parts on GELU's one-element case, x = -10, from math: GELU(x) = x Phi(x), so a relative move dx / x
    moves it by (1 + x phi(x) / Phi(x)) dx / x (phi / Phi at -10 by erfc in float64: about -99.98 all told). A 1-ulp
    move of x = -10 in float32 is 2^-20 (relative 2^-20 / 10), so the exact result moves by |that factor| x 0.8 ulps
    of float32 at its scale: about 80, the README's figure. Both moves of the one element (+1 and -1 ulp) agree to
    second order (8e-6 relative here); 1e-4 relative allowed. The oracle's own float32 error is a fraction of an ulp
    (float32 erfc's accuracy: within 1 ulp)."""
    case = T.edge_cases("gelu")[0]
    xd, _ = T.build(T.SPECS["gelu"], case, np.float32)
    assert case.label == "one element" and xd["x"].tolist() == [-10.0]
    x = -10.0
    phi, Phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi), 0.5 * math.erfc(-x / math.sqrt(2))
    factor = abs(1 + x * phi / Phi)
    want = factor * (2.0 ** -20 / abs(x)) / 2.0 ** -23
    own, moved = T.noise_parts(T.SPECS["gelu"], case)["out"]
    assert abs(moved - want) <= 1e-4 * want, (moved, want)
    assert 0 <= own <= 1, own
    assert T.noise(T.SPECS["gelu"], case)["out"] == max(own, moved)


# ----------------------------------------------------------------------------------------------------------------
# the rules of the module docstring, by hand: tolerance, ulps, the verdict, the report, the timer

def test_tolerance_is_the_documented_formula():
    """tolerance = max(FACTOR x the largest finite yardstick, FLOOR_ULPS) = max(8 x noise, 16): the floor alone with
    no yardstick or a small one, 8 x noise above it; a non-finite yardstick (PyTorch's NaN or inf) sets nothing."""
    assert (T.FACTOR, T.FLOOR_ULPS) == (8, 16)
    assert T.tolerance(None) == 16 and T.tolerance() == 16
    assert T.tolerance(1.0) == 16                      # 8 x 1 under the floor
    assert T.tolerance(3.0) == 24                      # 8 x 3 above it (not 8 x 3 + 16)
    assert T.tolerance(3.0, 1.0) == 24 and T.tolerance(None, 5.0) == 40
    assert T.tolerance(1.0, math.inf) == 16 and T.tolerance(3.0, math.nan) == 24 and T.tolerance(None, math.inf) == 16


def test_ulps_by_hand_in_float32():
    """ulps = max|got - ref| / (eps * max|ref|) over ref's finite entries, eps = 2^-23: 1 + 2^-22 against 1 is 2 ulps.
    A nonzero tensor (max|ref| = 1 > eps x sibling = 1.2e-4) keeps its own scale; the max, not the mean, of the
    differences; an infinity in ref (matched) does not enter the scale: 0.5 / (2^-23 x 1) = 2^22."""
    f32 = np.float32
    assert T.ulps(np.array([1 + 2 ** -22]), np.array([1.0]), f32, sibling=1e3) == 2.0
    assert T.ulps(np.array([1.0, 1 + 2 ** -22]), np.array([1.0, 1.0]), f32) == 2.0
    assert T.ulps(np.array([1.5, np.inf]), np.array([1.0, np.inf]), f32) == 2.0 ** 22


def test_a_forward_off_by_forty_ulps_fails_and_four_passes():
    """add on normal inputs: noise ~1 ulp, so the tolerance is the floor, 16 ulps (8 x noise below it). A forward
    scaled by 1 + 40 eps is ~40 ulps off (a few times over the floor, well under 10 x it) and fails; by 1 + 4 eps,
    ~4 ulps, it passes."""
    f = ops.add_forward

    def scaled(k):
        return lambda a, b: (lambda o: (o[0] * np.float32(1 + k * 2 ** -23), o[1]))(f(a, b))
    bad = T.check_op("add", scaled(40), cases=[dict(shape=(2, 3, 4))])
    (row,) = bad.rows
    assert not bad.passed and row["tolerance"] == 16 and 35 < row["ulps"] < 45, str(bad)
    assert T.check_op("add", scaled(4), cases=[dict(shape=(2, 3, 4))]).passed


def test_extra_gradients_written_dout_and_no_cases_fail():
    """Four gradients from linear's backward (three expected) fail with the count; a backward that scales dout in
    place is caught writing into dout; a check with no cases proves nothing and is not passed."""
    lin = [dict(lead=(3,), C_in=4, C_out=5)]
    rep = T.check_op("linear", backward=lambda d, c: (*ops.linear_backward(d, c), np.zeros(1, np.float32)), cases=lin)
    assert not rep.passed and "backward returned 4 gradient(s), expected 3 (dx, dw, db)" in str(rep), str(rep)
    f, b = oracle_pair("tanh")

    def scaling_dout(dout, cache):
        dx = b(dout.copy(), cache)
        dout *= 2
        return dx
    rep = T.check_op("tanh", backward=scaling_dout, cases=[dict(shape=(3, 7))])
    assert not rep.passed and "wrote into its argument(s) dout" in str(rep), str(rep)
    assert not T.check_op("tanh", f, b, cases=[]).passed


def test_the_table_row_shows_the_worst_case_and_fail():
    """tanh's backward doubled only on the second case: the dx row is that case (the worst of the two, by error /
    tolerance), its error over its tolerance, and the table's row for dx ends in FAIL."""
    f, b = oracle_pair("tanh")

    def wrong_on_2x5(dout, cache):
        dx = b(dout, cache)
        return dx * 2 if dx.shape == (2, 5) else dx
    rep = T.check_op("tanh", backward=wrong_on_2x5, cases=[dict(shape=(3, 7)), dict(shape=(2, 5))])
    (row,) = rep.rows
    assert row["tensor"] == "dx" and row["worst_case"] == "case #2" and row["ulps"] > row["tolerance"], row
    assert row["failed"] == 1 and not row["ok"]
    table = [line for line in str(rep).splitlines() if line.split()[:2] == ["tanh", "dx"]]
    assert len(table) == 1 and table[0].rstrip().endswith("FAIL"), str(rep)


def test_time_call_takes_the_median_and_runs_min_time(monkeypatch):
    """A stubbed clock: each call of fn advances it by a set time. Calls of 1, 9, 2 s (after a warm-up) have median
    2 (min 1, mean 4); with 1 s calls, repeats=3 and min_time=10, calls go on until 10 s are spent: 10 timed calls."""
    now = [0.0]
    monkeypatch.setattr(T, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def clocked(durations):
        it = iter(durations)
        calls = []

        def fn():
            calls.append(1)
            now[0] += next(it)
        return fn, calls
    fn, calls = clocked([100.0, 1.0, 9.0, 2.0])
    assert T.time_call(fn, repeats=3, min_time=0.0) == 2.0 and len(calls) == 4
    fn, calls = clocked([1.0] * 50)
    assert T.time_call(fn, repeats=3, min_time=10.0) == 1.0 and len(calls) == 1 + 10


# ----------------------------------------------------------------------------------------------------------------
# what the harness promises and no other test would notice missing: the non-contiguous input, the noise's worst
# sample, the bench's arithmetic, --model rejecting a wrong op

def test_every_non_contiguous_edge_case_is_a_strided_view_of_the_same_values():
    """Every op whose spec names an input for its "non-contiguous" edge case gets that input as a strided view
    (not C-contiguous, strides other than the packed ones) holding the values the contiguous build holds. (Found
    gather_rows' case built contiguous: its spec named no input.)"""
    seen = 0
    for op in T.OPS:
        spec = T.SPECS[op]
        for case in T.edge_cases(op):
            if not case.params.get("noncontig"):
                continue
            seen += 1
            assert spec.noncontig is not None, f"{op}: a non-contiguous case with no input named to make so"
            xd, _ = T.build(spec, case, np.float32)
            plain = dict(case.params, noncontig=False)
            ref, _ = T.build(spec, T.Case(case.label, plain, seed=case.seed), np.float32)
            x = xd[spec.noncontig]
            assert not x.flags.c_contiguous and x.strides[-1] == 2 * x.itemsize, (op, x.strides)
            assert np.array_equal(x, ref[spec.noncontig]), op
    assert seen == sum(T.SPECS[op].noncontig is not None for op in T.OPS) >= 15


def test_a_forward_that_assumes_packed_memory_fails_the_non_contiguous_case_only():
    """tanh's forward reading x's buffer as if it were packed (as a C kernel handed x.data would): right on every
    contiguous case, wrong on the strided one (every second element it reads is the gap's zero), and the report
    names that case."""
    def packed_tanh(x):
        flat = np.lib.stride_tricks.as_strided(x, shape=(x.size,), strides=(x.itemsize,))
        out, cache = ops.tanh_forward(x)
        return np.tanh(flat).reshape(x.shape), cache
    rep = T.check_op("tanh", packed_tanh, examples=0)
    failed = [c.label for c in rep.cases if not c.ok]
    assert failed == ["non-contiguous x"], [(c.label, c.ok) for c in rep.cases]


def test_noise_takes_the_worst_of_the_samples():
    """noise_parts' own = the largest float32-against-float64 error over the SAMPLES inputs (as given, then moved by
    +-1 ulp with the seeds 1001, 1002): recomputed here sample by sample. The case is one where the largest is not
    the last sample's, so a noise read off one sample only would differ."""
    spec = T.SPECS["gelu"]
    case = T.Case("drawn", dict(shape=(5, 7), approximate="none"), seed=3)
    xd, kw = T.build(spec, case, np.float32)
    per_sample = []
    for s in range(T.SAMPLES):
        x = xd
        if s:
            r = np.random.default_rng(1000 + s)
            x = {k: np.where(r.random(v.shape) < 0.5, np.nextafter(v, np.float32(np.inf)),
                             np.nextafter(v, np.float32(-np.inf))).astype(np.float32) for k, v in xd.items()}
        o32, g32, _ = T.run_oracle("gelu", x, kw, case.seed)
        o64, g64, _ = T.run_oracle("gelu", {k: v.astype(np.float64) for k, v in x.items()}, kw, case.seed)
        per_sample.append({"out": T.ulps(o32, o64, np.float32), "dx": T.ulps(g32["dx"], g64["dx"], np.float32,
                                                                             T.siblings("dx", g64))})
    T._NOISE.clear()
    parts = T.noise_parts(spec, case)
    for name in ("out", "dx"):
        errs = [p[name] for p in per_sample]
        assert parts[name][0] == max(errs), (name, errs, parts[name])
    assert any(max(p[n] for p in per_sample) > per_sample[-1][n] for n in ("out", "dx")), per_sample


def test_bench_rows_are_medians_over_rounds_and_bytes_by_hand(monkeypatch):
    """bench_op's arithmetic with a stubbed timer: each impl's fwd+bwd and fwd times are the median over the rounds
    (4, 4, 1 -> 4, not the mean 3; 1, 5, 6 -> 5, not 4); bytes by hand for layernorm (lead 64, C 32, float32):
    x, w, b read, out written, dout read, dx, dw, db written = 4 (2112 + 2048 + 2048 + 2112) = 33280;
    GB/s = bytes / fwd+bwd / 1e9, % of copy = 100 x bytes / fwd+bwd / bandwidth; x numpy and x pytorch the ratios of
    the medians."""
    f, b = oracle_pair("layernorm")
    # calls per round, in order: numpy oracle (both, fwd), pytorch (both, fwd), yours (both, fwd)
    times = {"numpy oracle": ([3.0, 1.0, 2.0], [1.0, 5.0, 6.0]), "pytorch": ([4.0, 4.0, 1.0], [2.0, 2.0, 2.0]),
             "yours": ([0.5, 1.0, 0.25], [0.5, 0.1, 0.2])}
    seq = iter([times[k][j][r] for r in range(3) for k in times for j in (0, 1)])
    monkeypatch.setattr(T, "time_call", lambda fn, repeats, min_time: next(seq))
    monkeypatch.setattr(T, "_torch_calls", lambda spec, xd, kw, backward=True: (lambda: None, lambda: None))
    rep = T.bench_op("layernorm", f, b, shapes=[dict(lead=(64,), C=32)], rounds=3, bandwidth=1e10)
    (e,) = rep.entries
    assert e["nbytes"] == 4 * (2112 + 2048 + 2048 + 2112) == 33280
    rows = {r["impl"]: r for r in e["rows"]}
    assert list(rows) == list(times)
    med = {"numpy oracle": (2.0, 5.0), "pytorch": (4.0, 2.0), "yours": (0.5, 0.2)}
    for k, (both, fwd) in med.items():
        r = rows[k]
        assert (r["fwd_bwd_s"], r["fwd_s"]) == (both, fwd), (k, r)
        assert r["GBps"] == pytest.approx(33280 / both / 1e9, rel=1e-12)
        assert r["pct_copy"] == pytest.approx(100 * 33280 / both / 1e10, rel=1e-12)
        assert r["x_numpy"] == pytest.approx(2.0 / both, rel=1e-12)
        assert r["x_pytorch"] == pytest.approx(4.0 / both, rel=1e-12)


def test_check_model_ops_fails_a_wrong_layernorm_and_judges_by_its_noise(monkeypatch):
    """--model on a module whose layernorm forward is off by a factor 1 + 2^-12 (about 2^11 float32 ulps; in
    float64, 2^40): every run fails, its first failure is the embeddings' LayerNorm (the first op it touches), every
    row passes exactly when its error is within its tolerance, and the tolerance is the documented formula on the
    noise: with the noise stubbed at 5 ulps for every tensor, max(8 x 5, 16) = 40 ulps of the run's dtype."""
    real = T._model_noise
    monkeypatch.setattr(T, "_model_noise", lambda *a: {k: 5.0 for k in real(*a)})
    mod = types.SimpleNamespace(
        layernorm_forward=lambda x, w, b, eps=1e-12: (lambda o: (o[0] * (1 + 2.0 ** -12), o[1]))(
            ops.layernorm_forward(x, w, b, eps)),
        layernorm_backward=ops.layernorm_backward)
    _, runs = T.check_model_ops(mod, heads=("BertForSequenceClassification",),
                                configs={"tiny": T.model_configs()["tiny"]})
    assert [r["dtype"] for r in runs] == ["float32", "float64"]
    for run in runs:
        eps = T.EPS[run["dtype"]]
        assert not run["ok"] and run["error"] is None
        assert "embeddings" in run["first_failure"]["where"], run["first_failure"]
        for row in run["rows"]:
            assert row["tolerance"] == 40 * eps, row
            assert row["ok"] == (row["error"] <= row["tolerance"]), row
        assert sum(not row["ok"] for row in run["rows"]) > len(run["rows"]) // 2
