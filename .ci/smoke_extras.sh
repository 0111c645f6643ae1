#!/usr/bin/env bash
# CI: each extra of setup.py installed alone, from the wheel `pip install ".[extra]"` builds, in a fresh virtual
# environment, and what it enables run once, as a new user would meet it: a smoke run, not the suite (the suite runs
# in the dev extras' environment, which holds every optional package, so it cannot see an extra that lacks one:
# SciPy, which Numba's np.dot calls, was such a case). Each step prints its time; the total closes the output.
#
#   .               README block 1: refbert check (the op table; no kernels without the extra)
#   .[train]        demo-data, a 3-step pretrain (training its own vocabulary), a 1-epoch finetune, predict,
#                   fill-mask
#   .[kernels]      refbert trace --backend numba (the model on the fused kernels, every op call FD-checked), and a
#                   tiny model's forward + backward on backend "numba" against "numpy", float32
#   .[kernels,train]  pretrain --backend numba, 2 steps: train added to the kernels environment, so that the float32
#                   kernels compiled just before are reused (a fresh environment would compile them again)
#   .[cuda]         Numba's CUDA simulator (no GPU needed): the same tiny model on backend "cuda" against "numpy";
#                   the 70 MB CuPy wheel is installed, as a user's would be, and left unimported
#   .[cuda,train]   a vocabulary, then pretrain --backend cuda, 1 step of a one-layer model, in the simulator
#
# Three lanes run side by side (. then train; kernels; cuda), each mostly one busy core (pip, Numba's compiler, the
# simulator) in its own environments and folder, and removing its environments when done; their logs are printed
# in that order at the end. Everything lives in a temporary folder, removed at the end; pip's cache is used.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/refbert-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS

step() {  # step NAME COMMAND...: run it, print its time; a failure names the step and stops the script
  local t=$SECONDS
  echo "+ [$1] ${*:2}"
  if ! "${@:2}"; then echo "smoke_extras: FAILED in [$1]: ${*:2}" >&2; exit 1; fi
  echo "  [$1] $((SECONDS - t)) s"
}

fresh() {  # fresh NAME EXTRAS: a new venv at $work/NAME with refbert[EXTRAS]
  python3 -m venv "$work/$1"
  step "$1" "$work/$1/bin/pip" install -q "$wheel[$2]"
}

in_venv() {  # in_venv NAME COMMAND...: run in $work/run-NAME, that venv first on PATH (not the checkout's refbert)
  local name=$1; shift
  mkdir -p "$work/run-$name"
  (cd "$work/run-$name" && PATH="$work/$name/bin:$PATH" "$@")
}

demo() {  # demo NAME: the demo data in $work/run-NAME, cut small (any environment: demo-data needs NumPy alone)
  step "$1" in_venv "$1" refbert demo-data demo
  in_venv "$1" python - <<'PY'
from pathlib import Path
d = Path("demo")
docs = (d / "corpus.txt").read_text(encoding="utf-8").split("\n\n")
(d / "small.txt").write_text("\n\n".join(docs[:150]) + "\n", encoding="utf-8")
(d / "tiny.txt").write_text("\n\n".join(docs[:12]) + "\n", encoding="utf-8")
for name in ("classification_train", "classification_dev"):
    lines = (d / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    (d / f"{name}_small.jsonl").write_text("\n".join(lines[:64]) + "\n", encoding="utf-8")
PY
}

# a tiny model's forward + backward on another backend against numpy, float32: every gradient within 1e-4 of its
# tensor's largest entry (the kernels' per-op bound is 1e-5 relative), but the key biases', zero in exact arithmetic
# (rounding noise on both sides: refbert trace says why)
cat > "$work/backend_vs_numpy.py" <<'PY'
import sys
import numpy as np
import refbert
from refbert.model import to_numpy
backend = sys.argv[1]
cfg = refbert.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16)
r = np.random.default_rng(0)
ids = r.integers(5, 50, (2, 8))
am = np.ones_like(ids)
am[1, 6:] = 0
labels = np.where(r.random(ids.shape) < 0.3, ids, -100)
labels[0, 1] = ids[0, 1]
x = dict(input_ids=ids, attention_mask=am, labels=labels, next_sentence_label=np.array([0, 1]))
runs = {}
for be in ("numpy", backend):
    m = refbert.BertForPreTraining(cfg, seed=0, dtype=np.float32, backend=be)
    loss = float(to_numpy(m(**x).loss))
    runs[be] = loss, to_numpy(m.backward())
(l0, g0), (l1, g1) = runs["numpy"], runs[backend]
err = {k: float(np.abs(g1[k] - g0[k]).max() / np.abs(g0[k]).max()) for k in g0 if not k.endswith("self.key.bias")}
worst = max(err, key=err.get)
print(f"{backend}: loss {l1:.6f} (numpy {l0:.6f}); worst gradient: {worst}, {err[worst]:.1e} of its largest entry")
assert abs(l1 - l0) <= 1e-5 * abs(l0) and err[worst] <= 1e-4, "the backend disagrees with numpy"
PY

tiny=(--preset tiny --vocab-size 400 --max-seq-length 32 --batch-size 8)

core_and_train() {  # . alone (README block 1), then .[train]: the demo, cut small
  step base "$work/base/bin/pip" install -q "$wheel"
  step base in_venv base refbert check
  fresh train "train"
  demo train
  step train in_venv train refbert pretrain --corpus demo/small.txt --out pre "${tiny[@]}" --steps 3
  step train in_venv train refbert finetune --task classification --train demo/classification_train_small.jsonl \
    --dev demo/classification_dev_small.jsonl --init pre/model --out cls --epochs 1 --max-seq-length 32
  step train in_venv train refbert predict cls/best --text "Return the square root of x."
  step train in_venv train refbert fill-mask pre/model "Return the [MASK] of the file."
  rm -rf "$work/base" "$work/train"
}

kernels() {  # .[kernels], then train added
  fresh kernels "kernels"
  step kernels in_venv kernels refbert trace --backend numba
  step kernels in_venv kernels python "$work/backend_vs_numpy.py" numba
  step kernels+train "$work/kernels/bin/pip" install -q "$wheel[kernels,train]"
  demo kernels
  step kernels+train in_venv kernels refbert pretrain --corpus demo/small.txt --out pre-numba "${tiny[@]}" \
    --steps 2 --backend numba
  rm -rf "$work/kernels"
}

cuda() {  # .[cuda] in Numba's CUDA simulator, then train added
  fresh cuda "cuda"
  step cuda in_venv cuda env NUMBA_ENABLE_CUDASIM=1 python "$work/backend_vs_numpy.py" cuda
  step cuda+train "$work/cuda/bin/pip" install -q "$wheel[cuda,train]"
  demo cuda
  step cuda+train in_venv cuda refbert vocab demo/tiny.txt --out tok --vocab-size 200
  in_venv cuda sh -c 'cat > one_layer.json <<JSON
{"vocab_size": $(wc -l < tok/vocab.txt), "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
 "intermediate_size": 32, "max_position_embeddings": 16}
JSON'
  step cuda+train in_venv cuda env NUMBA_ENABLE_CUDASIM=1 refbert pretrain --corpus demo/tiny.txt --out pre-cuda \
    --vocab tok/vocab.txt --config one_layer.json --max-seq-length 16 --batch-size 2 --steps 1 --backend cuda
  rm -rf "$work/cuda"
}

# the wheel `pip install ".[...]"` would build, built once: the environments install it side by side, and two
# builds in one source tree at once would share its build/ folder
python3 -m venv "$work/base"
step wheel "$work/base/bin/pip" wheel -q --no-deps -w "$work/wheel" "$root"
wheel=$(ls "$work"/wheel/refbert-*.whl)

# the three lanes (see the top)
status=0
core_and_train > "$work/core.log" 2>&1 & lanes=($!)
kernels > "$work/kernels.log" 2>&1 & lanes+=($!)
cuda > "$work/cuda.log" 2>&1 & lanes+=($!)
for i in 0 1 2; do wait "${lanes[$i]}" || status=1; done
cat "$work/core.log" "$work/kernels.log" "$work/cuda.log"
if [ $status -ne 0 ]; then echo "smoke_extras: FAILED (the log above says where)" >&2; exit 1; fi

echo "smoke_extras: every extra ran, $((SECONDS - start)) s in all"
