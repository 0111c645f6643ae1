"""`refbert verify` against dumps that torch computes on a GPU (cuBLAS, cuDNN-free eager BERT), as
benchmarks/verify_noise.py does on the CPU: the worst tensor of each honest dump in units of its noise, and the
weakest signal of a 1e-3 (float32) or 1e-9 (float64) change of any one tensor.

    python benchmarks/verify_noise_gpu.py --out DIR        # needs torch with CUDA, transformers

Models: BERT tiny, mini and base with transformers' own init (benchmarks/verify_noise.py: make_checkpoint), the
default batch of `refbert dump`. Dumps: torch on the GPU in float64, float32 (TF32 off: torch's default for
matmuls), float16 and bfloat16; and float32 with TF32 on (torch.backends.cuda.matmul.allow_tf32 = True), which
is not float32 arithmetic: its matmuls round their inputs to 10 significant bits, so verify (float32 noise) is
expected to fail it, and --dtype float16 (the same 10 bits) to pass it.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verify_noise import HEAD, CHANGE, make_checkpoint, units  # noqa: E402

from refbert import verify  # noqa: E402
from refbert.fileio import write_text  # noqa: E402


def cuda_dump(folder, batch, dtype, tf32=False, device="cuda"):
    import torch
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = tf32
    model = transformers.BertForPreTraining.from_pretrained(folder).eval().to(device, getattr(torch, dtype))
    out = model(**{k: torch.from_numpy(v).to(device) for k, v in batch.items()}, output_hidden_states=True)
    out.loss.backward()
    d = {f"output/{k}": v for k, v in out.items() if k != "hidden_states"}
    d |= {f"hidden_states/{i}": h for i, h in enumerate(out.hidden_states)}
    d |= {f"grad/{k}": p.grad for k, p in model.named_parameters()}
    torch.backends.cuda.matmul.allow_tf32 = False
    return {k: v.detach().double().cpu().numpy() for k, v in d.items()}


def main():
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="tiny,mini,base")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():        # a word, not torch's traceback (exit 2: skipped)
        print(f"verify_noise_gpu: SKIPPED, --device cuda needs torch with CUDA and a GPU (torch {torch.__version__}: "
              f"torch.cuda.is_available() is False); --device cpu runs this script's plumbing", file=sys.stderr)
        sys.exit(2)
    work = tempfile.mkdtemp()
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    lines = ["# `refbert verify` against torch on a GPU", "", f"Device: {device}; torch {torch.__version__}. Method: "
             "benchmarks/verify_noise_gpu.py (its docstring).", "",
             "| model | dump | noise dtype | worst (units of noise) | tensor | K | pass | weakest 1-tensor change "
             "(units) | caught |", "|---|---|---|---|---|---|---|---|---|"]
    for size in a.sizes.split(","):
        folder = os.path.join(work, size)
        make_checkpoint(size, "init", folder, 0)
        model = verify.load(folder, HEAD, np.float64)
        batch, up = verify.default_batch(model.config, HEAD)
        cache = {}
        for name, dtype, tf32, judged in (("float64", "float64", False, "float64"),
                                          ("float32", "float32", False, "float32"),
                                          ("float32, TF32", "float32", True, "float32"),
                                          ("float32, TF32", "float32", True, "float16"),
                                          ("float16", "float16", False, "float16"),
                                          ("bfloat16", "bfloat16", False, "bfloat16")):
            t = time.perf_counter()
            if judged not in cache:
                cache[judged] = verify.expected(model, folder, HEAD, batch, up, judged, "gpu")
            ref, n = cache[judged]
            d = cuda_dump(folder, batch, dtype, tf32, a.device)
            K, zeros = verify.FACTOR[judged], verify.exact_zeros(HEAD, ref)
            worst = max((units(d[k], r, n[k]), k) for k, r in ref.items())
            det = "-"
            if judged in CHANGE and not tf32:
                weakest = min((units(d[k] * (1 + CHANGE[judged]), r, n[k]), k) for k, r in ref.items()
                              if k not in zeros)
                det = f"{weakest[0]:.1f} ({weakest[1]}) | {'yes' if weakest[0] > K else '**no**'}"
            else:
                det += " | -"
            lines.append(f"| {size} | torch cuda {name} | {judged} | {worst[0]:.2f} | {worst[1]} | {K} | "
                         f"{'yes' if worst[0] <= K else 'no'} | {det} |")
            print(lines[-1], f"{time.perf_counter() - t:.1f} s", flush=True)
            os.makedirs(a.out, exist_ok=True)          # after every row: a run stopped at its time limit keeps them
            write_text(os.path.join(a.out, "verify_noise_gpu.md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
