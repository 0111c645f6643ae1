"""`refbert verify` and `refbert dump`: dumps written by transformers + torch pass, damaged ones fail naming the
tensor (or the file), and the report points at the layer that went wrong.

The dumps under test come from torch (the README's own snippet, run here), from refbert in float32, or from refbert
with one block of its forward or backward deliberately altered; what each test expects (pass, or which tensor and
which layer fail) follows from how the dump was made, not from refbert's numbers.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import refbert
from refbert import cli, safetensors_io, verify
from refbert.check import tiny_config
from refbert.config import HEADS

ROOT = Path(__file__).resolve().parents[1]
QUERY1 = "grad/bert.encoder.layer.1.attention.self.query.weight"


def refbert_ckpt(path, head="BertForPreTraining", **cfg):
    """A tiny checkpoint saved by refbert, off HF's init (LayerNorm 1/0, zero biases) so that every term matters."""
    model = getattr(refbert, head)(tiny_config(head, **cfg), seed=3, dtype=np.float32)
    for p in model.parameters().values():
        p += (np.random.default_rng(4).standard_normal(p.shape) * 0.1).astype(np.float32)
    model.save_pretrained(path)
    return path


def readme_snippet():
    """The README's PyTorch lines that write a dump (fenced ```py: test_cli runs the ```python blocks in a bare
    folder, and this one needs a checkpoint beside it, so it runs here)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```py\n(.*?)```", text, re.S) if "save_file" in b and "grad/" in b]
    assert len(blocks) == 1, "expected one ```py block in the README that writes a dump"
    return blocks[0]


@pytest.fixture
def hf_dump(tmp_path, monkeypatch):
    """ckpt/ (a random tiny HF BertForPreTraining, float32) and dump.safetensors written by the README's snippet
    on the batch of `refbert dump`."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors.torch")
    cfg = tiny_config()
    hf_cfg = transformers.BertConfig(**{k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "max_position_embeddings", "type_vocab_size")})
    torch.manual_seed(0)
    m = transformers.BertForPreTraining(hf_cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(tmp_path / "ckpt")
    verify.dump(tmp_path / "ckpt", tmp_path / "ref.safetensors")
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_snippet(), "README.md", "exec"), {})
    return tmp_path


def cli_run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def rewrite(src, dst, change):
    """Copy the safetensors dump src to dst with change(tensors) applied."""
    t = safetensors_io.load_file(src)
    change(t)
    safetensors_io.save_file(t, dst)
    return dst


# ----------------------------------------------------------------------------------------------------------------
# dumps that must pass

def test_readme_pytorch_dump_passes(hf_dump, capsys):
    code, out, err = cli_run(capsys, "verify", hf_dump / "ckpt", "--against", hf_dump / "dump.safetensors",
                             "--json", hf_dump / "report.json")
    assert code == 0, out + err
    rep = json.loads((hf_dump / "report.json").read_text())
    assert rep["ok"] and rep["dtype"] == "float32" and rep["failed"] == 0 and rep["first_failure"] is None
    keys = [r["key"] for r in rep["rows"]]
    # every output, hidden state and parameter gradient of the class was compared: 3 + (L + 1) + 46
    assert keys[:3] == ["output/prediction_logits", "output/seq_relationship_logits", "output/loss"]
    assert sum(k.startswith("hidden_states/") for k in keys) == 3 and sum(k.startswith("grad/") for k in keys) == 46
    assert "52 passed, 0 failed" in out


def test_refbert_dump_verifies_against_itself_float64_and_npz(tmp_path):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    for name in ("ref.safetensors", "ref.npz"):
        verify.dump(ckpt, tmp_path / name)
        rep = verify.verify_dump(ckpt, tmp_path / name)
        assert rep["dtype"] == "float64" and rep["failed"] == 0 and len(rep["rows"]) == 52
        assert all(r["error"] == 0 for r in rep["rows"])   # the same float64 computation, the same order: bit-equal


def test_float32_dump_passes_at_float32_tolerance(tmp_path):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    verify.dump(ckpt, tmp_path / "f32.safetensors", dtype="float32")
    assert safetensors_io.load_dtypes(tmp_path / "f32.safetensors")[QUERY1] == "F32"
    rep = verify.verify_dump(ckpt, tmp_path / "f32.safetensors")
    assert rep["dtype"] == "float32" and rep["tolerance"] == 320 * 2.0 ** -23   # 64 eps + 256 eps of float32
    assert rep["failed"] == 0
    assert max(r["error"] for r in rep["rows"]) > 0       # float32 rounding was there to see


@pytest.mark.parametrize("dtype, code", [("bfloat16", "BF16"), ("float16", "F16")])
def test_16_bit_torch_dump_passes_at_its_tolerance(hf_dump, dtype, code):
    """The README's snippet with the model cast to 16 bits: the stored dtype is read from the file's header
    (BF16 widened to float32 on reading loses nothing) and sets the tolerance."""
    torch = pytest.importorskip("torch")
    snippet = readme_snippet().replace(".eval()", f".eval().to(torch.{dtype})").replace('"dump.safetensors"',
                                                                                       f'"{dtype}.safetensors"')
    exec(compile(snippet, "README.md", "exec"), {"torch": torch})
    assert safetensors_io.load_dtypes(hf_dump / f"{dtype}.safetensors")[QUERY1] == code
    rep = verify.verify_dump(hf_dump / "ckpt", hf_dump / f"{dtype}.safetensors")
    assert rep["dtype"] == dtype and rep["failed"] == 0, [r for r in rep["rows"] if not r["ok"]]


def test_dump_batch_default_and_given(tmp_path, capsys):
    """The default batch has padding, two segments and -100 labels; --batch takes bare names (input_ids, ...) or a
    dump's input/* keys, and the dump carries exactly that batch."""
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    t = verify.dump(ckpt, tmp_path / "default.safetensors")
    am, tt, lab = t["input/attention_mask"], t["input/token_type_ids"], t["input/labels"]
    assert t["input/input_ids"].shape == (2, 16) and 0 < am.sum() < am.size
    assert set(np.unique(tt)) == {0, 1} and (lab == -100).any() and (lab != -100).any()
    assert (t["input/input_ids"][am == 0] == 0).all()                 # the pad id, only on padding
    ids = np.arange(20).reshape(2, 10) % 23
    labels = np.full_like(ids, -100)
    labels[1, 3] = 7                    # one MLM target: with none, HF's loss is NaN (a mean over nothing), refbert's 0
    np.savez(tmp_path / "batch.npz", input_ids=ids, attention_mask=np.ones_like(ids), labels=labels,
             next_sentence_label=np.array([1, 1]))
    code, out, err = cli_run(capsys, "dump", ckpt, "--out", tmp_path / "given.npz", "--batch", tmp_path / "batch.npz")
    assert code == 0 and "batch (2, 10)" in out, err
    given, _ = verify.read_dump(tmp_path / "given.npz")
    np.testing.assert_array_equal(given["input/input_ids"], ids)
    assert "input/token_type_ids" not in given and verify.verify_dump(ckpt, tmp_path / "given.npz")["failed"] == 0
    code, out, err = cli_run(capsys, "verify", ckpt, "--batch", tmp_path / "given.npz")   # a dump as a batch
    assert code == 0 and "batch (2, 10)" in out, err


@pytest.mark.parametrize("head", HEADS)
def test_every_head_dumps_and_verifies(tmp_path, head):
    """Each class's default batch (its labels; BertModel's upstream gradients) goes through dump and verify."""
    ckpt = refbert_ckpt(tmp_path / "ckpt", head)
    tensors = verify.dump(ckpt, tmp_path / "d.safetensors", dtype="float32")
    assert all(f"input/{n}" in tensors for n in verify.LABELS[head])
    assert ("upstream/last_hidden_state" in tensors) == (head == "BertModel")
    assert any(k.startswith("grad/") for k in tensors) and any(k.startswith("output/") for k in tensors)
    rep = verify.verify_dump(ckpt, tmp_path / "d.safetensors")
    assert rep["failed"] == 0 and rep["head"] == head


# ----------------------------------------------------------------------------------------------------------------
# dumps that must fail, and where they point

def test_perturbed_gradient_fails_naming_it(hf_dump, capsys):
    bad = rewrite(hf_dump / "dump.safetensors", hf_dump / "bad.safetensors",
                  lambda t: t[QUERY1].__imul__(np.float32(1 + 1e-3)))     # 1e-3 relative, 26 float32 tolerances
    code, out, err = cli_run(capsys, "verify", hf_dump / "ckpt", "--against", bad)
    assert code == 1 and err == ""
    failing = [line for line in out.splitlines() if "FAIL" in line]
    assert len(failing) == 1 and failing[0].startswith(QUERY1)
    # the perturbation itself, measured on torch's gradients as the report defines it (a tensor's scale is at
    # least 1% of the largest gradient); float32 noise (~1e-7) moves it by under 1%
    grads = {k: np.abs(v).max() for k, v in safetensors_io.load_file(bad).items() if k.startswith("grad/")}
    expected = 1e-3 * grads[QUERY1] / (1 + 1e-3) / max(grads[QUERY1] / (1 + 1e-3), 0.01 * max(grads.values()))
    assert float(failing[0].split()[-3]) == pytest.approx(expected, rel=0.01)
    assert f"first failure: layer 1 ({QUERY1})" in out


def test_perturbed_hidden_state_fails_naming_the_layer(hf_dump):
    bad = rewrite(hf_dump / "dump.safetensors", hf_dump / "bad.safetensors",
                  lambda t: t["hidden_states/2"].__iadd__(np.float32(1e-3)))   # layer 1's output
    rep = verify.verify_dump(hf_dump / "ckpt", bad)
    assert [r["key"] for r in rep["rows"] if not r["ok"]] == ["hidden_states/2"]
    assert rep["first_failure"]["where"] == "layer 1" and rep["first_failure"]["key"] == "hidden_states/2"


def hooked_dump(hf_dump, name, hook):
    """The README's snippet on a model altered by hook(model) before its forward: a buggy implementation."""
    snippet = readme_snippet().replace("out = model(", "hook(model)\nout = model(").replace(
        '"dump.safetensors"', f'"{name}"')
    exec(compile(snippet, "README.md", "exec"), {"hook": hook})
    return verify.verify_dump(hf_dump / "ckpt", hf_dump / name)


def test_wrong_forward_in_one_layer_is_found(hf_dump):
    """Layer 1's output off by 1e-3 (a torch forward hook): hidden_states/2 is the first tensor to fail."""
    def hook(model):
        model.bert.encoder.layer[1].output.register_forward_hook(lambda module, inputs, out: out * 1.001)
    rep = hooked_dump(hf_dump, "fwd.safetensors", hook)
    failed = {r["key"] for r in rep["rows"] if not r["ok"]}
    assert "hidden_states/2" in failed and not failed & {"hidden_states/0", "hidden_states/1"}
    assert rep["first_failure"]["where"] == "layer 1" and rep["first_failure"]["key"] == "hidden_states/2"


def test_wrong_backward_is_found_where_it_first_shows(hf_dump):
    """The gradient that layer 1 sends down to layer 0 off by 1e-3 (a torch tensor hook): the forward, the head
    and layer 1's own gradients are right, so the walk in backward order stops at layer 0."""
    def hook(model):
        def scale_gradient(module, inputs, out):
            out.register_hook(lambda g: g * 1.001)      # the gradient arriving at layer 0's output
        model.bert.encoder.layer[0].output.register_forward_hook(scale_gradient)
    rep = hooked_dump(hf_dump, "bwd.safetensors", hook)
    failed = {r["key"] for r in rep["rows"] if not r["ok"]}
    assert failed and all(".layer.0." in k or ".embeddings." in k for k in failed)
    assert rep["first_failure"]["where"] == "layer 0"


def test_missing_and_misshapen_tensors_fail_naming_them(tmp_path, capsys):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    verify.dump(ckpt, tmp_path / "ref.safetensors", dtype="float32")
    missing = rewrite(tmp_path / "ref.safetensors", tmp_path / "missing.safetensors", lambda t: t.pop(QUERY1))
    code, out, err = cli_run(capsys, "verify", ckpt, "--against", missing)
    assert code == 1 and err == ""
    assert re.search(rf"^{re.escape(QUERY1)} .*FAIL \(missing\)$", out, re.M)
    assert f"first failure: layer 1 ({QUERY1})" in out

    def transpose(t):
        t[QUERY1.replace("query", "value")] = np.ascontiguousarray(t["grad/bert.encoder.layer.0.intermediate.dense.weight"].T)
    shape = rewrite(tmp_path / "ref.safetensors", tmp_path / "shape.safetensors", transpose)
    code, out, err = cli_run(capsys, "verify", ckpt, "--against", shape)
    assert code == 1 and err == ""
    assert re.search(r"^grad/bert.encoder.layer.1.attention.self.value.weight .*FAIL \(shape \[12, 20\], "
                     r"expected \[12, 12\]\)$", out, re.M)


def test_misspelt_name_is_missing_and_unexpected(tmp_path):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    verify.dump(ckpt, tmp_path / "ref.safetensors")
    bare = QUERY1.replace("grad/bert.", "grad/")             # the encoder's name without the head's 'bert.' prefix
    bad = rewrite(tmp_path / "ref.safetensors", tmp_path / "bad.safetensors", lambda t: t.__setitem__(bare, t.pop(QUERY1)))
    rep = verify.verify_dump(ckpt, bad)
    notes = {r["key"]: r["note"] for r in rep["rows"] if not r["ok"]}
    assert notes == {QUERY1: "missing", bare: "unexpected key"}


def test_truncated_dump_exits_2_with_one_line(tmp_path):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    for name in ("ref.safetensors", "ref.npz"):
        verify.dump(ckpt, tmp_path / name)
        data = (tmp_path / name).read_bytes()
        trunc = tmp_path / f"trunc-{name}"
        trunc.write_bytes(data[: len(data) // 2])
        res = subprocess.run([sys.executable, "-m", "refbert", "verify", str(ckpt), "--against", str(trunc)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and res.stdout == "", res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and str(trunc) in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_user_errors_exit_2_naming_what(tmp_path, capsys):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    verify.dump(ckpt, tmp_path / "ref.safetensors")
    no_ids = rewrite(tmp_path / "ref.safetensors", tmp_path / "no_ids.safetensors", lambda t: t.pop("input/input_ids"))
    half = rewrite(tmp_path / "ref.safetensors", tmp_path / "half.safetensors",
                   lambda t: t.pop("input/next_sentence_label"))
    wide = rewrite(tmp_path / "ref.safetensors", tmp_path / "wide.safetensors",
                   lambda t: t.__setitem__("input/input_ids", np.full((2, 16), 99)))    # vocabulary is 23
    for dump, expected in [(no_ids, "expected a tensor 'input/input_ids'"),
                           (half, "without input/next_sentence_label"),
                           (wide, r"wide.safetensors'.*'input_ids' expected values in \[0, 23\)"),
                           (tmp_path / "nothing.safetensors", "expected a file")]:
        code, out, err = cli_run(capsys, "verify", ckpt, "--against", dump)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert re.search(expected, err), err
    code, out, err = cli_run(capsys, "verify", ckpt, "--against", tmp_path / "ref.safetensors", "--head", "BertForQA")
    assert code == 2 and "head expected one of" in err


def test_checkpoint_without_the_head_is_refused_for_a_dump(tmp_path, capsys):
    """Head weights the checkpoint lacks would be random in refbert and different in the implementation under test."""
    enc = refbert_ckpt(tmp_path / "enc", "BertModel")
    code, out, err = cli_run(capsys, "dump", enc, "--out", tmp_path / "d.safetensors",
                             "--head", "BertForSequenceClassification")
    assert code == 2 and "lacks 2 weight(s) of BertForSequenceClassification (first: 'classifier.weight')" in err


# ----------------------------------------------------------------------------------------------------------------
# refbert verify CKPT: refbert's own backward

def test_self_check_passes_and_writes_json(tmp_path, capsys):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    code, out, err = cli_run(capsys, "verify", ckpt, "--json", tmp_path / "r.json")
    assert code == 0, out + err
    rep = json.loads((tmp_path / "r.json").read_text())
    fd = rep["finite_differences"]["rows"]
    assert len(fd) == 46 and all(r["ok"] for r in fd)
    if "skipped" not in rep["hf"]:
        assert len(rep["hf"]["rows"]) == 52 and all(r["ok"] for r in rep["hf"]["rows"])


@pytest.mark.parametrize("head", [h for h in HEADS if h != "BertForPreTraining"])
def test_self_check_every_head_against_torch(tmp_path, head):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ckpt = refbert_ckpt(tmp_path / "ckpt", head)
    rep = verify.verify_self(ckpt, log=lambda *a: None)
    assert all(r["ok"] for r in rep["finite_differences"]["rows"])
    rows = rep["hf"]["rows"]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert sum(r["key"].startswith("grad/") for r in rows) == len(rep["finite_differences"]["rows"])


def test_self_check_catches_a_wrong_backward_and_skips_a_missing_torch(tmp_path, monkeypatch, capsys):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    monkeypatch.setitem(sys.modules, "transformers", None)      # import transformers now raises ImportError
    right = refbert.BertForPreTraining.backward

    def wrong(self, *args, **kwargs):                           # one gradient off by 1e-3
        grads = right(self, *args, **kwargs)
        grads[QUERY1[5:]] *= 1.001
        return grads
    monkeypatch.setattr(refbert.BertForPreTraining, "backward", wrong)
    code, out, err = cli_run(capsys, "verify", ckpt)
    assert code == 1 and "skipped (transformers is not installed)" in out
    assert [line.split()[0] for line in out.splitlines() if line.endswith(" FAIL")] == [QUERY1]
    assert f"first failure: layer 1 ({QUERY1})" in out
