"""Which version of each op the cuda backend runs (kernels/cuda/versions.py) and how a fallback is reported
(kernels/cuda/backend.py): README "On the GPU", "Which version runs".

Most of versions.py is host logic that runs without a GPU: these tests import it in the pytest process (as
tests/test_cuda_backend_sim.py's order test does; the real numba.cuda, no kernel launched) and set its MODE to the
device under test where that decides ("gpu": CUDA C takes its dtypes and head sizes; "emu": float32 CUDA C only;
"sim": none). The state (pins, choices, demotions, fallbacks, the measured-order cache) is put back after each test.
What needs the backend itself runs in a child: the simulator (a kernel module that does not import) and the
emulator (attention's head size reaching the choice).
"""
import functools
import importlib.util
import json
import shutil
import sys
import textwrap

import pytest

import cudachild

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs numba-cuda")]

_run = functools.partial(cudachild.run, timeout=600)
ENV = ("REFBERT_CUDA_VERSIONS", "REFBERT_CUDA_ORDER", "REFBERT_CUDA_VALIDATE")


@pytest.fixture
def VV(monkeypatch):
    """refbert_kernels.cuda.versions with no pin, no measured order, nothing chosen; everything put back after."""
    from refbert_kernels.cuda import cuda_c as K, versions as VV
    VV.versions()
    dicts = [VV.CHOSEN, VV.DEMOTED, VV.RAN, VV.PINS, VV.IMPORT_ERRORS, VV._ORDER_CACHE, K.FELL_BACK,
             K.LAUNCH_FELL_BACK]
    saved = [dict(d) for d in dicts]
    had = VV.MODE, VV.XP, VV._VERSIONS
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    VV.reset()
    K.FELL_BACK.clear()
    K.LAUNCH_FELL_BACK.clear()
    yield VV
    for d, s in zip(dicts, saved):
        d.clear()
        d.update(s)
    VV.MODE, VV.XP, VV._VERSIONS = had


def keys(cands):
    return [v.key for v in cands[0]]


def numba_keys(VV, op):
    """op's Numba and array-library versions in the built-in order (what the simulator can run)."""
    return [k for k in VV.ORDER[op] if not k.startswith("C")]


# ----------------------------------------------------------------------------------------------------------------
# pins: REFBERT_CUDA_VERSIONS and versions.pin

def test_env_pins_are_read_per_op_and_dtype(VV, monkeypatch):
    monkeypatch.setenv("REFBERT_CUDA_VERSIONS", " layernorm = 1 , attention:float16=v3,softmax=2,softmax:float64=1,")
    VV.reset()
    assert VV.PINS == {("layernorm", None): "1", ("attention", "float16"): "3", ("softmax", None): "2",
                       ("softmax", "float64"): "1"}, VV.PINS
    assert VV.order("layernorm", "float32") == ([VV.versions()["layernorm"][-1]], "pinned")
    assert keys(VV.order("attention", "float16")) == ["3"]
    assert VV.order("attention", "float32")[1] == "built in"             # a float16 pin: float16 alone
    # the dtype's own pin before the every-dtype one, whichever comes first in the variable
    assert keys(VV.order("softmax", "float64")) == ["1"] and keys(VV.order("softmax", "float32")) == ["2"]
    line = next(x for x in VV.describe() if x.split()[0] == "attention")
    assert "pinned float16=3 (not validated)" in line and "every dtype" not in line, line


@pytest.mark.parametrize("value, says", [
    ("nope=1", "expected an op among softmax"),                          # a misspelt op
    ("layernorm", "expected op=version or op:dtype=version, got 'layernorm'"),
    ("layernorm=C9", "layernorm has no version 'C9' here"),              # was accepted, a KeyError at the first call
    ("layernorm=", "layernorm has no version '' here"),
    ("layernorm:int32=1", "expected a dtype among float32"),             # was accepted: a pin that never applies
    ("layernorm:float33=1", "expected a dtype among float32"),           # was NumPy's TypeError, naming nothing
])
def test_a_bad_env_pin_is_refused_naming_the_variable(VV, monkeypatch, value, says):
    monkeypatch.setenv("REFBERT_CUDA_VERSIONS", value)
    with pytest.raises(ValueError, match="^REFBERT_CUDA_VERSIONS: ") as e:
        VV.reset()
    assert says in str(e.value), str(e.value)


def test_pin_for_one_dtype_a_late_pin_and_unpin(VV, monkeypatch):
    """versions.pin: a dtype's pin applies to that dtype alone; a pin after the op's first call applies from the
    next call (the choice is made again); pin(op, None) puts the order back; a pin for a dtype the backend never
    stores is refused (it would never apply)."""
    monkeypatch.setenv("REFBERT_CUDA_VALIDATE", "0")
    first = numba_keys(VV, "gelu")[0]                        # the simulator's first (no CUDA C there)
    other = numba_keys(VV, "gelu")[-1]
    assert first != other
    assert VV.choose("gelu", "float32").key == first
    VV.pin("gelu", other, dtype="float64")
    assert VV.choose("gelu", "float32").key == first and VV.choose("gelu", "float64").key == other
    assert "pinned float64=" + other in next(x for x in VV.describe() if x.split()[0] == "gelu")
    VV.pin("gelu", other)                                    # after gelu float32's first call
    assert VV.choose("gelu", "float32").key == other
    VV.pin("gelu", None)
    VV.pin("gelu", None, dtype="float64")
    assert VV.choose("gelu", "float32").key == first and VV.choose("gelu", "float64").key == first
    assert not VV.PINS
    with pytest.raises(ValueError, match="^pin: expected a dtype among"):
        VV.pin("gelu", other, dtype="int64")


def test_reset_reads_the_pins_again_and_forgets_the_choices(VV, monkeypatch):
    monkeypatch.setenv("REFBERT_CUDA_VALIDATE", "0")
    first, other = numba_keys(VV, "softmax")[0], numba_keys(VV, "softmax")[-1]
    assert VV.choose("softmax", "float32").key == first
    monkeypatch.setenv("REFBERT_CUDA_VERSIONS", f"softmax={other}")
    VV.reset()
    assert VV.choose("softmax", "float32").key == other


def test_a_pin_is_not_validated_and_an_unpinned_choice_is(VV, monkeypatch):
    """With validation on, a pinned version runs even where validation would demote it (A/B runs, the precision
    study); without the pin the same failing version is demoted, warned and recorded."""
    monkeypatch.setenv("REFBERT_CUDA_VALIDATE", "1")
    first, second = numba_keys(VV, "gelu")[:2]
    seen = []

    def validate(v, dt):
        seen.append(v.key)
        return (float("inf"), "wrong") if v.key == first else (0.0, None)
    monkeypatch.setattr(VV, "validate", validate)
    VV.pin("gelu", first)
    assert VV.choose("gelu", "float32").key == first and seen == [] and not VV.DEMOTED
    VV.pin("gelu", None)
    with pytest.warns(RuntimeWarning, match=f"gelu float32 version {first} failed validation"):
        assert VV.choose("gelu", "float32").key == second
    assert seen == [first, second] and VV.DEMOTED == {("gelu", "float32"): [(first, "wrong")]}


def test_validation_at_first_use_on_a_gpu_unless_turned_off(VV, monkeypatch):
    assert VV.validate_first_use() is False                  # the simulator: its tests validate every version
    monkeypatch.setattr(VV, "MODE", "gpu")
    assert VV.validate_first_use() is True
    for value, on in (("0", False), ("", False), ("1", True)):
        monkeypatch.setenv("REFBERT_CUDA_VALIDATE", value)
        assert VV.validate_first_use() is on, value
    monkeypatch.setattr(VV, "MODE", "sim")
    assert VV.validate_first_use() is True


# ----------------------------------------------------------------------------------------------------------------
# which versions a device takes: dtypes and attention's head size

def test_head_size_and_dtype_decide_the_candidates(VV, monkeypatch):
    """On a GPU a CUDA C version is a candidate only for the dtypes and head sizes it has kernels for, and the
    choice is made per head size (one chosen at head size 64 must not run a call at 32); the emulator runs float32
    CUDA C alone (no 16-bit storage), the simulator none."""
    monkeypatch.setenv("REFBERT_CUDA_VALIDATE", "0")
    monkeypatch.setattr(VV, "MODE", "gpu")
    vs = VV.versions()["attention"]

    def expected(dt, var):
        return next(v.key for v in vs if (v.dtypes is None or dt in v.dtypes)
                    and (v.variants is None or var in v.variants))
    for dt in ("float16", "float32"):
        k64, k32 = expected(dt, "hs64"), expected(dt, "hs32")
        assert k64 != k32, (dt, k64, k32)                    # (else this test could not see a shared choice)
        assert VV.choose("attention", dt, "hs64").key == k64
        assert VV.choose("attention", dt, "hs32").key == k32
    c16 = [v for v in vs if v.cuda_c and v.dtypes == ("float16",)]
    c32 = [v for v in vs if v.cuda_c and "float32" in v.dtypes]
    assert c16 and c32
    monkeypatch.setattr(VV, "MODE", "emu")
    assert not any(VV.takes(v, "float16") for v in vs if v.cuda_c)
    assert all(VV.takes(v, "float32") for v in c32)
    monkeypatch.setattr(VV, "MODE", "sim")
    assert not any(VV.takes(v, dt) for v in vs if v.cuda_c for dt in ("float16", "float32"))


# ----------------------------------------------------------------------------------------------------------------
# the measured order (REFBERT_CUDA_ORDER, written by the bench)

def test_measured_order_skips_what_this_device_cannot_run_and_keeps_the_rest(VV, monkeypatch, tmp_path):
    """The measured keys first (a CUDA C one skipped in the simulator, a key this build no longer has ignored),
    then the versions it did not rank, in the built-in order: a version missing from the file stays a candidate."""
    path = tmp_path / "order.json"
    VV.write_order(str(path), VV.device_name(), {("gelu", "float32"): {"C1": 1e-6, "C9": 2e-6, "1": 3e-6}})
    monkeypatch.setenv("REFBERT_CUDA_ORDER", str(path))
    rest = [k for k in numba_keys(VV, "gelu") if k != "1"]
    assert rest
    assert VV.order("gelu", "float32") == ([VV.versions()["gelu"][[v.key for v in VV.versions()["gelu"]].index(k)]
                                            for k in ["1", *rest]], "measured")
    assert VV.order("gelu", "float64")[1] == "built in"       # measured for float32 alone


def test_measured_order_of_another_device_is_not_used_and_says_so(VV, monkeypatch, tmp_path):
    path = tmp_path / "order.json"
    VV.write_order(str(path), "Some Other GPU", {("gelu", "float32"): {"1": 1e-6}})
    monkeypatch.setenv("REFBERT_CUDA_ORDER", str(path))
    with pytest.warns(RuntimeWarning, match="was measured on 'Some Other GPU'.*the built-in order is used"):
        assert VV.order("gelu", "float32")[1] == "built in"


def test_measured_order_follows_the_file_and_the_variable(VV, monkeypatch, tmp_path):
    """The bench writes cuda_order.json, sets REFBERT_CUDA_ORDER and forgets the choices for its later sections: the
    next choice reads the order as written then (a second bench run in one process rewrites the same file), and
    another file named by the variable is read."""
    monkeypatch.setenv("REFBERT_CUDA_VALIDATE", "0")
    a, b = numba_keys(VV, "gelu")[:2]
    path, other = tmp_path / "cuda_order.json", tmp_path / "other.json"
    dev = VV.device_name()
    VV.write_order(str(path), dev, {("gelu", "float32"): {b: 1e-6, a: 2e-6}})
    monkeypatch.setenv("REFBERT_CUDA_ORDER", str(path))
    assert VV.choose("gelu", "float32").key == b
    VV.write_order(str(path), dev, {("gelu", "float32"): {a: 1e-6, b: 2e-6}})
    VV.CHOSEN.clear()                                        # (as the bench does)
    assert VV.choose("gelu", "float32").key == a
    VV.write_order(str(other), dev, {("gelu", "float32"): {b: 1e-6}})
    monkeypatch.setenv("REFBERT_CUDA_ORDER", str(other))
    VV.CHOSEN.clear()
    assert VV.choose("gelu", "float32").key == b
    data = json.loads(other.read_text())                     # a file written by another process: reset() reads it
    data["orders"]["gelu"]["float32"] = [a]
    other.write_text(json.dumps(data))
    VV.reset()
    assert VV.choose("gelu", "float32").key == a


# ----------------------------------------------------------------------------------------------------------------
# reporting: problems() and describe()

def test_every_fallback_is_a_problem_and_a_describe_line(VV, monkeypatch):
    """A CUDA C call handed to Numba (cuda_c.FELL_BACK: host arrays count on a GPU or the emulator, not in the
    simulator, where every array is a host array), a kernel module that did not import, a demotion."""
    from refbert_kernels.cuda import cuda_c as K
    K.FELL_BACK[("gelu", "C1")] = "dtype float64 (the CUDA C kernels take float32)"
    K.FELL_BACK[("softmax", "C2")] = "host (NumPy) arrays"
    VV.IMPORT_ERRORS["dropout"] = "ImportError: broken"
    VV.DEMOTED[("layernorm", "float32")] = [("C4", "err/tol 3 > 1 against the oracle")]
    want = {("gelu", "C1 took the Numba kernel (dtype float64 (the CUDA C kernels take float32))"),
            ("softmax", "C2 took the Numba kernel (host (NumPy) arrays)"),
            ("dropout", "refbert_kernels.cuda.dropout did not import: ImportError: broken"),
            ("layernorm", "float32: version C4 demoted (err/tol 3 > 1 against the oracle)")}
    for mode in ("gpu", "emu", "sim"):
        monkeypatch.setattr(VV, "MODE", mode)
        got = want - {("softmax", "C2 took the Numba kernel (host (NumPy) arrays)")} if mode == "sim" else want
        assert set(VV.problems()) == got, (mode, VV.problems())
        lines = VV.describe()
        for op, why in got:
            assert f"  FALLBACK {op}: {why}" in lines, (mode, op, lines)


def test_a_kernel_module_that_does_not_import_is_recorded(VV, monkeypatch):
    """_build records the error and gives the op no version (not even its CUDA C ones, whose launchers hand calls
    to that module's kernels), so that the backend runs the oracle for it and says so."""
    monkeypatch.setitem(sys.modules, "refbert_kernels.cuda.gelu", None)
    VV.IMPORT_ERRORS.clear()
    vs = VV._build()
    assert "gelu" in VV.IMPORT_ERRORS and "None in sys.modules" in VV.IMPORT_ERRORS["gelu"], VV.IMPORT_ERRORS
    assert vs["gelu"] == [] and vs["bias_gelu"] == [], (vs["gelu"], vs["bias_gelu"])
    assert vs["softmax"] and vs["column_sum"]


_NO_GELU = """
import sys, warnings
sys.modules["refbert_kernels.cuda.gelu"] = None          # the gelu kernels fail to import
import numpy as np
from refbert import ops
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from refbert.model import get_backend
    B = get_backend("cuda")
from refbert_kernels.cuda import backend as BB
print("WARN", [str(w.message) for w in caught if "refbert cuda" in str(w.message)])
print("FALLBACKS", sorted(BB.FALLBACKS))
print(B.describe())
x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
out, _ = B.gelu_forward(x)
assert np.array_equal(out, ops.gelu_forward(x)[0])              # the oracle ran it (on host copies)
print("OK")
"""


def test_sim_a_kernel_module_that_does_not_import_falls_back_to_the_oracle_and_says_so():
    """README: a kernel module that fails to import leaves its ops undefined (FALLBACKS, warned when the backend is
    built), and the oracle runs them. (Before: gelu kept its CUDA C versions, no warning, and the simulator's first
    gelu call raised "no version of gelu takes float32 here".)"""
    out = cudachild.check(_run(textwrap.dedent(_NO_GELU)))
    assert "OK" in out, out
    assert "FALLBACKS ['bias_gelu', 'gelu']" in out, out
    warn = next(line for line in out.splitlines() if line.startswith("WARN"))
    assert "no kernel for gelu (refbert_kernels.cuda.gelu:" in warn and "oracle runs these" in warn, warn
    assert "FALLBACK  gelu: oracle on the host" in out and "FALLBACK  bias_gelu: oracle on the host" in out, out
    assert "FALLBACK gelu: refbert_kernels.cuda.gelu did not import" in out, out


_HS32 = """
import os
os.environ["REFBERT_CUDA_EMULATE"] = "1"
import numpy as np
from refbert_kernels.cuda import backend as B, versions as VV
assert B.MODE == "emu"
r = np.random.default_rng(0)
for hs in (64, 32):                                           # the same dtype, two head sizes, one after the other
    q, k, v = (B.to_device(r.standard_normal((1, 5, 2 * hs)).astype(np.float32)) for _ in range(3))
    out, cache = B.attention_forward(q, k, v, 2)
    B.attention_backward(B.to_device(np.ones((1, 5, 2 * hs), np.float32)), cache)
print("RAN", sorted(VV.RAN))
print("PROBLEMS", VV.problems())
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the CUDA C kernels on CPU threads)")
def test_emu_attention_chooses_per_head_size():
    """The backend hands attention's head size to the choice: at head size 32 a version with kernels for 32 runs,
    not the one chosen at 64 handing its call on (a fallback)."""
    import ast
    out = cudachild.check(_run(_HS32))
    ran = ast.literal_eval(next(x for x in out.splitlines() if x.startswith("RAN "))[4:])
    assert "PROBLEMS []" in out, out
    assert len(ran) == 2 and all(v.startswith("C") for _, _, v in ran), ran    # a CUDA C version at each


_PINNED_C2 = """
import os, warnings
os.environ["REFBERT_CUDA_EMULATE"] = "1"
os.environ["REFBERT_CUDA_VERSIONS"] = "attention=C2"       # tensor cores: float16 at head size 64 alone
import numpy as np
from refbert_kernels.cuda import backend as B, versions as VV
q = B.to_device(np.random.default_rng(0).standard_normal((1, 5, 128)).astype(np.float32))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, cache = B.attention_forward(q, q, q, 2)               # float32, head size 64: no C2 kernel for it
    B.attention_backward(out, cache)
print("RAN", sorted(VV.RAN))
print("WARN", [str(w.message) for w in caught])
print("PROBLEMS", VV.problems())
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the CUDA C kernels on CPU threads)")
def test_emu_a_pinned_version_without_kernels_for_the_call_says_so_in_the_forward():
    """A pin is not validated, but what ran must still be said: attention C2 pinned for a float32 call ran C1's
    forward kernel with no record (its backward recorded its own), now a fallback like the backward's."""
    out = cudachild.check(_run(_PINNED_C2))
    assert "RAN [('attention', 'float32', 'C2')]" in out, out
    assert "attention C2 forward took C1's kernel" in out, out
    assert "attention C2 backward took the scalar backward" in out, out
    problems = next(x for x in out.splitlines() if x.startswith("PROBLEMS "))
    assert "'attention'" in problems and "C2 forward took" in problems and "head size 64" in problems, problems
