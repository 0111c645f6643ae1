"""`refbert pretrain / finetune --mixed-precision`: the spec trained on the CPU (tiny settings), resumed bit-exactly,
fp16's loss scaler in the loop and in the checkpoints."""
import json

import numpy as np
import pytest

from test_train import demo, pretrain_args, rows  # noqa: F401  (the module-scoped demo data, its skips)
from refbert import cli


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_mixed_pretrain_resumes_bit_exactly(demo, tmp_path, flag):  # noqa: F811
    """Stopped after step 6 and resumed from the checkpoint of step 4: every logged loss equal to the
    uninterrupted run's. The first step's loss is the float32 run's within 4 u (the same weights and batch: the
    forward's roundings alone; u = 2^-8 in bfloat16, 2^-11 in float16), the later ones only finite (the runs
    part as their updates differ)."""
    full, cut, f32 = tmp_path / "full", tmp_path / "cut", tmp_path / "f32"
    assert cli.main(pretrain_args(demo, full, "--mixed-precision", flag)) == 0
    assert cli.main(pretrain_args(demo, cut, "--mixed-precision", flag, "--stop-after", "6")) == 0
    assert cli.main(pretrain_args(demo, cut, "--mixed-precision", flag, "--resume")) == 0
    assert rows(full / "log.csv") == rows(cut / "log.csv") and len(rows(full / "log.csv")) == 12
    from refbert import safetensors_io                            # the final weights too, bit for bit
    a = safetensors_io.load_file(str(full / "model" / "model.safetensors"))
    b = safetensors_io.load_file(str(cut / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    final = [json.load(open(d / "checkpoint-0000012" / "trainer_state.json")) for d in (full, cut)]
    assert final[0].get("grad_scaler") == final[1].get("grad_scaler")   # the resumed scaler's state (fp16)
    assert cli.main(pretrain_args(demo, f32, "--steps", "1")) == 0
    u = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}[flag]
    first, ref = float(rows(full / "log.csv")[0]["loss"]), float(rows(f32 / "log.csv")[0]["loss"])
    assert first != ref and abs(first - ref) <= 4 * u * ref
    assert all(np.isfinite(float(r["loss"])) for r in rows(full / "log.csv"))
    state = json.load(open(full / "checkpoint-0000012" / "trainer_state.json"))
    assert state["args"]["mixed_precision"] == flag
    if flag == "fp16":
        assert state["grad_scaler"] == {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                        "growth_interval": 2000, "_growth_tracker": 12}
        assert {r["loss_scale"] for r in rows(full / "log.csv")} == {"65536"}
    else:
        assert "grad_scaler" not in state and "loss_scale" not in rows(full / "log.csv")[0]


def test_fp16_resume_reads_the_scaler_and_skips_overflowing_steps(demo, tmp_path):  # noqa: F811
    """The scaler's state comes back from the checkpoint: set to 2^24 there, the resumed run's next step uses
    2^24, overflows float16 (its activation gradients pass 65504: the uninterrupted run, at 2^16, did not), skips
    its update (the gradient norm is NaN) and halves the scale, step after step, until the gradients are finite
    again (by 2^16 at the latest); from there the scale stays."""
    cut, args = tmp_path / "cut", ("--mixed-precision", "fp16", "--save-every", "2")
    assert cli.main(pretrain_args(demo, cut, *args, "--stop-after", "2")) == 0
    path = cut / "checkpoint-0000002" / "trainer_state.json"
    state = json.load(open(path))
    state["grad_scaler"]["scale"] = 2.0 ** 24
    path.write_text(json.dumps(state))
    assert cli.main(pretrain_args(demo, cut, *args, "--resume")) == 0
    log = rows(cut / "log.csv")[2:]
    scales = [float(r["loss_scale"]) for r in log]
    skipped = [r["grad_norm"] == "nan" for r in log]
    assert scales[0] == 2.0 ** 24 and skipped[0]
    n = skipped.index(False)                                 # the first finite step
    assert n <= 8 and all(skipped[:n]) and not any(skipped[n:])
    assert scales == [2.0 ** (24 - i) for i in range(n)] + [2.0 ** (24 - n)] * (len(log) - n)


def test_mixed_finetune_and_flags(demo, tmp_path, capsys):  # noqa: F811
    pre = tmp_path / "pre"
    assert cli.main(pretrain_args(demo, pre, "--steps", "2")) == 0
    out = tmp_path / "cls"
    assert cli.main(["finetune", "--task", "classification", "--train", str(demo / "classification_train.jsonl"),
                     "--dev", str(demo / "classification_dev.jsonl"), "--init", str(pre / "model"), "--out", str(out),
                     "--epochs", "1", "--batch-size", "32", "--max-seq-length", "32", "--mixed-precision", "fp16"]) == 0
    assert len(rows(out / "eval.csv")) == 1
    with pytest.raises(SystemExit):
        cli.main(pretrain_args(demo, tmp_path / "bad", "--mixed-precision", "bf16-mixed"))
    assert "invalid choice: 'bf16-mixed' (choose from" in capsys.readouterr().err
    # --resume refuses another precision: the run would no longer be the one it was
    assert cli.main(pretrain_args(demo, pre, "--resume", "--mixed-precision", "bf16")) == 2
    assert "--mixed-precision from 'no' to 'bf16'" in capsys.readouterr().err
