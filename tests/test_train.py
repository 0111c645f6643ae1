"""The commands end to end on tiny settings: demo data, pretrain (and its bit-exact resume), finetune, predict,
fill-mask, embed — and the user errors they must report without a traceback, losing nothing already saved."""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from refbert import cli  # noqa: E402
from refbert.config import BertConfig  # noqa: E402


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo data, cut down: 150 documents of corpus and 200 rows per fine-tuning set."""
    d = tmp_path_factory.mktemp("demo")
    assert cli.main(["demo-data", str(d)]) == 0
    docs = (d / "corpus.txt").read_text().split("\n\n")
    (d / "small.txt").write_text("\n\n".join(docs[:150]) + "\n")
    for name in os.listdir(d):
        if name.endswith(".jsonl"):
            lines = (d / name).read_text().splitlines()
            (d / name).write_text("\n".join(lines[:200]) + "\n")
    cfg = BertConfig(vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    cfg.to_json_file(str(d / "config.json"))
    assert cli.main(["vocab", str(d / "small.txt"), "--out", str(d / "tok"), "--vocab-size", "400"]) == 0
    return d


def pretrain_args(demo, out, *extra):
    return ["pretrain", "--corpus", str(demo / "small.txt"), "--out", str(out), "--vocab", str(demo / "tok" / "vocab.txt"),
            "--config", str(demo / "config.json"), "--max-seq-length", "32", "--batch-size", "8", "--steps", "12",
            "--save-every", "4", "--eval-every", "4", "--lr", "3e-3", *extra]


def rows(path, drop=("tokens_per_s", "step_ms")):          # (timings: never equal across runs)
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in drop} for r in csv.DictReader(f)]


def test_demo_data_schema(demo):
    first = {n: json.loads((demo / f"{n}_train.jsonl").read_text().splitlines()[0])
             for n in ("classification", "pair", "ner", "qa")}
    assert set(first["classification"]) == {"text", "label"}
    assert set(first["pair"]) == {"text_a", "text_b", "label"}
    assert len(first["ner"]["tokens"]) == len(first["ner"]["tags"])
    qa = first["qa"]
    assert qa["context"][qa["answer_start"]:][:len(qa["answer_text"])] == qa["answer_text"]
    docs = (demo / "corpus.txt").read_text().strip().split("\n\n")
    assert len(docs) > 500 and all(line.strip() for d in docs for line in d.split("\n"))


def test_pretrain_then_resume_is_bit_exact(demo, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert cli.main(pretrain_args(demo, full)) == 0
    assert cli.main(pretrain_args(demo, cut, "--stop-after", "6")) == 0       # "killed" after step 6
    assert json.load(open(cut / "latest.json")) == {"checkpoint": "checkpoint-0000004"}
    assert cli.main(pretrain_args(demo, cut, "--resume")) == 0                # continues from step 4
    assert rows(full / "log.csv") == rows(cut / "log.csv")                    # the same losses, every step
    assert len(rows(full / "log.csv")) == 12
    # step_ms times the step alone, a part of the iteration whose time tokens_per_s reports (its batch's real
    # tokens over the iteration's seconds, truncated to an integer: the iteration's time read back is never less)
    timed = rows(full / "log.csv", drop=())
    from refbert import train as T
    from refbert.tokenization import BertTokenizer
    a = json.load(open(full / "checkpoint-0000012" / "trainer_state.json"))["args"]
    data = T.pretraining_data(a, BertTokenizer(a["vocab"], do_lower_case=not a["cased"]))[0]
    batches = [b for e in range(3) for b in data.batches(e, a["batch_size"])][:12]    # (the run's order of batches)
    tokens = [int(np.sum(b["attention_mask"])) for b in batches]
    assert len(tokens) == len(timed) == 12
    assert all(0 < float(r["step_ms"]) <= 1e3 * n / int(r["tokens_per_s"]) for r, n in zip(timed, tokens)), timed
    from refbert import safetensors_io
    a = safetensors_io.load_file(str(full / "model" / "model.safetensors"))
    b = safetensors_io.load_file(str(cut / "model" / "model.safetensors"))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # at most two checkpoints kept; the final model, the curves and the eval log are there
    assert sorted(p for p in os.listdir(full) if p.startswith("checkpoint-")) == ["checkpoint-0000008", "checkpoint-0000012"]
    assert (full / "loss.png").stat().st_size > 1000 and len(rows(full / "eval.csv")) == 3


def test_pretrained_model_loads_in_hf(demo, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    assert cli.main(pretrain_args(demo, out, "--steps", "2")) == 0
    hf = transformers.BertForPreTraining.from_pretrained(out / "model")
    tok = transformers.BertTokenizerFast.from_pretrained(out / "model")
    assert hf.config.vocab_size == len(tok)


def test_a_killed_run_keeps_its_latest_checkpoint(demo, tmp_path):
    out = tmp_path / "killed"
    args = pretrain_args(demo, out, "--steps", "400", "--save-every", "1")
    p = subprocess.Popen([sys.executable, "-m", "refbert", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoint-0000003").exists():
        time.sleep(0.05)
    time.sleep(0.3)                                   # somewhere in the middle of later saves
    p.send_signal(signal.SIGKILL)
    p.wait()
    latest = json.load(open(out / "latest.json"))["checkpoint"]
    import refbert
    refbert.BertForPreTraining.from_pretrained(str(out / latest))  # complete and loadable
    assert cli.main(pretrain_args(demo, out, "--resume", "--steps", "400", "--save-every", "1", "--stop-after",
                                  str(int(latest.split("-")[1]) + 1), "--allow-changed-schedule")) == 0


@pytest.mark.parametrize("task, metric", [("classification", "accuracy"), ("pair", "accuracy"), ("ner", "f1"),
                                          ("qa", "f1")])
def test_finetune_every_task_and_predict(demo, tmp_path, task, metric, capsys):
    pre = tmp_path / "pre"
    assert cli.main(pretrain_args(demo, pre, "--steps", "2")) == 0
    out = tmp_path / task
    assert cli.main(["finetune", "--task", task, "--train", str(demo / f"{task}_train.jsonl"), "--dev",
                     str(demo / f"{task}_dev.jsonl"), "--init", str(pre / "model"), "--out", str(out),
                     "--epochs", "1", "--batch-size", "16", "--max-seq-length", "64"]) == 0
    ev = rows(out / "eval.csv")
    assert len(ev) == 1 and 0.0 <= float(ev[0][metric]) <= 1.0
    assert (out / "best" / "model.safetensors").exists()
    capsys.readouterr()
    q = json.loads((demo / f"{task}_dev.jsonl").read_text().splitlines()[0])
    args = {"classification": ["--text", q.get("text", "")], "pair": ["--text", q.get("text_a", ""), "--text-pair",
            q.get("text_b", "")], "ner": ["--text", " ".join(q.get("tokens", []))],
            "qa": ["--question", q.get("question", ""), "--context", q.get("context", "")]}[task]
    assert cli.main(["predict", str(out / "best"), *args]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"classification": "label", "pair": "label", "ner": "tags", "qa": "answer"}[task] in res


def test_fill_mask_and_embed(demo, tmp_path, capsys):
    pre = tmp_path / "pre"
    assert cli.main(pretrain_args(demo, pre, "--steps", "2")) == 0
    capsys.readouterr()
    assert cli.main(["fill-mask", str(pre / "model"), "return the [MASK] of the file.", "--top-k", "3"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(res["masks"]) == 1 and len(res["masks"][0]) == 3
    # a [MASK] that truncation drops is said as such (the text has one)
    assert cli.main(["fill-mask", str(pre / "model"), "the file " * 10 + "[MASK]", "--max-seq-length", "8"]) == 2
    assert "expected a [MASK] within the first 8 tokens (--max-seq-length), got one at token" in \
        capsys.readouterr().err
    assert cli.main(["embed", str(pre / "model"), "--text", "open a file", "--text", "close it",
                     "--out", str(tmp_path / "e.npy")]) == 0
    assert np.load(tmp_path / "e.npy").shape == (2, 32)


# --- user errors: one line, exit 2, nothing lost ----------------------------------------------------------------

@pytest.fixture
def fails(capsys):
    """fails(argv, match): the command exits 2 with `match` in its one-line message and no traceback."""
    def check(argv, match):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err
    return check


def test_user_errors(demo, tmp_path, fails):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    fails(pretrain_args(demo, tmp_path / "e", "--corpus", str(empty)), "expected at least one")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "precious.txt").write_text("keep me")
    fails(pretrain_args(demo, taken), "exists and is not empty")
    assert (taken / "precious.txt").read_text() == "keep me"
    fails(["pretrain", "--out", str(tmp_path / "r"), "--resume"], "latest.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine", "label": "a"}\n{"text": "no label"}\n')
    pre = tmp_path / "pre"
    assert cli.main(pretrain_args(demo, pre, "--steps", "1")) == 0
    fails(["finetune", "--task", "classification", "--train", str(bad), "--dev", str(bad), "--init",
           str(pre / "model"), "--out", str(tmp_path / "f")], "bad.jsonl, line 2")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine", "label": "a"}\n{not json\n')
    fails(["finetune", "--task", "classification", "--train", str(broken), "--dev", str(broken), "--init",
           str(pre / "model"), "--out", str(tmp_path / "g")], "line 2: expected a JSON object")
    fails(["finetune", "--task", "summarise", "--train", str(bad), "--dev", str(bad), "--init", str(pre / "model"),
           "--out", str(tmp_path / "h")], "--task: expected one of classification, pair, ner, qa")
    novocab = tmp_path / "vocab.txt"
    novocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n")
    fails(pretrain_args(demo, tmp_path / "v", "--vocab", str(novocab)), "[MASK]")


def test_vocab_order_is_a_function_of_the_token_set(demo, tmp_path):
    # the tokenizers trainer orders frequency ties by a hash map, differently from run to run; refbert writes the
    # specials first and sorts the rest, so the ids depend only on which tokens were learned (which tokens win a
    # tie at the vocabulary-size cut-off can still vary: a run saves its vocab, and --vocab pins one)
    assert cli.main(["vocab", str(demo / "small.txt"), "--out", str(tmp_path / "v"), "--vocab-size", "300"]) == 0
    lines = (tmp_path / "v" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(lines) == 300
    key = lambda t: (len(t.removeprefix("##")) > 1, t.startswith("##"), t)  # noqa: E731  (single chars first)
    assert lines[5:] == sorted(lines[5:], key=key)


def test_continue_pretraining_from_an_hf_folder(demo, tmp_path):
    """--init: general -> domain. An HF-saved BertForPreTraining (weights + tokenizer) continues on new text."""
    transformers = pytest.importorskip("transformers")
    import torch
    hf_dir = tmp_path / "hf"
    cfg = json.loads((demo / "config.json").read_text())
    torch.manual_seed(0)
    transformers.BertForPreTraining(transformers.BertConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
                                    ).save_pretrained(hf_dir)
    transformers.BertTokenizerFast.from_pretrained(demo / "tok").save_pretrained(hf_dir)
    out = tmp_path / "domain"
    assert cli.main(["pretrain", "--corpus", str(demo / "small.txt"), "--init", str(hf_dir), "--out", str(out),
                     "--max-seq-length", "32", "--batch-size", "8", "--steps", "3"]) == 0
    from refbert import safetensors_io
    before = safetensors_io.load_file(str(hf_dir / "model.safetensors"))
    after = safetensors_io.load_file(str(out / "model" / "model.safetensors"))
    key = "bert.encoder.layer.0.attention.self.query.weight"
    assert before[key].shape == after[key].shape and not np.array_equal(before[key], after[key])  # trained on


def test_more_user_errors(demo, tmp_path, fails):
    pre = tmp_path / "pre"
    assert cli.main(pretrain_args(demo, pre, "--steps", "2")) == 0
    fails(["predict", str(pre / "model"), "--text", "hello"], "has no classification head")
    missing = tmp_path / "missing.csv"
    missing.write_text("text,label\nhello world,a\nshort row\n")
    fails(["finetune", "--task", "classification", "--train", str(missing), "--dev", str(missing), "--init",
           str(pre / "model"), "--out", str(tmp_path / "m")], "missing.csv, line 3: expected a value")
    ints = tmp_path / "ints.jsonl"
    ints.write_text('{"tokens": ["a", "b"], "tags": [0, 1]}\n')
    fails(["finetune", "--task", "ner", "--train", str(ints), "--dev", str(ints), "--init", str(pre / "model"),
           "--out", str(tmp_path / "n")], "lists of strings")
    fails(["finetune", "--task", "classification", "--train", str(demo / "classification_train.jsonl"), "--dev",
           str(demo / "classification_dev.jsonl"), "--init", str(pre / "model"), "--out", str(tmp_path / "o"),
           "--max-seq-length", "65"], "expected at most 64")
    assert not (tmp_path / "o").exists()               # refused before anything was written
    cut = tmp_path / "cut"
    assert cli.main(pretrain_args(demo, cut, "--stop-after", "5")) == 0
    fails(["pretrain", "--out", str(cut), "--resume", "--steps", "3"], "expected at least 4")
    clf = tmp_path / "clf"
    assert cli.main(["finetune", "--task", "classification", "--train", str(demo / "classification_train.jsonl"),
                     "--dev", str(demo / "classification_dev.jsonl"), "--init", str(pre / "model"), "--out",
                     str(clf), "--epochs", "1", "--max-seq-length", "32"]) == 0
    fails(["fill-mask", str(clf / "best"), "a [MASK] b"], "expected an MLM head")
    fails(["predict", str(clf / "best"), "--text", "a", "--text", "b", "--text-pair", "c"], "one --text-pair per")
    afile = tmp_path / "afile"
    afile.write_text("x")
    fails(pretrain_args(demo, afile), "which is a file")
    with pytest.raises(SystemExit):                    # argparse: "expected an integer >= 1"
        cli.main(pretrain_args(demo, tmp_path / "z", "--batch-size", "0"))
    # what a bad-input sweep found: checked late (after the run folder was made), named by a library, or not at all
    ft = ["finetune", "--task", "classification", "--train", str(demo / "classification_train.jsonl"), "--dev",
          str(demo / "classification_dev.jsonl"), "--init", str(pre / "model"), "--out", str(tmp_path / "q"),
          "--max-seq-length", "32"]
    for flag, value in (("--lr", "-1"), ("--lr", "nan"), ("--seed", "-1")):
        with pytest.raises(SystemExit):                # argparse: "expected a finite number > 0" / "an integer >= 0"
            cli.main(ft + [flag, value])
    fails(["finetune", "--task", "pair", "--train", str(demo / "pair_train.jsonl"), "--dev",
           str(demo / "pair_dev.jsonl"), "--init", str(pre / "model"), "--out", str(tmp_path / "q"),
           "--max-seq-length", "4"],
          "--max-seq-length: expected at least 5 for task 'pair'")
    rows = {"one.jsonl": ('{"text": "a b", "label": "x"}\n' * 2, "expected at least two labels to tell apart, got "
                                                                 "one ('x')"),
            "num.jsonl": ('{"text": 5, "label": "x"}\n', "num.jsonl, line 1: expected 'text' to be a string, got int"),
            "bin.jsonl": (None, "bin.jsonl: expected UTF-8 text, got a byte that is not UTF-8 at offset 0")}
    for name, (text, match) in rows.items():
        f = tmp_path / name
        f.write_bytes(b"\xe0\xff{}\n") if text is None else f.write_text(text)
        fails(ft[:4] + [str(f), "--dev", str(f)] + ft[7:], match)
    neg = tmp_path / "neg.jsonl"
    neg.write_text('{"question": "q", "context": "c a", "answer_text": "a", "answer_start": -5}\n')
    fails(["finetune", "--task", "qa", "--train", str(neg), "--dev", str(neg), "--init", str(pre / "model"), "--out",
           str(tmp_path / "r")], "neg.jsonl, line 1: expected 'answer_start' >= 0 (a character offset into 'context')"
                                 ", got -5")
    assert not any((tmp_path / d).exists() for d in "qr")


def test_best_is_swapped_atomically(tmp_path):
    """Saving `best` again replaces it through a symlink swap: always a whole model, old versions removed."""
    import refbert
    from refbert.train import save_checkpoint
    cfg = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                     max_position_embeddings=16)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(25)]) + "\n")
    tok = refbert.BertTokenizer(str(vocab))
    out = tmp_path / "run"
    out.mkdir()
    for seed in (1, 2, 3):
        save_checkpoint(str(out), "best", refbert.BertModel(cfg, seed=seed), tok)
        again = refbert.BertModel.from_pretrained(str(out / "best"))
        want = refbert.BertModel(cfg, seed=seed).parameters()
        assert all(np.array_equal(again.parameters()[k], want[k]) for k in want)
    assert os.path.islink(out / "best") and sorted(os.listdir(out)) == ["best", "best-0003"]


def test_argument_errors_come_before_anything_is_written(demo, tmp_path, fails):
    y = tmp_path / "y"
    init = tmp_path / "init"
    init.mkdir()
    BertConfig.from_json_file(demo / "config.json").to_json_file(init)
    cfg300 = tmp_path / "c300.json"
    cfg300.write_text(json.dumps({**json.loads((demo / "config.json").read_text()), "vocab_size": 300}))
    small = str(demo / "small.txt")
    cases = [
        (["pretrain", "--init", str(init), "--out", str(y)], "--corpus: expected a text file to pretrain on"),
        (["pretrain", "--corpus", str(tmp_path / "none.txt"), "--out", str(y)], "--corpus: expected an existing file"),
        (pretrain_args(demo, y, "--vocab", str(tmp_path / "v.txt")), "--vocab: expected an existing file"),
        (["pretrain", "--corpus", small, "--init", str(init), "--vocab", str(demo / "tok" / "vocab.txt"),
          "--out", str(y)], "--init: the folder brings its own vocabulary and config; drop --vocab"),
        (["pretrain", "--corpus", small, "--init", str(demo / "tok"), "--out", str(y)], "with config.json"),
        (["pretrain", "--corpus", small, "--preset", "huge", "--out", str(y)], "--preset: expected one of tiny"),
        (pretrain_args(demo, y, "--mlm-prob", "1.5"), "--mlm-prob: expected a probability in (0, 1], got 1.5"),
        (pretrain_args(demo, y, "--lr", "-1"), "--lr: expected a positive finite learning rate"),
        (pretrain_args(demo, y, "--max-seq-length", "65"), "--max-seq-length: expected at most 64"),
        (pretrain_args(demo, y, "--config", str(cfg300)), "--config: vocab_size 300 does not match"),
        (pretrain_args(demo, y, "--steps", "2", "--warmup", "100"), "--warmup: expected at most --steps (2) warmup "
                                                                    "steps"),
        (["pretrain", "--corpus", small, "--vocab", str(demo / "tok" / "vocab.txt"), "--preset", "tiny",
          "--max-seq-length", "100000", "--out", str(y)], "--max-seq-length / --batch-size: one layer's attention "
                                                          "probabilities (B, H, T, T) = (32, "),
        (pretrain_args(demo, y, "--cuda-graph"), "--cuda-graph: expected --backend cuda (the training step "
                                                  "captured as a CUDA graph), got --backend numpy"),
        # a vocabulary trained on the corpus first, then refused: it is trained outside --out and removed
        (["pretrain", "--corpus", small, "--config", str(cfg300), "--vocab-size", "400", "--max-seq-length", "32",
          "--out", str(y)], "--config: vocab_size 300 does not match"),
    ]
    for argv, match in cases:
        fails(argv, match)
        assert not y.exists(), argv


def test_resume_refuses_changed_arguments(demo, tmp_path, fails):
    cut = tmp_path / "cut"
    assert cli.main(pretrain_args(demo, cut, "--steps", "4", "--save-every", "2", "--stop-after", "2")) == 0
    before = {p: (cut / p).read_bytes() for p in ("log.csv", "latest.json")}
    fails(pretrain_args(demo, cut, "--resume", "--lr", "1e-3", "--batch-size", "4", "--steps", "4",
                        "--save-every", "2"),
          "refusing to change --batch-size from 8 to 4, --lr from 0.003 to 0.001; a resumed run continues exactly "
          "as it started")
    fails(["pretrain", "--out", str(cut), "--resume", "--steps", "6"],
          "refusing to change --steps from 4 to 6; a resumed run continues exactly as it started "
          "(--allow-changed-schedule lets --steps")
    fails(["pretrain", "--out", str(cut), "--resume", "--seed", "1", "--allow-changed-schedule"],
          "refusing to change --seed from 0 to 1")
    assert before == {p: (cut / p).read_bytes() for p in before}          # refused: nothing written
    # the schedule may change when asked for: the run goes on to 6 steps, the same first 4 as before
    assert cli.main(["pretrain", "--out", str(cut), "--resume", "--steps", "6", "--allow-changed-schedule"]) == 0
    assert [int(r["step"]) for r in rows(cut / "log.csv")] == [1, 2, 3, 4, 5, 6]
    state = json.load(open(cut / json.load(open(cut / "latest.json"))["checkpoint"] / "trainer_state.json"))
    assert state["step"] == 6 and state["args"]["steps"] == 6 and state["args"]["lr"] == 3e-3


def test_pretrain_on_the_numba_backend_gives_the_numpy_losses(demo, tmp_path):
    """`refbert pretrain --backend numba` (dropout on, the labelled-positions decoder) logs the numpy backend's
    losses: the same Philox masks, float32 kernels within 1e-5 of the oracle per op, so over 12 AdamW steps the losses
    agree to ~1e-4 relative (float32 rounding, amplified by the optimizer's steps), and the eval rows likewise."""
    pytest.importorskip("numba")
    runs = {}
    for backend in ("numpy", "numba"):
        assert cli.main(pretrain_args(demo, tmp_path / backend, "--backend", backend)) == 0
        runs[backend] = rows(tmp_path / backend / "log.csv")
    assert len(runs["numba"]) == len(runs["numpy"]) == 12
    for a, b in zip(runs["numba"], runs["numpy"]):
        assert a["step"] == b["step"] and a["lr"] == b["lr"]
        for k in ("loss", "mlm_loss", "nsp_loss"):
            assert float(a[k]) == pytest.approx(float(b[k]), rel=1e-4, abs=1e-5), (a["step"], k)


class _FailAt:
    """clip_grad_norm that raises at its n-th call (a crash inside training step n: Numba missing SciPy's BLAS,
    say), and is the real one before."""

    def __init__(self, n):
        from refbert import optim
        self.n, self.calls, self.real = n, 0, optim.clip_grad_norm

    def __call__(self, grads, max_norm):
        self.calls += 1
        if self.calls >= self.n:
            raise RuntimeError("a crash inside the step")
        return self.real(grads, max_norm)


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_out(demo, tmp_path, monkeypatch, capsys):
    from refbert import train
    out = tmp_path / "run"
    args = ["pretrain", "--corpus", str(demo / "small.txt"), "--out", str(out), "--config", str(demo / "config.json"),
            "--vocab-size", "400", "--max-seq-length", "32", "--batch-size", "8", "--steps", "3", "--save-every", "2"]
    monkeypatch.setattr(train, "clip_grad_norm", _FailAt(1))          # inside the first step
    with pytest.raises(RuntimeError, match="a crash inside the step"):
        cli.main(args)
    assert not out.exists()                                             # log.csv, eval.csv, tokenizer/: all gone
    assert "stopped before its first checkpoint; removed" in capsys.readouterr().err
    # an empty folder that was there stays, empty
    out.mkdir()
    with pytest.raises(RuntimeError):
        cli.main(args)
    assert out.is_dir() and os.listdir(out) == []
    # so the same command simply runs again
    monkeypatch.setattr(train, "clip_grad_norm", _FailAt(10 ** 9))
    assert cli.main(args) == 0 and (out / "model" / "model.safetensors").exists()
    # after its first checkpoint, a failing run stays, and --resume continues it
    out2 = tmp_path / "run2"
    monkeypatch.setattr(train, "clip_grad_norm", _FailAt(3))          # step 3, after checkpoint-0000002
    with pytest.raises(RuntimeError):
        cli.main([*args[:4], str(out2), *args[5:]])
    assert json.load(open(out2 / "latest.json")) == {"checkpoint": "checkpoint-0000002"}
    monkeypatch.setattr(train, "clip_grad_norm", _FailAt(10 ** 9))
    assert cli.main(["pretrain", "--out", str(out2), "--resume"]) == 0
    assert [int(r["step"]) for r in rows(out2 / "log.csv")] == [1, 2, 3]
    # --stop-after before the first checkpoint: nothing to resume from, so nothing is left either
    out3 = tmp_path / "run3"
    assert cli.main([*args[:4], str(out3), *args[5:], "--stop-after", "1"]) == 0
    assert not out3.exists()


def test_a_finetune_that_fails_before_its_first_best_model_leaves_no_out(demo, tmp_path, monkeypatch):
    from refbert import train
    pre = tmp_path / "pre"
    assert cli.main(pretrain_args(demo, pre, "--steps", "2")) == 0
    out = tmp_path / "cls"
    args = ["finetune", "--task", "classification", "--train", str(demo / "classification_train.jsonl"), "--dev",
            str(demo / "classification_dev.jsonl"), "--init", str(pre / "model"), "--out", str(out), "--epochs", "2",
            "--batch-size", "64", "--max-seq-length", "32"]
    monkeypatch.setattr(train, "clip_grad_norm", _FailAt(2))          # in the first epoch (200 rows: 4 steps)
    with pytest.raises(RuntimeError):
        cli.main(args)
    assert not out.exists()
    monkeypatch.setattr(train, "clip_grad_norm", _FailAt(6))          # in the second epoch, after the first best
    with pytest.raises(RuntimeError):
        cli.main(args)
    assert (out / "best" / "model.safetensors").exists()


def test_demo_data_is_the_same_in_any_process(demo, tmp_path):
    """demo-data walks the standard library in a fresh interpreter: inside pytest (which has imported much more,
    and asked concurrent.futures for its lazily loaded executors) it writes what the command line writes, with
    another hash seed."""
    import concurrent.futures
    concurrent.futures.ThreadPoolExecutor, concurrent.futures.ProcessPoolExecutor   # noqa: B018 (loads them)
    from refbert.demo import write_demo_data
    write_demo_data(tmp_path / "here")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-m", "refbert", "demo-data", str(tmp_path / "cli")], env=env, check=True,
                   capture_output=True)
    names = sorted(os.listdir(tmp_path / "cli"))
    assert names == sorted(os.listdir(tmp_path / "here")) and "corpus.txt" in names
    for name in names:
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name


def test_a_vocabulary_trained_twice_is_the_same(demo, tmp_path):
    """The tokenizers trainer breaks ties by ids it assigns in hash-map order; train_vocab fixes them first. On the
    demo corpus at 2,000 tokens, five trainings without that gave three different vocabularies."""
    from refbert.tokenization import train_vocab
    first = None
    for i in range(4):
        text = open(train_vocab([str(demo / "corpus.txt")], tmp_path / f"v{i}", vocab_size=2000), "rb").read()
        first = first or text
        assert text == first, f"training {i} gave another vocabulary"
    assert len(first.splitlines()) == 2000


def test_pretraining_is_the_same_under_any_hash_seed(demo, tmp_path):
    """Two `refbert pretrain` runs on the whole demo corpus, each training its own vocabulary, in processes with
    different PYTHONHASHSEED (run side by side): the same vocab.txt, the same number of sequences, bit-identical
    weights after a step. (T 16 and one step of 512 keep each run to a few seconds; the vocabulary and the data are
    what varied.)"""
    runs = {}
    for seed in ("1", "2"):
        out = tmp_path / f"run{seed}"
        runs[out] = subprocess.Popen(
            [sys.executable, "-m", "refbert", "pretrain", "--corpus", str(demo / "corpus.txt"), "--out", str(out),
             "--preset", "tiny", "--vocab-size", "2000", "--max-seq-length", "16", "--batch-size", "512", "--steps",
             "1"], env={**os.environ, "PYTHONHASHSEED": seed}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    lines = []
    for out, p in runs.items():
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr
        lines.append(next(line for line in stdout.splitlines() if line.startswith("pretraining ")))
    assert lines[0] == lines[1]                               # "... on N sequences (D documents; E held out) ..."
    a, b = runs
    for f in ("tokenizer/vocab.txt", "model/model.safetensors", "eval.csv"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_an_unanswerable_qa_row_may_carry_answer_start_minus_one(tmp_path):
    """SQuAD 2.0 writes answer_start -1 beside an empty answer_text: such a row is read (the >= 0 check is for rows
    with an answer)."""
    from refbert.train import read_rows
    f = tmp_path / "qa.jsonl"
    f.write_text('{"question": "q", "context": "c a", "answer_text": "", "answer_start": -1}\n'
                 '{"question": "q", "context": "c a", "answer_text": "a", "answer_start": 2}\n')
    assert [r["answer_start"] for r in read_rows(str(f), "qa")] == [-1, 2]


def test_resume_at_and_across_epoch_ends_is_bit_exact(demo, tmp_path):
    """At batch size 64 the 255 training sequences make 4 steps an epoch (the last batch 63), so a run of 11 steps
    saving every 2 checkpoints at an epoch's end (step 4) and in an epoch's middle (step 6). Stopped after step 5,
    resumed from step 4, stopped again after step 7, resumed from step 6 to the end (crossing the end of epoch 1):
    every logged row, every evaluation and the final weights are the uninterrupted run's, bit for bit. The
    checkpoints' positions are counted by hand; the learning rate logged at step s (the update at s - 1) is
    3e-3 times google's multiplier, warmup int(0.25 * 11) = 2 steps; evaluations every 3 steps and at the last."""
    args = ("--batch-size", "64", "--steps", "11", "--save-every", "2", "--eval-every", "3", "--warmup", "0.25")
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert cli.main(pretrain_args(demo, full, *args)) == 0
    assert cli.main(pretrain_args(demo, cut, *args, "--stop-after", "5")) == 0
    state = json.load(open(cut / "checkpoint-0000004" / "trainer_state.json"))
    assert (state["step"], state["epoch"], state["batch"]) == (4, 1, 0)          # epoch 0 done: epoch 1 next
    assert cli.main(["pretrain", "--out", str(cut), "--resume", "--stop-after", "7", "--allow-changed-schedule"]) == 0
    state = json.load(open(cut / "checkpoint-0000006" / "trainer_state.json"))
    assert (state["step"], state["epoch"], state["batch"]) == (6, 1, 2)          # two batches of epoch 1 done
    assert cli.main(["pretrain", "--out", str(cut), "--resume"]) == 0
    assert rows(full / "log.csv") == rows(cut / "log.csv") and rows(full / "eval.csv") == rows(cut / "eval.csv")
    from refbert import safetensors_io
    a = safetensors_io.load_file(str(full / "model" / "model.safetensors"))
    b = safetensors_io.load_file(str(cut / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    log = rows(full / "log.csv")
    assert [int(r["step"]) for r in log] == list(range(1, 12))
    assert [int(r["epoch"]) for r in log] == [0] * 4 + [1] * 4 + [2] * 3
    want = [3e-3 * (s / 2 if s < 2 else 1 - s / 11) for s in range(11)]
    assert [float(r["lr"]) for r in log] == pytest.approx(want, rel=1e-5)       # (logged to 6 significant digits)
    assert [int(r["step"]) for r in rows(full / "eval.csv")] == [3, 6, 9, 11]
    assert json.load(open(full / "latest.json")) == {"checkpoint": "checkpoint-0000011"}
    assert sorted(p for p in os.listdir(full) if p.startswith("checkpoint-")) == ["checkpoint-0000010",
                                                                                  "checkpoint-0000011"]


def test_held_out_evaluation_is_in_eval_mode_and_weighted_by_sequence(demo):
    """evaluate_pretraining with heavy dropout (0.5) and batches of 4 over the 19 held-out sequences (the last
    batch 3): its NSP loss and accuracy are those of one eval-mode forward over all 19 at once (dropout off; each
    batch's mean weighted by its sequences), within float32 summation order (1e-5 relative); it leaves the model
    in train mode, as it found it."""
    from refbert import model as M
    from refbert import train as T
    from refbert.defaults import PRETRAIN
    from refbert.tokenization import BertTokenizer
    a = {**PRETRAIN, "corpus": str(demo / "small.txt"), "max_seq_length": 32}
    tok = BertTokenizer(str(demo / "tok" / "vocab.txt"))
    eval_data = T.pretraining_data(a, tok)[1]
    cfg = BertConfig.from_json_file(str(demo / "config.json"))
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.5
    model = M.BertForPreTraining(cfg, seed=3).train()
    got = T.evaluate_pretraining(model, eval_data, 4)
    assert model.training
    (whole,) = list(eval_data.batches(0, 64))
    assert len(whole["input_ids"]) == 19
    model.eval()
    with M.no_grad():
        want = T.pretraining_metrics(model(**whole), whole)
    assert got["nsp_loss"] == pytest.approx(want["nsp_loss"], rel=1e-5)
    assert got["nsp_acc"] == pytest.approx(want["nsp_acc"], rel=1e-12)


def test_apply_clips_the_gradients_to_norm_one_and_returns_the_norm_before():
    """_apply hands the optimizer gradients scaled to global norm 1 (torch's clip_coef 1 / (norm + 1e-6): within
    1e-6 of 1) with this step's learning rate, and returns the norm before clipping: 5 for (3, 0, 4), by hand. A
    set already under norm 1 passes unscaled."""
    from refbert import train as T

    class Recorder:
        def step(self, grads, lr=None):
            self.grads, self.lr = {k: v.copy() for k, v in grads.items()}, lr

    opt = Recorder()
    grads = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}
    assert T._apply(grads, opt, T._scaler("no"), 0.25) == pytest.approx(5.0, rel=1e-15)
    assert opt.lr == 0.25
    np.testing.assert_allclose(opt.grads["a"], [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(opt.grads["b"], [[0.8]], rtol=1e-6)
    small = {"a": np.array([0.3, 0.0]), "b": np.array([[0.4]])}
    assert T._apply(small, opt, T._scaler("no"), 0.5) == pytest.approx(0.5, rel=1e-15)
    assert np.array_equal(opt.grads["a"], [0.3, 0.0]) and np.array_equal(opt.grads["b"], [[0.4]])


def test_a_checkpoint_never_appears_half_written(demo, tmp_path, monkeypatch):
    """While a checkpoint's files are being written (watched at every safetensors write), neither its folder nor
    latest.json's pointer to it exists yet: they appear whole, after; the previous checkpoint stays until then."""
    import refbert
    from refbert import safetensors_io
    from refbert import train as T
    cfg = BertConfig.from_json_file(str(demo / "config.json"))
    model = refbert.BertForPreTraining(cfg, seed=0)
    tok = refbert.BertTokenizer(str(demo / "tok" / "vocab.txt"))
    opt = T.AdamW(model.parameters(), lr=1e-3)
    out = tmp_path / "run"
    out.mkdir()
    T.save_checkpoint(str(out), "checkpoint-0000001", model, tok, opt, dict(step=1))
    real, seen = safetensors_io.save_file, []

    def watched(arrays, path, *args, **kw):
        seen.append(path)
        assert not (out / "checkpoint-0000002").exists(), "the checkpoint's folder exists before it is complete"
        assert json.load(open(out / "latest.json")) == {"checkpoint": "checkpoint-0000001"}
        assert (out / "checkpoint-0000001" / "optimizer.safetensors").exists()
        return real(arrays, path, *args, **kw)
    monkeypatch.setattr(safetensors_io, "save_file", watched)
    T.save_checkpoint(str(out), "checkpoint-0000002", model, tok, opt, dict(step=2))
    assert len(seen) == 2                                       # the model's weights and the optimizer's moments
    assert json.load(open(out / "latest.json")) == {"checkpoint": "checkpoint-0000002"}
    assert sorted(os.listdir(out)) == ["checkpoint-0000001", "checkpoint-0000002", "latest.json"]


def test_finetune_visits_every_row_once_an_epoch_and_logs_the_epoch_mean(demo, tmp_path, monkeypatch):
    """200 classification rows in batches of 16: 13 steps an epoch (the last of 8 rows), 26 in 2 epochs. Every
    training row is seen once in each epoch, in a shuffled order that differs between the epochs; log.csv has one
    row a step, its learning rate 1e-3 times google's multiplier with warmup int(0.1 * 26) = 2 steps; eval.csv's
    loss is the mean of the epoch's logged losses (6 decimals printed: within 1e-6)."""
    from refbert import model as M
    pre = tmp_path / "pre"
    assert cli.main(pretrain_args(demo, pre, "--steps", "1")) == 0
    seen, real = [], M.BertForSequenceClassification.__call__

    def record(self, *args, **kw):
        if self.training:
            seen.append(kw["input_ids"].copy())
        return real(self, *args, **kw)
    monkeypatch.setattr(M.BertForSequenceClassification, "__call__", record)
    out = tmp_path / "cls"
    assert cli.main(["finetune", "--task", "classification", "--train", str(demo / "classification_train.jsonl"),
                     "--dev", str(demo / "classification_dev.jsonl"), "--init", str(pre / "model"), "--out", str(out),
                     "--epochs", "2", "--batch-size", "16", "--max-seq-length", "32", "--lr", "1e-3"]) == 0
    assert [len(b) for b in seen] == ([16] * 12 + [8]) * 2
    from refbert.tokenization import BertTokenizer
    tok = BertTokenizer.from_pretrained(str(pre / "model"))
    texts = [json.loads(line)["text"] for line in (demo / "classification_train.jsonl").read_text().splitlines()]
    ids = tok(texts, padding="max_length", truncation=True, max_length=32, return_tensors="np")["input_ids"]
    key = lambda a: sorted(map(bytes, a.astype(np.int64)))                                  # noqa: E731
    epochs = [np.concatenate(seen[:13]), np.concatenate(seen[13:])]
    assert key(epochs[0]) == key(epochs[1]) == key(ids)                 # each row once an epoch
    assert not np.array_equal(epochs[0], ids) and not np.array_equal(epochs[0], epochs[1])  # shuffled, anew
    log = rows(out / "log.csv")
    assert [int(r["step"]) for r in log] == list(range(1, 27))
    assert [float(r["lr"]) for r in log] == pytest.approx([1e-3 * (s / 2 if s < 2 else 1 - s / 26)
                                                           for s in range(26)], rel=1e-5)   # (6 significant digits)
    ev = rows(out / "eval.csv")
    assert [(int(r["step"]), int(r["epoch"])) for r in ev] == [(13, 1), (26, 2)]
    for e, r in enumerate(ev):
        assert float(r["loss"]) == pytest.approx(np.mean([float(x["loss"]) for x in log[13 * e:13 * e + 13]]),
                                                 abs=1e-6)


def test_finetune_evaluation_runs_in_eval_mode():
    """evaluate's accuracy on labels that are the eval-mode (dropout off) predictions is 1, even with dropout 0.9
    (which, left on, would change many of 64 predictions)."""
    from refbert import model as M
    from refbert import train as T
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=16, hidden_dropout_prob=0.9, attention_probs_dropout_prob=0.9,
                     id2label={0: "a", 1: "b", 2: "c"})
    model = M.BertForSequenceClassification(cfg, seed=0)
    r = np.random.default_rng(0)
    arrays = dict(input_ids=r.integers(5, 40, (64, 12)), token_type_ids=np.zeros((64, 12), np.int64),
                  attention_mask=np.ones((64, 12), np.int64))
    with M.no_grad():
        arrays["labels"] = model.eval()(**arrays).logits.argmax(-1)
    model.train()
    assert T.evaluate(model, "classification", [{}] * 64, arrays, None, 16, cfg.id2label) == {"accuracy": 1.0}


def test_unigram_baseline_is_the_entropy_of_the_masked_tokens():
    """The MLM baseline printed and plotted: the entropy, in nats, of the labelled tokens' frequencies over the
    epoch-0 batches. Labels 7, 7, 8, 9 (ignored -100s aside) by hand: -(1/2 ln 1/2 + 2 * 1/4 ln 1/4) = 1.5 ln 2."""
    from refbert import train as T

    class Data:
        def batches(self, epoch, batch_size):
            assert epoch == 0
            yield {"labels": np.array([[7, -100, 7], [-100, 8, -100]])}
            yield {"labels": np.array([[9, -100, -100]])}

    class Tok:
        vocab = dict.fromkeys(range(12))
    assert T.unigram_baseline(Data(), Tok(), 2) == pytest.approx(1.5 * np.log(2), rel=1e-12)


def test_a_negative_or_nan_warmup_is_refused_before_anything_is_written(demo, tmp_path, fails):
    """--warmup takes any float on the command line: a negative or NaN one is refused by name, with what was
    expected and what came, and --out is not created."""
    y = tmp_path / "y"
    for value in ("-1", "nan"):
        fails(pretrain_args(demo, y, "--warmup", value),
              f"--warmup: expected a number of steps (or a fraction) >= 0, got {float(value)}")
        assert not y.exists()
