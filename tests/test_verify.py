"""`refbert verify` and `refbert dump`: dumps written by transformers + torch pass, a change of 1e-3 in any one
tensor of a float32 dump (1e-9 in float64) fails that tensor, damaged dumps fail naming the tensor (or the file),
and the report points at the layer that went wrong.

The dumps under test come from torch (the README's own snippet, run here, and the same lines for every head), from
refbert in float32, or from torch with one block of its forward or backward deliberately altered; what each test
expects (pass, or which tensor and which layer fail) follows from how the dump was made, not from refbert's numbers.
The torch tests ask for the `torch` and `transformers` fixtures: they skip where torch is missing, and fail under CI.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import refbert
from refbert import BertConfig, cli, safetensors_io, verify
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


def readme_blocks(must):
    """The README's ```py blocks holding every string of `must` (fenced ```py, not ```python: test_cli runs those in
    a bare folder, and these need torch and a checkpoint beside them, so they run here)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [b for b in re.findall(r"```py\n(.*?)```", text, re.S) if all(m in b for m in must)]


def readme_snippet():
    """The README's PyTorch lines that write a dump."""
    blocks = readme_blocks(("save_file", "grad/", "out.loss.backward()"))
    assert len(blocks) == 1, "expected one ```py block in the README that writes a dump"
    return blocks[0]


def hf_config(transformers, cfg):
    return transformers.BertConfig(**{k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "max_position_embeddings", "type_vocab_size", "num_labels")})


def hf_ckpt(torch, transformers, path, cfg, moved):
    """An HF BertForPreTraining saved by transformers: its own init (moved=False), or every weight then moved by
    N(0, 0.1^2), off LayerNorm's 1/0 and zero biases (moved=True)."""
    torch.manual_seed(0)
    m = transformers.BertForPreTraining(hf_config(transformers, cfg))
    if moved:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(path)
    return path


@pytest.fixture
def hf_dump(tmp_path, monkeypatch, torch, transformers):
    """ckpt/ (a tiny HF BertForPreTraining, float32, weights moved off the init) and dump.safetensors written by the
    README's snippet on the batch of `refbert dump`."""
    hf_ckpt(torch, transformers, tmp_path / "ckpt", tiny_config(), moved=True)
    verify.dump(tmp_path / "ckpt", tmp_path / "ref.safetensors")
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_snippet(), "README.md", "exec"), {})
    return tmp_path


def torch_dump(torch, transformers, ckpt, head, batch_path, out, dtype="float32"):
    """The README's snippet for any head, in `dtype`: `head`.from_pretrained(ckpt) in eval mode on the batch (and
    BertModel's upstream gradients) of the dump at batch_path; written to `out` as safetensors."""
    from safetensors.torch import load_file, save_file
    model = getattr(transformers, head).from_pretrained(ckpt).eval().to(getattr(torch, dtype))
    given = load_file(batch_path)
    batch = {k[6:]: v for k, v in given.items() if k.startswith("input/")}
    out_ = model(**batch, output_hidden_states=True)
    if head == "BertModel":                        # the loss whose gradients BertModel's dump holds
        loss = sum((out_[k] * given[f"upstream/{k}"].to(out_[k].dtype)).sum() for k in verify.UPSTREAM)
    else:
        loss = out_.loss
    loss.backward()
    dump = {k: v for k, v in given.items() if k.startswith(("input/", "upstream/"))}
    dump |= {f"output/{k}": v for k, v in out_.items() if k != "hidden_states"}
    dump |= {f"hidden_states/{i}": h for i, h in enumerate(out_.hidden_states)}
    dump |= {f"grad/{k}": p.grad for k, p in model.named_parameters()}
    # clone: BertModel's last_hidden_state is its last hidden state, one tensor, which save_file refuses twice
    save_file({k: v.detach().clone().contiguous() for k, v in dump.items()}, out)
    return out


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
    assert verify.rule("float32", 8) in out                      # the header states the rule
    # the key bias is 0 in exact arithmetic: judged in units of its noise, and says so
    kb = [r for r in rep["rows"] if r["key"].endswith(".attention.self.key.bias")]
    assert len(kb) == 2 and all(r["tolerance"] == 8 and r["note"].startswith("0 in exact arithmetic") for r in kb)


@pytest.mark.parametrize("dtype, code", [("float64", "F64"), ("bfloat16", "BF16"), ("float16", "F16")])
def test_torch_dump_in_each_dtype_passes(hf_dump, torch, dtype, code):
    """The README's snippet with the model cast to `dtype`: the stored dtype is read from the file's header
    (BF16 widened to float32 on reading loses nothing) and sets the noise model."""
    snippet = readme_snippet().replace(".eval()", f".eval().to(torch.{dtype})").replace('"dump.safetensors"',
                                                                                       f'"{dtype}.safetensors"')
    exec(compile(snippet, "README.md", "exec"), {"torch": torch})
    assert safetensors_io.load_dtypes(hf_dump / f"{dtype}.safetensors")[QUERY1] == code
    rep = verify.verify_dump(hf_dump / "ckpt", hf_dump / f"{dtype}.safetensors")
    assert rep["dtype"] == dtype and rep["factor"] == verify.FACTOR[dtype]
    assert rep["failed"] == 0, [r for r in rep["rows"] if not r["ok"]]


@pytest.mark.parametrize("head", HEADS)
def test_every_heads_torch_dump_passes(tmp_path, torch, transformers, head):
    """transformers' class of each head, on the batch (labels, BertModel's upstream) of `refbert dump`: every
    output field, hidden state and gradient it writes is known to refbert and passes."""
    ckpt = refbert_ckpt(tmp_path / "ckpt", head)
    verify.dump(ckpt, tmp_path / "ref.safetensors", head=head)
    torch_dump(torch, transformers, ckpt, head, tmp_path / "ref.safetensors", tmp_path / "torch.safetensors")
    rep = verify.verify_dump(ckpt, tmp_path / "torch.safetensors", head=head)
    assert rep["dtype"] == "float32" and rep["failed"] == 0, [r for r in rep["rows"] if not r["ok"]]
    n_params = len(verify.load(ckpt, head, np.float64).parameters())
    assert sum(r["key"].startswith("grad/") for r in rep["rows"]) >= n_params   # (+ the tied decoder's aliases)
    assert any(r["key"].startswith("output/") for r in rep["rows"])


def test_refbert_dump_verifies_against_itself_float64_and_npz(tmp_path):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    for name in ("ref.safetensors", "ref.npz"):
        verify.dump(ckpt, tmp_path / name)
        rep = verify.verify_dump(ckpt, tmp_path / name)
        assert rep["dtype"] == "float64" and rep["failed"] == 0 and len(rep["rows"]) == 52
        assert all(r["error"] == 0 for r in rep["rows"])   # the same float64 computation, the same order: bit-equal


def test_refbert_float32_dump_passes(tmp_path):
    """refbert computing in float32 is an implementation too (NumPy's sums, not torch's): its dump passes."""
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    verify.dump(ckpt, tmp_path / "f32.safetensors", dtype="float32")
    assert safetensors_io.load_dtypes(tmp_path / "f32.safetensors")[QUERY1] == "F32"
    rep = verify.verify_dump(ckpt, tmp_path / "f32.safetensors")
    assert rep["dtype"] == "float32" and rep["factor"] == 8 and rep["failed"] == 0
    assert max(r["error"] for r in rep["rows"]) > 0       # float32 rounding was there to see


def test_dump_batch_default_and_given(tmp_path, capsys):
    """The default batch has padding, two segments and -100 labels; --batch takes bare names (input_ids, ...) or a
    dump's input/* keys, and the dump carries exactly that batch."""
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    t = verify.dump(ckpt, tmp_path / "default.safetensors")
    am, tt, lab = t["input/attention_mask"], t["input/token_type_ids"], t["input/labels"]
    assert t["input/input_ids"].shape == (3, 16) and 0 < am.sum() < am.size
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


def test_a_batch_with_a_misspelt_tensor_or_none_is_refused(tmp_path, capsys):
    """A batch key the head does not take ("label" for "labels") would have dropped the loss and its gradients
    without a word (the dump then forward-only); an empty .npz was read as safetensors (its zip starts PK\\x05\\x06)."""
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    ids = np.arange(20).reshape(2, 10) % 23
    np.savez(tmp_path / "typo.npz", input_ids=ids, label=np.full_like(ids, -100))
    code, _, err = cli_run(capsys, "dump", ckpt, "--out", tmp_path / "d.npz", "--batch", tmp_path / "typo.npz")
    assert code == 2 and "holds tensors BertForPreTraining does not take: ['input/label']" in err, err
    np.savez(tmp_path / "empty.npz")
    code, _, err = cli_run(capsys, "dump", ckpt, "--out", tmp_path / "d.npz", "--batch", tmp_path / "empty.npz")
    assert code == 2 and "expected a tensor 'input/input_ids', got none" in err, err
    assert not (tmp_path / "d.npz").exists()


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
# every tensor changed alone is caught

SIZES = {"tiny": tiny_config(), "mini": BertConfig.preset("mini", max_position_embeddings=16)}


@pytest.mark.parametrize("size, moved", [("tiny", False), ("tiny", True), ("mini", False)])
def test_every_tensor_changed_alone_fails_alone(tmp_path, torch, transformers, size, moved):
    """A torch dump (float32, and float64) passes; each of its tensors (outputs, hidden states, gradients) scaled
    alone by 1 + 1e-3 (float64: 1 + 1e-9) fails, the others still pass; the key bias, 0 in exact arithmetic,
    fails when shifted by 1e-3 of its layer's query-bias gradient (a realistic bug: a share of a neighbour's size).
    refbert's reference and noise are computed once per dtype, each changed dump only compared."""
    ckpt = hf_ckpt(torch, transformers, tmp_path / "ckpt", SIZES[size], moved)
    verify.dump(ckpt, tmp_path / "ref.safetensors")
    model = verify.load(ckpt, "BertForPreTraining", np.float64)
    for dtype, change in (("float32", 1e-3), ("float64", 1e-9)):
        path = torch_dump(torch, transformers, ckpt, "BertForPreTraining", tmp_path / "ref.safetensors",
                          tmp_path / f"{dtype}.safetensors", dtype)
        tensors, dtypes = verify.read_dump(path)
        batch, upstream, used = verify.split_batch(tensors, "BertForPreTraining", model.config, "test")
        got = {k: v for k, v in tensors.items() if k not in used}
        ref, noise = verify.expected(model, ckpt, "BertForPreTraining", batch, upstream, dtype, "test")
        K, zeros = verify.FACTOR[dtype], verify.exact_zeros("BertForPreTraining", ref)
        rows = verify.compare(ref, got, dtypes, noise, K, zeros)
        assert len(rows) == len(got) and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
        assert len(zeros) == SIZES[size].num_hidden_layers              # the key biases
        for k in got:
            if k in zeros:
                x = got[k] + 1e-3 * np.abs(ref[k.replace(".key.", ".query.")]).max()
            else:
                x = got[k] * (1 + change)
            (row,) = verify.compare({k: ref[k]}, {k: x}, dtypes, noise, K, zeros)
            assert not row["ok"], f"{dtype} {k}: {row}"


def test_perturbed_gradient_fails_naming_it(hf_dump, capsys):
    bad = rewrite(hf_dump / "dump.safetensors", hf_dump / "bad.safetensors",
                  lambda t: t[QUERY1].__imul__(np.float32(1 + 1e-3)))
    code, out, err = cli_run(capsys, "verify", hf_dump / "ckpt", "--against", bad)
    assert code == 1 and err == ""
    failing = [line for line in out.splitlines() if "FAIL" in line]
    assert len(failing) == 1 and failing[0].startswith(QUERY1)
    # error is relative to the tensor's largest entry: 1e-3, give or take float32 noise (~1e-6 of it)
    assert float(failing[0].split()[-3]) == pytest.approx(1e-3, rel=0.01)
    assert float(failing[0].split()[-2]) < 1e-4                 # and this tensor's tolerance is far below it
    assert f"first failure: layer 1 ({QUERY1})" in out


def readme_sample(after):
    """The lines of the README's plain ``` block that follows the text `after`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.search(r"```\n(.*?)```", text[text.index(after):], re.S).group(1).splitlines()


def test_readme_verify_example_is_what_verify_prints(tmp_path, monkeypatch, capsys, torch, transformers):
    """The README's example, run as it says (its checkpoint lines, `refbert dump`, its snippet, its scaling lines,
    `refbert verify`): its sample output is this output, "..." standing for rows left out: the same lines but for
    the first one's time, the same rows but for their numbers, the tolerances equal to 20% and the failing row's
    error 1e-3 (the errors of honest rows are float32 rounding, which differs between machines)."""
    monkeypatch.chdir(tmp_path)
    (make,) = readme_blocks(('save_pretrained("ckpt")',))
    (scale,) = readme_blocks(("*= 1 + 1e-3",))
    exec(compile(make, "README.md", "exec"), {})
    assert cli_run(capsys, "dump", "ckpt", "--out", "ref.safetensors")[0] == 0
    exec(compile(readme_snippet(), "README.md", "exec"), {})
    exec(compile(scale, "README.md", "exec"), {})
    capsys.readouterr()                                          # transformers' loading bars
    code, out, err = cli_run(capsys, "verify", "ckpt", "--against", "bad.safetensors")
    assert code == 1 and err == ""
    got, sample = out.rstrip("\n").splitlines(), readme_sample("`refbert verify ckpt --against bad.safetensors` prints")
    timed = re.compile(r"; [0-9.]+ s$")
    assert timed.sub("", sample[0]) == timed.sub("", got[0])
    rows = {line.split()[0]: line for line in got if line.startswith(("output/", "hidden_states/", "grad/"))}
    for line in sample[1:]:
        if line == "...":
            continue
        key = line.split()[0] if line else ""
        if key not in rows:
            assert line in got, line                            # the rule, the table's head, the summary
            continue
        row = re.compile(r"^(\S+) +(\S+) +(\(.*?\)) +(\S+) +(\S+) +(.*)$")   # key dtype shape error tolerance verdict
        mine, theirs = row.match(rows[key]).groups(), row.match(line).groups()
        assert mine[:3] == theirs[:3] and mine[5:] == theirs[5:], (line, rows[key])
        assert float(mine[4]) == pytest.approx(float(theirs[4]), rel=0.2), (line, rows[key])
        if "FAIL" in line:                                 # a change of 1e-3 of the tensor, give or take its noise
            assert float(mine[3]) == pytest.approx(1e-3, rel=0.01) and theirs[3] == "1.00e-03", line
    assert sum(line.startswith("grad/") for line in sample) >= 3 and "..." in sample and "FAIL" in "".join(sample)


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
# the noise model: Monte Carlo arithmetic over refbert's ops

@pytest.mark.parametrize("head, cfg", [(h, {}) for h in HEADS] + [
    ("BertForSequenceClassification", dict(num_labels=1)),                                     # MSE
    ("BertForSequenceClassification", dict(problem_type="multi_label_classification"))])     # BCE
def test_monte_carlo_ops_at_scale_0_are_refbert(tmp_path, head, cfg):
    """With its roundings scaled to 0, MonteCarloOps computes what refbert.ops does, bit for bit (attention split
    into its matmuls and softmax runs the same float64 operations in the same order): the noise model perturbs
    refbert's computation and nothing else, and covers every op each head and loss calls (a missing one raises)."""
    ckpt = refbert_ckpt(tmp_path / "ckpt", head, **cfg)
    model = verify.load(ckpt, head, np.float64)
    batch, upstream = verify.default_batch(model.config, head)
    if cfg.get("problem_type"):                                   # multi-label: a 0/1 target per class
        batch["labels"] = (np.arange(3 * model.config.num_labels).reshape(3, -1) % 2).astype(np.float64)
    ref = verify.reference(model, batch, upstream)
    model.ops = verify.MonteCarloOps("float64", scale=0.0)
    same = verify.reference(model, batch, upstream)
    assert list(same) == list(ref)
    for k in ref:
        np.testing.assert_array_equal(same[k], ref[k], err_msg=k)


def test_monte_carlo_rounding_has_the_modelled_size():
    """One op's rounding: |d| <= u |y| + sqrt(n) u_acc |y| per entry (n: the terms each entry sums), and about
    that large (uniform draws: the largest of many entries comes near the bound); float16 adds its subnormal
    spacing's half, 2^-25, where u |y| is smaller; cross-entropy's backward rounds at the softmax's size."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((64, 50)), rng.standard_normal((30, 50))
    y, _ = verify.O.linear_forward(x, w)
    for dtype, u, u_acc in (("float32", 2.0 ** -24, 2.0 ** -24), ("bfloat16", 2.0 ** -8, 2.0 ** -24)):
        got, _ = verify.MonteCarloOps(dtype).linear_forward(x, w)
        ratio = np.abs(got - y) / (np.abs(y) * (u + np.sqrt(50) * u_acc))
        assert ratio.max() <= 1 + 1e-6 and ratio.max() > 0.9, (dtype, ratio.max())
    small = np.full((4, 8), 1e-9)                                        # far under float16's 2^-14
    got = verify.MonteCarloOps("float16")._round(small, 1)
    assert 0.5 * 2.0 ** -25 < np.abs(got - small).max() <= 2.0 ** -25 + 1e-9 * (2.0 ** -11 + 2.0 ** -24)
    z, labels = rng.standard_normal((6, 5)) * 30, np.array([0, 1, 2, 3, 4, 0])   # confident rows: p - onehot ~ 0
    _, c = verify.O.cross_entropy_forward(z, labels)
    dz = verify.O.cross_entropy_backward(1.0, c)
    got = verify.MonteCarloOps("float32").cross_entropy_backward(1.0, c)
    p = dz + np.eye(5)[labels] / 6                                       # the softmax / n, before "- onehot"
    assert np.all(np.abs(got - dz) <= p * (2.0 ** -24 + np.sqrt(5) * 2.0 ** -24) + 1e-300)
    assert np.abs(got - dz).max() > 0.1 * 2.0 ** -24 / 6                 # at p's size, not at |p - onehot|'s


def test_noise_follows_each_tensors_conditioning(tmp_path):
    """A tensor's noise follows its own size: across the tensors the absolute noise spans three orders of
    magnitude, relative to each tensor's largest entry it stays within a few roundings (so no common floor could
    serve them all, and a change of 1e-3 stands out in each); float64's is float32's shrunk by ~eps64/eps32."""
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    model = verify.load(ckpt, "BertForPreTraining", np.float64)
    batch, upstream = verify.default_batch(model.config, "BertForPreTraining")
    ref, n32 = verify.expected(model, ckpt, "BertForPreTraining", batch, upstream, "float32", "test")
    _, n64 = verify.expected(model, ckpt, "BertForPreTraining", batch, upstream, "float64", "test")
    zeros = verify.exact_zeros("BertForPreTraining", ref)
    absolute = [n32[k] for k in ref if k not in zeros]
    rel = {k: n32[k] / np.abs(r).max() for k, r in ref.items() if k not in zeros}
    assert max(absolute) / min(absolute) > 300
    assert all(2.0 ** -24 <= v < 1e-3 / 8 for v in rel.values()), rel     # at least one rounding; 1e-3 visible
    assert max(rel.values()) / min(rel.values()) < 30
    shrink = np.median([n64[k] / n32[k] for k in rel])
    assert 2.0 ** -29 / 8 < shrink < 2.0 ** -29 * 8, shrink


def test_dump_names_its_format_or_refuses_the_name(tmp_path, capsys):
    """--out ending in .safetensors or .npz (any case) writes that format and says so; any other name is refused
    in one line before any work, and nothing is written."""
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    for name, fmt in (("a.safetensors", "safetensors"), ("b.NPZ", "npz")):
        code, out, err = cli_run(capsys, "dump", ckpt, "--out", tmp_path / name)
        assert code == 0 and out.rstrip().endswith(f"{fmt} format"), out + err
        with open(tmp_path / name, "rb") as f:
            assert (f.read(4) == b"PK\x03\x04") == (fmt == "npz")           # npz is a zip
    for name in ("x.txt", "dump"):
        code, out, err = cli_run(capsys, "dump", ckpt, "--out", tmp_path / name)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert "expected a file name ending in .safetensors or .npz" in err and str(tmp_path / name) in err
        assert not (tmp_path / name).exists()


# ----------------------------------------------------------------------------------------------------------------
# refbert verify CKPT: refbert's own backward

def test_self_check_passes_and_writes_json(tmp_path, capsys, torch, transformers):
    """Finite differences and transformers + torch autograd (float64, the same weights) both agree with refbert."""
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    code, out, err = cli_run(capsys, "verify", ckpt, "--json", tmp_path / "r.json")
    assert code == 0, out + err
    rep = json.loads((tmp_path / "r.json").read_text())
    fd = rep["finite_differences"]["rows"]
    assert len(fd) == 46 and all(r["ok"] for r in fd)
    hf = rep["hf"]["rows"]
    assert len(hf) == 52 and all(r["ok"] for r in hf) and rep["hf"]["dtype"] == "float64"
    assert "refbert against transformers + torch autograd, both float64" in out and verify.rule("float64", 8) in out


@pytest.mark.parametrize("head", [h for h in HEADS if h != "BertForPreTraining"])
def test_self_check_every_head_against_torch(tmp_path, torch, transformers, head):
    ckpt = refbert_ckpt(tmp_path / "ckpt", head)
    rep = verify.verify_self(ckpt, log=lambda *a: None)
    assert all(r["ok"] for r in rep["finite_differences"]["rows"])
    rows = rep["hf"]["rows"]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert sum(r["key"].startswith("grad/") for r in rows) == len(rep["finite_differences"]["rows"])


def wrong_backward(monkeypatch, change):
    """refbert's BertForPreTraining with QUERY1's gradient scaled by 1 + change."""
    right = refbert.BertForPreTraining.backward

    def wrong(self, *args, **kwargs):
        grads = right(self, *args, **kwargs)
        grads[QUERY1[5:]] *= 1 + change
        return grads
    monkeypatch.setattr(refbert.BertForPreTraining, "backward", wrong)


def test_self_check_torch_catches_what_finite_differences_cannot(tmp_path, monkeypatch, capsys, torch, transformers):
    """A gradient off by 1e-9 hides under the finite differences' 1e-7 bar; transformers + torch autograd in
    float64 (noise ~1e-15 of it) sees it: the peer is the finer check, and its failure alone makes verify exit 1."""
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    wrong_backward(monkeypatch, 1e-9)
    code, out, err = cli_run(capsys, "verify", ckpt, "--json", tmp_path / "r.json")
    assert code == 1 and "FAILED" in out, out + err
    rep = json.loads((tmp_path / "r.json").read_text())
    assert all(r["ok"] for r in rep["finite_differences"]["rows"])       # 1e-9 is inside FD's 1e-7 bar
    assert [r["key"] for r in rep["hf"]["rows"] if not r["ok"]] == [QUERY1]
    assert rep["hf"]["first_failure"]["where"] == "layer 1"


def test_self_check_catches_a_wrong_backward_and_skips_a_missing_torch(tmp_path, monkeypatch, capsys):
    ckpt = refbert_ckpt(tmp_path / "ckpt")
    monkeypatch.setitem(sys.modules, "transformers", None)      # import transformers now raises ImportError
    wrong_backward(monkeypatch, 1e-3)                           # one gradient off by 1e-3
    code, out, err = cli_run(capsys, "verify", ckpt)
    assert code == 1 and "skipped (transformers is not installed)" in out
    assert [line.split()[0] for line in out.splitlines() if line.endswith(" FAIL")] == [QUERY1]
    assert f"first failure: layer 1 ({QUERY1})" in out


def test_verify_noise_gpu_without_cuda_says_so_and_exits_2(monkeypatch, capsys, tmp_path, torch):
    """benchmarks/verify_noise_gpu.py (gpu_all.sh's verify step) on a torch without CUDA: one line that names what
    is missing and the script's dry run, exit status 2, nothing written; not torch's AssertionError from inside
    torch.cuda. (torch.cuda.is_available is made False, so this holds on a GPU machine too.)"""
    import importlib.util
    monkeypatch.setattr(sys, "path", list(sys.path))             # (the script puts benchmarks/ on it: put back after)
    monkeypatch.setitem(sys.modules, "verify_noise", None)       # (and imports verify_noise: as it was, after)
    del sys.modules["verify_noise"]                               # (so that the script's import runs)
    spec = importlib.util.spec_from_file_location("verify_noise_gpu", ROOT / "benchmarks" / "verify_noise_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["verify_noise_gpu.py", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "SKIPPED" in err and "torch.cuda.is_available() is False" in err and "--device cpu" in err, err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------------
# the rules of the module docstring, one at a time, on refbert's own float32 dump (no torch run needed)

WE = "grad/bert.encoder.layer.0.intermediate.dense.weight"     # (intermediate, hidden) = (20, 12): not square


@pytest.fixture(scope="module")
def f32_dump(tmp_path_factory):
    """ckpt/ (refbert_ckpt) and f32.safetensors, refbert's float32 dump of it: a dump that passes (as
    test_refbert_float32_dump_passes shows), for tests that change one thing of it. Shared: tests only read it."""
    d = tmp_path_factory.mktemp("f32dump")
    ckpt = refbert_ckpt(d / "ckpt")
    verify.dump(ckpt, d / "f32.safetensors", dtype="float32")
    return ckpt, d / "f32.safetensors"


def set_entry(key, value):
    """A change for rewrite(): entry [0, 0] of tensor `key` set to `value`."""
    def change(t):
        t[key] = t[key].copy()
        t[key][0, 0] = value
    return change


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_gradient_entry_fails_as_not_finite(f32_dump, tmp_path, capsys, value):
    """One NaN (or inf) entry in a gradient: NaN compares false with any tolerance and a max that skips NaN would
    hide it, so the row must fail, saying "not finite", and verify exits 1; --json stays strict JSON (the module's
    _json writes a non-finite error as null: json has no NaN)."""
    ckpt, good = f32_dump
    bad = rewrite(good, tmp_path / "bad.safetensors", set_entry(QUERY1, value))
    code, out, err = cli_run(capsys, "verify", ckpt, "--against", bad, "--json", tmp_path / "r.json")
    assert code == 1 and err == ""
    assert re.search(rf"^{re.escape(QUERY1)} .*FAIL \(not finite\)$", out, re.M), out

    def no_constants(name):
        raise AssertionError(f"report.json holds {name}: not strict JSON")
    rep = json.loads((tmp_path / "r.json").read_text(), parse_constant=no_constants)
    (row,) = [r for r in rep["rows"] if r["key"] == QUERY1]
    assert not row["ok"] and row["note"] == "not finite" and row["error"] is None
    assert [r["key"] for r in rep["rows"] if not r["ok"]] == [QUERY1]


def test_transposed_gradient_of_the_same_size_fails_on_shape(f32_dump, tmp_path):
    """A (20, 12) weight's gradient stored as its (12, 20) transpose has the right number of entries but the wrong
    shape (a classic layout bug): "a wrong shape ... fails its row", it is not reshaped into place."""
    ckpt, good = f32_dump
    bad = rewrite(good, tmp_path / "t.safetensors", lambda t: t.__setitem__(WE, np.ascontiguousarray(t[WE].T)))
    rep = verify.verify_dump(ckpt, bad)
    notes = {r["key"]: r["note"] for r in rep["rows"] if not r["ok"]}
    assert notes == {WE: "shape [12, 20], expected [20, 12]"}


@pytest.mark.parametrize("key", ["output/seq_relationship_logits", QUERY1])
def test_integer_output_or_gradient_fails(f32_dump, tmp_path, key):
    """"an integer tensor ... fails its row": outputs and gradients are real numbers, an int dump of them is a bug."""
    ckpt, good = f32_dump
    bad = rewrite(good, tmp_path / "i.safetensors", lambda t: t.__setitem__(key, np.round(t[key]).astype(np.int32)))
    rep = verify.verify_dump(ckpt, bad)
    notes = {r["key"]: r["note"] for r in rep["rows"] if not r["ok"]}
    assert list(notes) == [key] and notes[key].startswith("expected a float tensor"), notes


def test_least_precise_tensor_sets_the_dtype(f32_dump, tmp_path):
    """A float32 dump with one gradient stored as float16: the dump's precision is its least precise tensor's
    (verify_dump's docstring), so float16 and its factor K = 16, not float32's 8."""
    ckpt, good = f32_dump
    mixed = rewrite(good, tmp_path / "m.safetensors", lambda t: t.__setitem__(QUERY1, t[QUERY1].astype(np.float16)))
    assert safetensors_io.load_dtypes(mixed)[QUERY1] == "F16"
    rep = verify.verify_dump(ckpt, mixed)
    assert rep["dtype"] == "float16" and rep["factor"] == verify.FACTOR["float16"] == 16


def test_tied_decoder_gradients_listed_too_pass(f32_dump, tmp_path):
    """torch's named_parameters(remove_duplicate=False) lists the tied MLM decoder: its gradients, the word
    embeddings' and the MLM bias's, are compared as those tensors, not reported as unexpected keys."""
    ckpt, good = f32_dump

    def add_aliases(t):
        for alias, name in verify.ALIASES.items():
            t[f"grad/{alias}"] = t[f"grad/{name}"].copy()
    both = rewrite(good, tmp_path / "tied.safetensors", add_aliases)
    rep = verify.verify_dump(ckpt, both)
    keys = {r["key"] for r in rep["rows"]}
    assert {f"grad/{a}" for a in verify.ALIASES} <= keys
    assert rep["failed"] == 0, [r for r in rep["rows"] if not r["ok"]]


def test_fractional_input_ids_are_refused(f32_dump, tmp_path):
    """Token ids stored as floats are read as integers when they are integers; 1.5 is no token id: a ValueError
    saying so, not a silent truncation to 1."""
    ckpt, good = f32_dump

    def fractional(t):
        ids = t["input/input_ids"].astype(np.float32)
        ids[0, 1] = 1.5
        t["input/input_ids"] = ids
    bad = rewrite(good, tmp_path / "frac.safetensors", fractional)
    with pytest.raises(ValueError, match=r"'input/input_ids' expected integers, got dtype float32 with fractional"):
        verify.verify_dump(ckpt, bad)


def test_npz_with_a_string_array_is_refused_naming_it(tmp_path):
    """A dump's tensors are numbers: an .npz holding a string array is a ValueError naming the file and the tensor."""
    np.savez(tmp_path / "s.npz", **{"input/input_ids": np.zeros((2, 4), np.int64), "output/logits": np.array(["a"])})
    with pytest.raises(ValueError, match=r"s\.npz', tensor 'output/logits' expected a numeric array, got dtype <U1"):
        verify.read_dump(tmp_path / "s.npz")


def rows_of(failing, keys):
    """Rows as compare() makes them (key, ok, note) for `keys`, those in `failing` not ok."""
    return [dict(key=k, ok=k not in failing, note="") for k in keys]


def test_locate_walks_the_backward_from_the_last_layer():
    """Gradients failing in layers 0 and 1 of a 2-layer model, forward right: the backward computes layer 1's before
    layer 0's (locate's docstring), so layer 1 is where the bug is, whatever order the rows come in."""
    g = "grad/bert.encoder.layer.{}.attention.self.query.weight"
    keys = ["output/logits", "hidden_states/0", "hidden_states/1", "hidden_states/2", g.format(0), g.format(1),
            "grad/bert.embeddings.word_embeddings.weight"]
    where = verify.locate(rows_of({g.format(0), g.format(1)}, keys), 2)
    assert where["where"] == "layer 1" and where["key"] == g.format(1)


def test_locate_forward_failures():
    """hidden_states/0 is the embeddings' output; a failing non-loss output comes before the loss computed from it;
    with hidden_states/L agreeing that output is the head's, with no hidden states the place is only "the forward"."""
    hs = ["hidden_states/0", "hidden_states/1", "hidden_states/2"]
    outs = ["output/loss", "output/logits"]                       # the loss listed first: still the logits
    assert verify.locate(rows_of({"hidden_states/0", "hidden_states/1"}, outs + hs), 2)["where"] == "embeddings"
    first = verify.locate(rows_of(set(outs), outs + hs), 2)
    assert first["where"] == "the head" and first["key"] == "output/logits"
    first = verify.locate(rows_of(set(outs), outs), 2)
    assert first["where"] == "the forward" and first["key"] == "output/logits"
    assert verify.locate(rows_of({"output/logits"}, ["output/logits"]), 2)["where"] == "the forward"


def test_compare_error_and_tolerance_columns_by_hand():
    """compare()'s columns from its docstring, by hand, factor 10: ref (2, -4), got (2, -4.5), noise 0.01: error
    = 0.5 / 4 = 0.125 and tolerance = 10 x 0.01 / 4 = 0.025 (fails: 0.5 > 0.1); a key 0 in exact arithmetic, ref 0,
    got 5e-3, noise 1e-3: judged in units of its noise, error 5 and tolerance 10 (passes); a tensor whose largest
    entry (1e-5) is under its noise (1e-3): the same, got 1e-5 + 2e-3 gives error 2, tolerance 10."""
    ref = {"a": np.array([2.0, -4.0]), "z": np.zeros(3), "small": np.array([1e-5])}
    got = {"a": np.array([2.0, -4.5]), "z": np.full(3, 5e-3), "small": np.array([1e-5 + 2e-3])}
    noise = {"a": 0.01, "z": 1e-3, "small": 1e-3}
    rows = {r["key"]: r for r in verify.compare(ref, got, {}, noise, 10.0, zeros=("z",))}
    assert rows["a"]["error"] == pytest.approx(0.125, rel=1e-12) and rows["a"]["tolerance"] == pytest.approx(0.025)
    assert not rows["a"]["ok"]
    assert rows["z"]["error"] == pytest.approx(5.0, rel=1e-12) and rows["z"]["tolerance"] == pytest.approx(10.0)
    assert rows["z"]["ok"] and rows["z"]["note"] == "0 in exact arithmetic"
    assert rows["small"]["error"] == pytest.approx(2.0, rel=1e-9) and rows["small"]["tolerance"] == pytest.approx(10.0)
    assert rows["small"]["ok"]
    table = verify.format_rows(list(rows.values()))
    assert "1.25e-01" in table and "2.50e-02" in table and "5.00e+00" in table and "1.00e+01" in table
