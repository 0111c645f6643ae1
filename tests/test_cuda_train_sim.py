"""`refbert pretrain --backend cuda` end to end: in Numba's CUDA simulator on the CPU (CI), and on a real GPU when one
is present. The run is cut in two (--stop-after 1, then --resume), so that one test covers the training loop on
device arrays (metrics, logging, evaluation), checkpoints written from the device (model and AdamW moments as host
copies), and a resume that puts the moments back on the device. Its log must equal the numpy backend's uninterrupted
run of the same command:

    step, epoch, lr, mlm_acc, nsp_acc                  exactly
    loss, mlm_loss, nsp_loss (every step and the eval) |a - b| <= 1e-5 * |b| + 2e-6
    grad_norm                                          |a - b| <= 1e-5 * |b| + 2e-4

The kernels compute in float32 with sums in another order than the oracle's (tree / warp reductions, flash attention's
online softmax), so activations and gradients differ from the numpy backend's by ~1e-6 relative (the bound of
tests/test_cuda_backend_sim.py is 1e-5), and so does the parameter update that follows; the dropout masks are the
same Philox masks on both. The additive 2e-6 and 2e-4 are the log's rounding (6 and 4 decimals). The AdamW moments
of the final checkpoint are held to the same 1e-5, relative to each moment's largest magnitude over the model (a
gradient that is 0 in exact arithmetic, the key bias, is rounding noise on both sides), and so are the final model's
parameters, relative to each tensor's largest entry. Observed in the simulator: ~2e-7 (moments), ~6e-8
(parameters), the logged losses equal or 1e-6 apart.

The key bias is the exception: its gradient is rounding noise (~1e-14), different on the two backends, so its
value is not the oracle's. What AdamW can move it by is known, per step t and element (no weight decay: biases are
exempt), from the run's own moments in the checkpoint of that step:
    step_t = lr_t m_t / (1 - b1^t) / (sqrt(v_t / (1 - b2^t)) + eps)
A priori |step_t| <= lr_t whenever |m^_t| <= sqrt(v^_t) (at t = 1, m^ = g and v^ = g^2; at t = 2 the ratio is at
most 1.0014): two steps of lr 1e-3 and 5e-4 move it at most 1.5e-3 per run, so 3e-3 apart, and a bound of 4 lr
could not fail. But a noise gradient of ~1e-14 against eps = 1e-6 makes each step ~lr |g| / eps ~ 1e-11: so the test
holds each run's key bias to exactly its AdamW steps (step 1 from 0, HF's zero init; step 2 from step 1's value),
within float32 rounding, and the two runs' key biases to the sum of both runs' steps.

The model is tiny (hidden 16, 2 heads, 1 layer, intermediate 32, a ~60-token vocabulary, sequences of 8, batches of
2, 2 steps) because the simulator runs every GPU thread as a Python thread: ~10-30 s on 2 cores.
"""
import csv
import importlib.util
import inspect
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

import cudachild

pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from refbert import cli, safetensors_io  # noqa: E402
from refbert.config import BertConfig  # noqa: E402
from refbert.optim import AdamW  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_numba_cuda = pytest.mark.skipif(importlib.util.find_spec("numba") is None
                                      or importlib.util.find_spec("numba_cuda") is None,
                                      reason="needs numba and numba-cuda (pip install 'refbert[cuda]')")
RTOL = 1e-5
LR = 1e-3
EXACT = ("step", "epoch", "lr", "mlm_acc", "nsp_acc")
LOSSES = ("loss", "mlm_loss", "nsp_loss")


@pytest.fixture
def tiny(tmp_path):
    """A corpus of 8 short documents, its WordPiece vocabulary and a one-layer config."""
    words = "the cat dog sat ran on a mat big red sun hot day cold night sky blue".split()
    r = random.Random(0)
    docs = ["\n".join(" ".join(r.choice(words) for _ in range(r.randint(3, 4))) + "." for _ in range(3))
            for _ in range(8)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    assert cli.main(["vocab", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "tok"), "--vocab-size", "60"]) == 0
    n = len((tmp_path / "tok" / "vocab.txt").read_text().splitlines())
    BertConfig(vocab_size=n, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
               max_position_embeddings=8).to_json_file(str(tmp_path / "config.json"))
    return tmp_path


def _args(d, out, *extra):
    return ["pretrain", "--corpus", str(d / "corpus.txt"), "--vocab", str(d / "tok" / "vocab.txt"),
            "--config", str(d / "config.json"), "--max-seq-length", "8", "--batch-size", "2", "--steps", "2",
            "--lr", str(LR), "--save-every", "1", "--out", str(out), *extra]


def _cli(argv, sim):
    """cli.main(argv) in a child (the simulator must be on before numba.cuda is first imported); prints the
    backend's mode, the ops that fell back to the oracle, and every version demoted or handed to Numba."""
    code = (cudachild.PRELUDE +
            f"from refbert import cli\n"
            f"rc = cli.main({argv!r})\n"
            f"from refbert_kernels.cuda import backend, versions\n"
            f"print('MODE', backend.MODE, 'FALLBACKS', sorted(backend.FALLBACKS))\n"
            f"print('PROBLEMS', versions.problems())\n"
            f"sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cudachild.child_env(sim), capture_output=True,
                       text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(f"refbert {' '.join(argv)} failed (rc {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    assert f"MODE {'sim' if sim else 'gpu'} FALLBACKS []" in r.stdout, r.stdout
    assert "PROBLEMS []" in r.stdout, r.stdout              # no version demoted, no CUDA C call handed to Numba
    return r.stdout


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _close(a, b, atol, what):
    a, b = float(a), float(b)
    assert abs(a - b) <= RTOL * abs(b) + atol, f"{what}: {a} vs {b} (|diff| {abs(a - b):.2e})"


def _pretrain_cuda_equals_numpy(d, sim):
    ref, run = d / "numpy", d / "cuda"
    assert cli.main(_args(d, ref)) == 0                                       # the oracle, uninterrupted
    _cli(_args(d, run, "--backend", "cuda", "--stop-after", "1"), sim)        # "killed" after step 1
    assert json.load(open(run / "latest.json")) == {"checkpoint": "checkpoint-0000001"}
    _cli(_args(d, run, "--backend", "cuda", "--resume"), sim)                 # moments back onto the device
    got, want = _rows(run / "log.csv"), _rows(ref / "log.csv")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert {k: g[k] for k in EXACT} == {k: w[k] for k in EXACT}
        for k in LOSSES:
            _close(g[k], w[k], 2e-6, f"step {w['step']} {k}")
        _close(g["grad_norm"], w["grad_norm"], 2e-4, f"step {w['step']} grad_norm")
    got, want = _rows(run / "eval.csv"), _rows(ref / "eval.csv")
    assert len(got) == len(want) == 1 and got[0]["step"] == "2"
    for k in ("mlm_loss", "nsp_loss"):
        _close(got[0][k], want[0][k], 2e-6, f"eval {k}")
    # the last checkpoint: the same files, the same Philox position, moments within tolerance
    ck, ck_ref = run / "checkpoint-0000002", ref / "checkpoint-0000002"
    assert sorted(os.listdir(ck)) == sorted(os.listdir(ck_ref))
    st, st_ref = json.load(open(ck / "trainer_state.json")), json.load(open(ck_ref / "trainer_state.json"))
    assert st["dropout_rng"] == st_ref["dropout_rng"] and st["step"] == st_ref["step"] == 2
    assert st["optimizer"]["step_count"] == st_ref["optimizer"]["step_count"] == 2
    m, m_ref = (safetensors_io.load_file(str(c / "optimizer.safetensors")) for c in (ck, ck_ref))
    assert set(m) == set(m_ref)
    for which in ("m", "v"):
        scale = max(float(np.abs(a).max()) for k, a in m_ref.items() if k.startswith(which + "."))
        for k in (k for k in m_ref if k.startswith(which + ".")):
            assert m[k].dtype == m_ref[k].dtype == np.float32, k
            err = float(np.abs(m[k].astype(np.float64) - m_ref[k]).max())
            assert err <= RTOL * scale, f"{k}: |diff| {err:.2e} > {RTOL:g} * {scale:.2e}"
    # the final model, written from the device: every parameter as the oracle's within 1e-5 of its largest entry;
    # the key bias (gradient 0 in exact arithmetic) within what both runs' AdamW steps moved it (_key_bias_steps)
    lrs = [float(w["lr"]) for w in _rows(ref / "log.csv")]                   # the same on both (checked above)
    steps = {c: _key_bias_steps(c, lrs) for c in (run, ref)}
    p, p_ref = (safetensors_io.load_file(str(c / "model" / "model.safetensors")) for c in (run, ref))
    assert set(p) == set(p_ref)
    for k in p_ref:
        assert p[k].shape == p_ref[k].shape and p[k].dtype == p_ref[k].dtype == np.float32, k
        err = np.abs(p[k].astype(np.float64) - p_ref[k])
        if k.endswith("attention.self.key.bias"):
            bound = (1 + RTOL) * (steps[run][0][k] + steps[ref][0][k])       # elementwise
            assert (err <= bound).all(), f"{k}: |diff| {err.max():.2e} beyond both runs' steps"
            assert np.array_equal(p[k], steps[run][1][k]), k                   # the model is the last checkpoint's
        else:
            bound = RTOL * float(np.abs(p_ref[k]).max())
            assert err.max() <= bound, f"{k}: |diff| {err.max():.2e} > {bound:.2e}"


def _key_bias_steps(out, lrs):
    """Each key bias of the run in `out` moved by exactly its AdamW steps (torch's bias-corrected form, no decay),
    computed from the moments its checkpoints kept, from 0 (HF's init); -> ({key: sum over steps of |step|},
    {key: its value after the last step})."""
    sig = inspect.signature(AdamW).parameters
    (b1, b2), eps = sig["betas"].default, sig["eps"].default
    moved, last = {}, {}
    for t, lr in enumerate(lrs, 1):
        c = out / f"checkpoint-{t:07d}"
        p, m = (safetensors_io.load_file(str(c / f)) for f in ("model.safetensors", "optimizer.safetensors"))
        for k in (k for k in p if k.endswith("attention.self.key.bias")):
            m1, v1 = m["m." + k].astype(np.float64), m["v." + k].astype(np.float64)
            step = lr * (m1 / (1 - b1 ** t)) / (np.sqrt(v1 / (1 - b2 ** t)) + eps)
            want = last.get(k, np.zeros_like(step)).astype(np.float64) - step
            # the device's float32 arithmetic against this float64 one: relative 1e-5 of the step or the value
            tol = RTOL * max(float(np.abs(step).max()), float(np.abs(want).max()))
            assert float(np.abs(p[k] - want).max()) <= tol, (str(c), k, t)
            moved[k] = moved.get(k, 0.0) + np.abs(step)
            last[k] = p[k]
    assert moved and all(v.max() < 1e-6 for v in moved.values()), moved    # ~lr * 1e-14 / eps, not ~lr: noise
    return moved, last


@needs_numba_cuda
def test_sim_pretrain_cuda_resumed_equals_numpy(tiny):
    """--backend cuda in the simulator, stopped after step 1 and resumed: the numpy backend's log and moments."""
    _pretrain_cuda_equals_numpy(tiny, sim=True)


def _gpu_present():
    r = subprocess.run([sys.executable, "-c", "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0"],
                       env=cudachild.child_env(False), capture_output=True, timeout=120)
    return r.returncode == 0


@needs_numba_cuda
def test_gpu_pretrain_cuda_resumed_equals_numpy(tiny):
    """The same on a GPU (CuPy arrays: the optimizer's device path and its host copies for real)."""
    if importlib.util.find_spec("cupy") is None or not _gpu_present():
        pytest.skip("needs a CUDA GPU and CuPy")
    _pretrain_cuda_equals_numpy(tiny, sim=False)


def test_cuda_is_a_backend_choice_of_pretrain_and_finetune():
    p = cli.build_parser()
    assert p.parse_args(["pretrain", "--out", "x", "--backend", "cuda"]).backend == "cuda"
    assert p.parse_args(["finetune", "--task", "pair", "--train", "a", "--dev", "b", "--init", "c", "--out", "d",
                         "--backend", "cuda"]).backend == "cuda"
