"""`refbert check`: every op's backward, and every head's whole-model backward, against centred finite
differences in float64, as a table.

Each row is one differentiable input of one op: the shape it was checked at and the max relative error
(refbert.gradcheck.rel_error) against the numerical gradient. Any error above gradcheck.TOLERANCE fails the run.
The shapes are deliberately small and irregular (odd sizes, padding, a row with one real token, logits of 1e4).
"""
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

import numpy as np

from . import model as M
from . import ops
from .config import HEADS, BertConfig
from .gradcheck import TOLERANCE, check_model, check_pair
from .philox import DropoutRNG
from .tables import text_table


@dataclass
class Case:
    op: str                    # row label, e.g. "softmax (logits 1e4)"
    forward: callable          # forward(**inputs) -> (out, cache)
    backward: callable         # backward(dout, cache) -> grads in the order of `wrt`
    inputs: dict
    wrt: tuple
    kwargs: dict = field(default_factory=dict)  # non-differentiable arguments bound into forward
    only: tuple = None         # check just these inputs (default: all of wrt)


def _mask(B, T, lengths, dtype, fill):
    """Additive padding mask (B, 1, 1, T): 0 on the first lengths[b] positions, `fill` after (HF's layout)."""
    m = np.zeros((B, 1, 1, T), dtype)
    for b, n in enumerate(lengths):
        m[b, ..., n:] = fill
    return m


def _padding_row_constant(pad):
    """torch's padding_idx semantics as a function finite differences can see: row `pad` of w is a constant (its
    value at the first call), so its true derivative is 0, which is what embedding_backward returns for it."""
    frozen = {}

    def forward(ids, w, padding_idx):
        row = frozen.setdefault("row", w[pad].copy())
        w = w.copy()
        w[pad] = row
        return ops.embedding_forward(ids, w, padding_idx)
    return forward


def op_cases(seed=0):
    """The op table of `refbert check`, in float64."""
    r = np.random.default_rng(seed)
    f = r.standard_normal
    fmin = np.finfo(np.float64).min
    lab = np.array([[1, -100, 4, 0], [-100, 2, 3, -100]])
    cases = [
        Case("linear", ops.linear_forward, ops.linear_backward,
             dict(x=f((2, 3, 5)), w=f((4, 5)), b=f(4)), ("x", "w", "b")),
        Case("linear (no bias)", ops.linear_forward, ops.linear_backward, dict(x=f((7, 5)), w=f((3, 5))), ("x", "w")),
        Case("embedding (repeated ids)", ops.embedding_forward, ops.embedding_backward,
             dict(w=f((7, 4))), ("w",), dict(ids=np.array([[0, 3, 3, 6, 0], [1, 3, 2, 2, 5]]))),
        Case("embedding (padding_idx=0)", _padding_row_constant(0), ops.embedding_backward,
             dict(w=f((7, 4))), ("w",), dict(ids=np.array([[0, 3, 3, 6, 0], [1, 3, 2, 2, 5]]), padding_idx=0)),
        Case("layernorm", ops.layernorm_forward, ops.layernorm_backward,
             dict(x=f((2, 3, 6)) * 3 + 1, w=f(6), b=f(6)), ("x", "w", "b")),
        Case("layernorm (constant row)", ops.layernorm_forward, ops.layernorm_backward,
             dict(x=np.full((2, 5), 3.0), w=f(5), b=f(5)), ("x", "w", "b"),
             only=("w", "b")),  # dx: rstd = 1/sqrt(eps) = 1e6 makes a step of h leave the linear regime
        Case("softmax (scale, -inf mask, 1 real token)", ops.softmax_forward, ops.softmax_backward,
             dict(x=f((2, 3, 5))), ("x",), dict(scale=0.7, mask=_mask(2, 5, [5, 1], np.float64, -np.inf)[:, 0])),
        Case("softmax (logits 1e4)", ops.softmax_forward, ops.softmax_backward, dict(x=1e4 + f((3, 6))), ("x",)),
        Case("gelu (exact erf)", ops.gelu_forward, ops.gelu_backward, dict(x=3 * f((3, 7))), ("x",)),
        Case("gelu (tanh)", ops.gelu_forward, ops.gelu_backward, dict(x=3 * f((3, 7))), ("x",), dict(approximate="tanh")),
        Case("tanh", ops.tanh_forward, ops.tanh_backward, dict(x=2 * f((3, 7))), ("x",)),
        Case("dropout (p=0.3)", ops.dropout_forward, ops.dropout_backward, dict(x=f((4, 6))), ("x",),
             dict(p=0.3, rng=None)),  # a fresh DropoutRNG per call: see bind()
        Case("add (residual)", ops.add_forward, ops.add_backward, dict(a=f((2, 3, 4)), b=f((2, 3, 4))), ("a", "b")),
        Case("attention (H=3, padding, dropout 0.2)", ops.attention_forward, ops.attention_backward,
             dict(q=f((2, 5, 6)), k=f((2, 5, 6)), v=f((2, 5, 6))), ("q", "k", "v"),
             dict(n_heads=3, mask=_mask(2, 5, [5, 2], np.float64, fmin), dropout_p=0.2, rng=None)),
        Case("attention (H=1, -inf mask, 1 real token)", ops.attention_forward, ops.attention_backward,
             dict(q=f((2, 4, 5)), k=f((2, 4, 5)), v=f((2, 4, 5))), ("q", "k", "v"),
             dict(n_heads=1, mask=_mask(2, 4, [4, 1], np.float64, -np.inf))),
        Case("cross_entropy (ignore_index)", ops.cross_entropy_forward, ops.cross_entropy_backward,
             dict(logits=f((2, 4, 5))), ("logits",), dict(labels=lab)),
        Case("cross_entropy (logits 1e4)", ops.cross_entropy_forward, ops.cross_entropy_backward,
             dict(logits=1e4 + f((2, 4, 5))), ("logits",), dict(labels=lab)),
        Case("cross_entropy (all ignored)", ops.cross_entropy_forward, ops.cross_entropy_backward,
             dict(logits=f((3, 5))), ("logits",), dict(labels=np.full(3, -100))),
        Case("residual_layernorm", ops.residual_layernorm_forward, ops.residual_layernorm_backward,
             dict(x=f((2, 3, 6)) * 2, a=f((2, 3, 6)) + 1, w=f(6), b=f(6)), ("x", "a", "w", "b")),
        Case("dropout_residual_layernorm (p=0.3)", ops.dropout_residual_layernorm_forward,
             ops.dropout_residual_layernorm_backward,
             dict(x=f((2, 3, 7)) * 2, a=f((2, 3, 7)) + 1, w=f(7), b=f(7)), ("x", "a", "w", "b"),
             dict(eps=1e-12, p=0.3, rng=None)),
        Case("bias_gelu (exact erf)", ops.bias_gelu_forward, ops.bias_gelu_backward,
             dict(x=3 * f((2, 3, 5)), b=f(5)), ("x", "b")),
        Case("bias_gelu (tanh)", ops.bias_gelu_forward, ops.bias_gelu_backward,
             dict(x=3 * f((3, 5)), b=f(5)), ("x", "b"), dict(approximate="tanh")),
        Case("gather_rows (labelled positions)", ops.gather_rows_forward, ops.gather_rows_backward,
             dict(x=f((2, 4, 3))), ("x",), dict(rows=np.array([5, 0, 6]))),
        Case("bce_with_logits (multi-label)", ops.bce_with_logits_forward, ops.bce_with_logits_backward,
             dict(logits=4 * f((3, 5))), ("logits",), dict(targets=np.abs(np.sin(np.arange(15.0))).reshape(3, 5))),
        Case("mse", ops.mse_forward, ops.mse_backward, dict(pred=f((4, 3)), target=f((4, 3))), ("pred", "target")),
    ]
    return cases


def bind(case, rng_seed=1):
    """forward(**inputs) with the case's fixed arguments bound; a fresh DropoutRNG per call, so every
    finite-difference evaluation draws the same dropout mask."""
    def forward(**inputs):
        kw = dict(case.kwargs)
        if "rng" in kw:
            kw["rng"] = DropoutRNG(rng_seed)
        return case.forward(**inputs, **kw)
    return forward


def run(cases):
    """[(op, input, shape, error, ok)] for every differentiable input of every case."""
    rows = []
    for case in cases:
        errors = check_pair(bind(case), case.backward, case.inputs, case.wrt, only=case.only)
        for name in errors:
            rows.append((case.op, name, case.inputs[name].shape, errors[name], errors[name] <= TOLERANCE))
    return rows


def tiny_config(head=None, **kw):
    """A float64-checkable BERT: 2 layers, 3 heads of size 4, vocabulary 23."""
    base = dict(vocab_size=23, hidden_size=12, num_hidden_layers=2, num_attention_heads=3, intermediate_size=20,
                max_position_embeddings=16, type_vocab_size=2, num_labels=2 if head == "BertForQuestionAnswering" else 3)
    return BertConfig(**{**base, **kw})


def model_batch(cfg, head, B=2, T=6, seed=0):
    """Padding (row 1 has 4 real tokens), two segments, -100 labels: what every proof runs on."""
    r = np.random.default_rng(seed)
    ids = r.integers(1, cfg.vocab_size, (B, T))
    am = np.ones((B, T), np.int64)
    am[1, 4:] = 0
    ids[1, 4:] = cfg.pad_token_id
    tt = np.zeros((B, T), np.int64)
    tt[:, T // 2:] = 1
    x = dict(input_ids=ids, attention_mask=am, token_type_ids=tt)
    mlm = r.integers(0, cfg.vocab_size, (B, T))
    mlm[r.random((B, T)) < 0.5] = -100
    mlm[0, 1] = 5
    if head == "BertForPreTraining":
        x.update(labels=mlm, next_sentence_label=np.array([0, 1])[:B])
    elif head == "BertForMaskedLM":
        x.update(labels=mlm)
    elif head == "BertForNextSentencePrediction":
        x.update(labels=np.array([1, 0])[:B])
    elif head == "BertForSequenceClassification":
        x.update(labels=r.integers(0, cfg.num_labels, B))
    elif head == "BertForTokenClassification":
        lab = r.integers(0, cfg.num_labels, (B, T))
        lab[1, 4:] = -100
        x.update(labels=lab)
    elif head == "BertForQuestionAnswering":
        # past the end (T + 2, T + 5): clamped to T and ignored, as HF does, one start and one end on different rows
        x.update(start_positions=np.array([T + 2, 2])[:B], end_positions=np.array([3, T + 5])[:B])
    elif head == "BertForMultipleChoice":
        x = {k: np.stack([v, v[::-1]], 1) for k, v in x.items()}  # (B, 2 choices, T)
        x.update(labels=np.array([1, 0])[:B])
    return x


def model_rows(seed=1):
    """Whole-model rows: every head class, tiny, float64, training mode (dropout on), HF's gelu; each parameter
    tensor checked along one random direction. One row per class: the worst parameter."""
    rows = []
    for head in HEADS:
        cfg = tiny_config(head)
        model = getattr(M, head)(cfg, seed=seed, dtype=np.float64)
        for p in model.parameters().values():  # off HF's init (LayerNorm 1/0, zero biases), so no term hides
            p += np.random.default_rng(seed + 1).standard_normal(p.shape) * 0.05
        errs = check_model(model, model_batch(cfg, head), n_dirs=1)
        worst = max(errs, key=errs.get)
        rows.append((f"{head} (whole model)", f"{len(errs)} params", f"worst: {worst}", errs[worst],
                     errs[worst] <= TOLERANCE))
    return rows


def format_table(rows):
    head = ("op", "input", "shape", "max rel err", "")
    body = [(op, name, str(shape), f"{err:.2e}", "pass" if ok else "FAIL") for op, name, shape, err, ok in rows]
    return text_table(head, body)


def _kernel_specs():
    """Every fused kernel's spec, once each, in refbert_kernels' file order."""
    from refbert_kernels import backend
    specs, seen = [], set()
    for spec in backend.specs():
        if spec.name not in seen:      # the same op listed again for another bench shape (cross_entropy's V=512 rows)
            seen.add(spec.name)
            specs.append(spec)
    return specs


def _builds(spec, v):
    """The values of PARALLEL_MIN a version is checked under: (None,) (the module's own) for most; (None, 0) where
    the version's module has a PARALLEL_MIN, the size from which it runs a build compiled with parallel=True
    instead of that build's one-thread twin (layernorm v3, gelu v4, linear's bias; the module's other versions are
    checked twice alike). The spec's shapes are small, so under the module's own threshold they run the one-thread
    twin; under 0 they run the threaded build, the one the model runs on large inputs: both are checked, and a
    row is the worse of the two."""
    module = sys.modules.get(spec.versions[v][0].__module__)
    return (None, 0) if isinstance(getattr(module, "PARALLEL_MIN", None), int) else (None,)


def _validate_under(spec, v, dtype, shape, threshold):
    """_harness.validate(spec, v, dtype, shape) with the version's module's PARALLEL_MIN set to threshold (None:
    left as it is), restored after."""
    from refbert_kernels import _harness
    if threshold is None:
        return _harness.validate(spec, v, dtype, shape)
    module = sys.modules[spec.versions[v][0].__module__]
    old = module.PARALLEL_MIN
    module.PARALLEL_MIN = threshold
    try:
        return _harness.validate(spec, v, dtype, shape)
    finally:
        module.PARALLEL_MIN = old


def _version_rows(job):
    """(job, rows) for job = (spec index, version): the version in float64 and float32, worst over the spec's
    shapes and over its builds (_builds: a kernel with a threaded build and a one-thread twin is checked as both).
    A worker process's job when the kernels are checked side by side (each process compiles, and caches, what it
    checks, its cache saves locked: refbert_kernels installs _cache.lock_saves on import, in every process)."""
    index, v = job
    spec = _kernel_specs()[index]
    rows = []
    for dtype in (np.float64, np.float32):
        ratio = diff = 0.0
        for threshold in _builds(spec, v):
            for shape in spec.shapes:
                r, d = _validate_under(spec, v, dtype, shape, threshold)
                ratio, diff = max(ratio, r), max(diff, d)
        rows.append((f"{spec.name} v{v}", np.dtype(dtype).name, diff, ratio, ratio <= 1))
    return job, rows


def default_jobs():
    """Processes for the kernels' rows: one a core, at most 4 (each Numba compile is single-threaded and a cold
    cache is minutes of them; each process holds its own Numba, a few hundred MB)."""
    return max(1, min(4, os.cpu_count() or 1))


def kernel_rows(progress=None, jobs=1):
    """One row per kernel version and dtype: the fused Numba kernels (refbert_kernels) against their oracle op,
    forward and backward, on each spec's small irregular shapes: (kernel, dtype, max |diff|, max err/tol, ok).
    None when numba is not installed. progress(line), if given, hears of each kernel file as it is checked: the
    first run compiles every version (minutes), which would otherwise pass in silence. jobs: processes that check
    (and compile) versions side by side (1: all in this process, in file order; `refbert check` passes
    default_jobs()); the rows come in file order either way, and are the same on the same Numba cache (the last
    digits can differ between caches: a kernel's float32 sums as LLVM compiled them in the process that cached
    it). The worker processes are spawned: from a script, call this with jobs > 1 under a main guard (each
    worker imports the main module)."""
    try:
        from refbert_kernels import _harness  # noqa: F401
        specs = _kernel_specs()
    except ImportError:
        return None
    say = progress or (lambda line: None)
    todo = [(i, v) for i, spec in enumerate(specs) for v in sorted(spec.versions)]
    jobs = max(1, min(jobs, len(todo)))
    from refbert_kernels import _cache
    if jobs > 1 and not _cache.lock_saves():            # (what the workers will need, tried here)
        say("  (one process: this platform's Numba cache cannot be locked for processes side by side)")
        jobs = 1
    say(f"checking {len(todo)} fused kernel versions against their ops, float64 and float32; each compiles on its "
        f"first call (minutes on a cold cache{f', {jobs} processes side by side' if jobs > 1 else ''}; Numba keeps "
        f"them, so later runs take seconds)")
    start, done, files = time.perf_counter(), {}, set()

    def said(i, verb):
        say(f"  [{len(files) + (verb == 'checking')}/{len(specs)}] {specs[i].name}: {len(specs[i].versions)} "
            f"version(s) x 2 dtypes {verb} ({time.perf_counter() - start:.0f} s so far)")

    if jobs == 1:
        for i, v in todo:                           # said as each file starts: what is compiling now, for how long
            if v == min(specs[i].versions):
                said(i, "checking")
                files.add(i)
            done[i, v] = _version_rows((i, v))[1]
    else:
        # spawn, not fork: this process may hold Numba's and the BLAS's threads. The files with the most versions
        # first (attention's are most of a cold compile), so no process is left with a long one at the end.
        # A worker that dies (out of memory, a crash in LLVM) breaks the pool: an error here, never a wait.
        todo_first = sorted(todo, key=lambda iv: -len(specs[iv[0]].versions))
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            for fut in as_completed([ex.submit(_version_rows, iv) for iv in todo_first]):
                (i, v), rows = fut.result()
                done[i, v] = rows
                if all((i, w) in done for w in specs[i].versions):
                    files.add(i)
                    said(i, "checked")
    say(f"  kernels checked in {time.perf_counter() - start:.0f} s")
    return [r for iv in todo for r in done[iv]]


def format_kernel_table(rows):
    head = ("kernel (numba) vs oracle", "dtype", "max |diff|", "err/tol", "")
    body = [(k, d, f"{diff:.2e}", f"{ratio:.3f}", "pass" if ok else "FAIL") for k, d, diff, ratio, ok in rows]
    return text_table(head, body)


def _to_stderr(line):
    """Progress goes to stderr, so that stdout stays the table alone (`refbert check > table.txt`)."""
    print(line, file=sys.stderr, flush=True)


def main(args=None):
    rows = run(op_cases()) + model_rows()
    print(format_table(rows), flush=True)                # seen while the kernels compile
    failed = sum(not r[4] for r in rows)
    n = len(rows)
    jobs = getattr(args, "jobs", 1)                     # the command line's None: one process a core
    krows = kernel_rows(progress=_to_stderr, jobs=default_jobs() if jobs is None else jobs) \
        if getattr(args, "kernels", True) else []
    if krows is None:
        print("\n(kernels: numba is not installed, so the fused kernels were not checked: pip install 'refbert[kernels]')")
    elif krows:
        print("\nfused kernels, every numbered version, forward and backward against the oracle op "
              "(err/tol <= 1 passes; tol = atol + rtol |ref|, stated per kernel file):\n")
        print(format_kernel_table(krows))
        failed += sum(not r[4] for r in krows)
        n += len(krows)
    print(f"\n{n - failed} passed, {failed} failed (gradients: tolerance {TOLERANCE:g}, float64 centred differences)")
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------------
# refbert check --ops PATH [--model]: your ops against the oracle (refbert.testing)

def ops_main(args):
    """`refbert check --ops PATH`: every op PATH defines, graded by refbert.testing.check_op in each dtype, then
    timed beside the oracle and PyTorch (unless --no-bench); with --model, the whole model on those ops. Exit 0 when
    everything passes, 1 when anything fails; a PATH that cannot be loaded or defines no op is a ValueError (the
    command line's one line and exit 2)."""
    from . import testing as Tg
    dtypes = tuple(args.dtypes or ("float32", "float64"))
    module, reports = Tg.check_module(args.ops, dtypes=dtypes, examples=args.examples)
    found = Tg.module_ops(module)
    given = ", ".join(op + ("" if f and b else " (forward only)" if f else " (backward only)")
                      for op, (f, b) in found.items())
    lib = getattr(module, "ARRAY_LIBRARY", None)
    print(f"refbert check --ops {args.ops}: {given}; arrays: "
          f"{lib + ' (declared)' if lib else 'probed: ' + (', '.join(sorted({r.library for r in reports if r.library})) or 'numpy')}")
    print(Tg.LEGEND + "\n")
    print(Tg.format_reports(reports))
    failed = sum(not r["ok"] for rep in reports for r in rep.rows)
    n = sum(len(rep.rows) for rep in reports)
    result = dict(ops=str(args.ops), reports=[json_loads(rep.to_json()) for rep in reports])
    if not args.no_bench:
        bw = Tg.copy_bandwidth(repeats=3)
        rows = []
        for op, (f, b) in found.items():
            if not all(r.passed for r in reports if r.op == op):
                rows.append((op, "-", "not timed: it fails the check", "", "", "", "", "", ""))
                continue
            rep = Tg.bench_op(op, f and Tg.declare(f, lib), b and Tg.declare(b, lib), repeats=3, rounds=1,
                              min_time=0.05, bandwidth=bw)
            e = rep.entries[0]
            t = {r["impl"]: r for r in e["rows"]}
            y = t.get("yours")
            ms = lambda k: f"{t[k]['fwd_bwd_s'] * 1e3:.3f}" if k in t else "-"  # noqa: E731
            rows.append((op, _params(e["params"]), ms("yours"), ms("numpy oracle"), ms("pytorch"),
                         f"{y['GBps']:.2f}" if y else "-", f"{y['pct_copy']:.1f}" if y else "-",
                         f"{y['x_numpy']:.2f}" if y else "-", f"{y['x_pytorch']:.2f}" if y and y["x_pytorch"] else "-"))
            result.setdefault("bench", []).append(json_loads(rep.to_json()))
        print(f"\ntiming, float32, forward + backward: the median of >= 3 calls after a warm-up call, on the same inputs "
              f"(refbert.testing.bench_op; copy bandwidth {bw / 1e9:.2f} GB/s, probed in this run):\n")
        print(text_table(("op", "params", "yours ms", "numpy ms", "pytorch ms", "GB/s", "% of copy", "x numpy",
                          "x pytorch"), rows))
    if args.model:
        backend, runs = Tg.check_model_ops(module, dtypes=dtypes)
        print(f"\nthe whole model on these ops ({backend.describe()}):")
        print("every output, hidden state and parameter gradient against the float64 oracle, same weights, batch "
              "(3 x 7, padding) and dropout masks (train mode, dropout 0.1); tolerance per tensor as above\n")
        from .verify import _group, format_rows
        mrows = []
        for r in runs:
            worst = max((x for x in r["rows"] if x["error"] is not None),
                        key=lambda x: x["error"] / x["tolerance"], default=None)
            bad = sum(not x["ok"] for x in r["rows"])
            mrows.append((r["head"], r["config"], r["dtype"], str(len(r["rows"])),
                          worst["key"] if worst else "-",
                          f"{worst['error'] / Tg.EPS[r['dtype']]:.3g}" if worst else "-",
                          f"{worst['tolerance'] / Tg.EPS[r['dtype']]:.3g}" if worst else "-",
                          "pass" if r["ok"] else f"FAIL ({bad})"))
        print(text_table(("model", "config", "dtype", "tensors", "worst (error / tolerance)", "ulps", "tolerance", ""),
                         mrows))
        for r in runs:
            if r["ok"]:
                continue
            f = r["first_failure"]
            print(f"\nFAIL {r['head']} ({r['config']}, {r['dtype']})" + (f": {r['error']}" if r["error"] else ""))
            if f:
                print(f"first failure: {f['where']} ({f['key']}): {f['why']}")
            # the failing rows in the order the computation makes them: forward, then the backward's order
            L = model_layers(r["config"])
            order = lambda i_x: (i_x[1]["key"].startswith("grad/"),  # noqa: E731
                                 _group(i_x[1]["key"][5:], L)[0] if i_x[1]["key"].startswith("grad/") else 0, i_x[0])
            bad = [x for _, x in sorted(((i, x) for i, x in enumerate(r["rows"]) if not x["ok"]), key=order)]
            print(format_rows(bad[:6]) + (f"\n... and {len(bad) - 6} more" if len(bad) > 6 else ""))
        failed += sum(not r["ok"] for r in runs)
        n += len(runs)
        result["model"] = dict(backend=backend.describe(), runs=runs)
    print(f"\n{n - failed} passed, {failed} failed")
    if args.json:
        from .fileio import write_text
        from .testing import _dumps
        write_text(args.json, _dumps(result))
    return 1 if failed else 0


def model_layers(config_name):
    from .testing import model_configs
    return model_configs()[config_name].num_hidden_layers


def json_loads(text):
    import json
    return json.loads(text)


def _params(p):
    return ", ".join(f"{k}={v}" for k, v in p.items())
