"""The `refbert` command line (also `python -m refbert ...`).

    refbert check | trace                         proofs: every backward against finite differences
    refbert check --ops FILE [--model]            your ops (any subset of refbert.ops' names) graded and timed
    refbert exercise init DIR                     backprop exercises: write the backward passes yourself
    refbert verify CKPT [--against DUMP]          a checkpoint: refbert vs finite differences and torch, or a dump
    refbert dump CKPT --out DUMP                  refbert's outputs and gradients, the format verify reads
    refbert demo-data DIR                         an offline corpus and fine-tuning sets from the stdlib's docstrings
    refbert vocab CORPUS... --out DIR             train a WordPiece vocab.txt
    refbert pretrain --corpus F --out DIR         MLM + NSP pretraining (or --init an HF BERT to continue pretraining)
    refbert finetune --task T --init DIR ...      classification, pair, ner, qa
    refbert predict | fill-mask | embed MODEL     use a model
A mistake in what was asked (a missing file, a folder that exists, a malformed row) prints one line and exits 2
(REFBERT_DEBUG=1 shows the traceback instead).
"""
import argparse
import os
import sys
import warnings

from .argtypes import non_negative, positive, positive_float
from .defaults import PRETRAIN


def _backend_type(names):
    """argparse type of --backend: one of `names`, or a path to a .py file of ops (refbert.backends)."""
    def parse(text):
        if text in names or text.endswith(".py") or os.path.isfile(text):
            return text
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)} or a path to a .py file of ops, "
                                         f"got {text!r}")
    return parse


def _backend_arg(p, cuda=False):
    """--backend; cuda=True adds "cuda" (the commands whose outputs are brought back to NumPy: pretrain, finetune)."""
    names = ["numpy", "numba", "cuda"] if cuda else ["numpy", "numba"]
    p.add_argument("--backend", type=_backend_type(names), default="numpy", metavar="{" + ",".join(names) + ",FILE.py}",
                   help="numpy: the oracle (default); numba: the fused CPU kernels (pip install 'refbert[kernels]')"
                        + ("; cuda: a GPU through CuPy and Numba CUDA kernels (pip install 'refbert[cuda]'; or "
                           "Numba's CPU simulator with NUMBA_ENABLE_CUDASIM=1, tiny models only)" if cuda else "")
                        + "; FILE.py: your ops (functions named as refbert.ops'), the rest the oracle's")
    return p


def _mixed_arg(p, default="no"):
    """--mixed-precision (accelerate's name and values; `refbert check --precision` is the precision study, a switch):
    no = float32, bf16 = precision "bf16-mixed", fp16 = "fp16-mixed" with loss scaling (refbert.mixed)."""
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=default,
                   help="bf16 / fp16: float32 masters, 16-bit activations and activation gradients, float32 inside "
                        "every op (the spec: README \"Mixed precision\"); fp16 with dynamic loss scaling; "
                        "no: float32 (default)")
    return p


def _pretrain_args(p):
    """`refbert pretrain`'s options. Their defaults are refbert.defaults.PRETRAIN (train.py fills them in): the
    parser leaves an option that was not given out of the arguments, so that --resume can tell changes apart."""
    p.add_argument("--corpus", help="text file: one sentence per line, a blank line between documents")
    p.add_argument("--out", required=True, help="run folder (must be new, unless --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--allow-changed-schedule", action="store_true",
                   help="with --resume: let --steps, --save-every, --eval-every, --stop-after differ from the run's")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty --out (its files may be replaced)")
    p.add_argument("--preset", help="tiny, mini, small, medium, base, large")
    p.add_argument("--config", help="a config.json instead of a preset")
    p.add_argument("--init", help="an HF BERT folder to continue pretraining from (its vocab and weights)")
    p.add_argument("--vocab", help="a vocab.txt (default: train one on the corpus)")
    p.add_argument("--vocab-size", type=positive)
    p.add_argument("--cased", action="store_true", help="keep case (default: lower-case, as bert-base-uncased)")
    p.add_argument("--objective", choices=["nsp", "sop"],
                   help="the sentence task beside MLM: next-sentence (BERT) or sentence-order (ALBERT)")
    p.add_argument("--max-seq-length", type=positive)
    p.add_argument("--short-seq-prob", type=float)
    p.add_argument("--mlm-prob", type=float)
    p.add_argument("--max-predictions", type=positive)
    p.add_argument("--whole-word", action="store_true", help="mask whole words")
    p.add_argument("--ngram", type=positive, help="n-gram (span) masking up to n (ALBERT uses 3)")
    p.add_argument("--static-masking", action="store_true", help="google's dupe_factor copies instead of dynamic")
    p.add_argument("--dupe-factor", type=positive)
    p.add_argument("--batch-size", type=positive)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=float, help="warm-up steps, or a fraction of all steps if < 1")
    p.add_argument("--no-bias-correction", action="store_true", help="the original BERT's uncorrected Adam")
    p.add_argument("--steps", type=int, help="total optimizer steps (0: --epochs over the data)")
    p.add_argument("--epochs", type=positive)
    p.add_argument("--eval-every", type=positive)
    p.add_argument("--save-every", type=positive)
    p.add_argument("--stop-after", type=int, help="stop after this step as if interrupted (resume later)")
    p.add_argument("--seed", type=int)
    _backend_arg(p, cuda=True)
    _mixed_arg(p, default=argparse.SUPPRESS)
    p.add_argument("--cuda-graph", action="store_true",
                   help="with --backend cuda: each training step one CUDA graph replay (kernels/cuda/graph.py; "
                        "the masked positions padded to batch size x --max-predictions so every batch has the "
                        "same shapes; the first replay of each capture checked against the eager step)")
    for action in p._actions:                       # show the defaults that live in refbert.defaults
        if PRETRAIN.get(action.dest) not in (None, False) and action.dest not in ("backend", "mixed_precision"):
            action.help = f"{action.help + ' ' if action.help else ''}(default {PRETRAIN[action.dest]})"


def build_parser():
    ap = argparse.ArgumentParser(prog="refbert", description="BERT in NumPy with hand-written, proven backward passes.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="every op's and every head's backward against finite differences (float64), "
                                     "and every fused kernel against its op")
    p.add_argument("--no-kernels", dest="kernels", action="store_false", help="skip the fused kernels' rows")
    p.add_argument("--jobs", type=positive, default=None,
                   help="processes that check (and on a cold cache compile) the fused kernels side by side (default: "
                        "one a core, at most 4; 1: all in this process)")
    p.add_argument("--precision", action="store_true",
                   help="also the reduced-precision study: fp16/bf16 storage against the float64 oracle, in ulps")
    from .precision import add_arguments as _precision_args
    _precision_args(p)                                  # --device cpu|cuda, --dtypes, --size, --ops, --json
    for action in p._actions:                           # --ops and --dtypes serve `check --ops FILE` too
        if action.dest == "ops":
            action.choices, action.metavar = None, "FILE|OP"
            action.help = ("a .py file (or importable module) of your ops: grade each against the oracle, then time "
                           "it; or, with --precision / --device cuda, the ops of the precision study")
        if action.dest == "dtypes":
            action.choices = ["float16", "bfloat16", "float32", "float64"]
            action.help = "--ops FILE: float32 and/or float64 (default both); the precision study: storage dtypes"
    p.add_argument("--model", action="store_true", help="with --ops FILE: also the whole model on your ops (two "
                                                         "heads, two configs, dropout on), tensor by tensor")
    p.add_argument("--examples", type=positive, default=12, help="with --ops FILE: shapes drawn per op and dtype "
                                                                  "(hypothesis when installed) besides the edge cases")
    p.add_argument("--no-bench", action="store_true", help="with --ops FILE: skip the timing")
    p = sub.add_parser("exercise", help="backprop exercises: write the backward passes of BERT's ops yourself")
    esub = p.add_subparsers(dest="action", required=True)
    e = esub.add_parser("init", help="write DIR/ops.py (forwards given, backwards blank) and DIR/README.md")
    e.add_argument("dir")
    from .exercise import ORDER
    e.add_argument("--ops", nargs="+", choices=list(ORDER), help=f"the exercises (default all: {' '.join(ORDER)})")
    e.add_argument("--force", action="store_true", help="overwrite DIR/ops.py and DIR/README.md if they exist")
    _backend_arg(sub.add_parser("trace", help="one forward and backward of a tiny model, op by op, with "
                                              "finite-difference checks"))
    p = sub.add_parser("verify", help="another implementation's dump against refbert (--against), or refbert's "
                                      "backward on a checkpoint against finite differences and torch")
    p.add_argument("model", help="an HF BERT folder (config.json + model.safetensors)")
    p.add_argument("--against", metavar="DUMP", help=".safetensors or .npz written by the implementation under test")
    p.add_argument("--head", help="the HF class to check (default: the first of config.json's architectures)")
    p.add_argument("--batch", help="the inputs, .npz or .safetensors (default: a synthetic batch); not with --against")
    p.add_argument("--dtype", choices=["float64", "float32", "float16", "bfloat16"],
                   help="the precision the dump was computed in (default: that of its least precise tensor)")
    p.add_argument("--json", metavar="PATH", help="also write the report to PATH as JSON")
    p = sub.add_parser("dump", help="write refbert's outputs and gradients on a batch, in the format verify reads")
    p.add_argument("model", help="an HF BERT folder")
    p.add_argument("--out", required=True, help=".safetensors (or .npz) file to write")
    p.add_argument("--head", help="the HF class (default: the first of config.json's architectures)")
    p.add_argument("--batch", help="the inputs, .npz or .safetensors (default: a synthetic batch)")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p = sub.add_parser("demo-data", help="write an offline corpus and fine-tuning sets from the stdlib's docstrings")
    p.add_argument("out")
    p = sub.add_parser("vocab", help="train a WordPiece vocab.txt on text files")
    p.add_argument("corpus", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=positive, default=8000)
    p.add_argument("--cased", action="store_true")
    _pretrain_args(sub.add_parser("pretrain", help="masked-LM + next-sentence pretraining",
                                  argument_default=argparse.SUPPRESS))
    p = sub.add_parser("finetune", help="fine-tune a pretrained model on a task")
    p.add_argument("--task", required=True, help="classification, pair, ner or qa")
    p.add_argument("--train", required=True, help=".jsonl (or .csv for classification/pair); schema in the README")
    p.add_argument("--dev", required=True)
    p.add_argument("--init", required=True, help="a pretrained model folder (refbert's or any HF BERT)")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--epochs", type=positive, default=3)
    p.add_argument("--batch-size", type=positive, default=32)
    p.add_argument("--lr", type=positive_float, default=5e-4)
    p.add_argument("--max-seq-length", type=positive, default=128)
    p.add_argument("--seed", type=non_negative, default=0)
    _backend_arg(p, cuda=True)
    _mixed_arg(p)
    p = sub.add_parser("predict", help="classify, tag or answer with a fine-tuned model")
    p.add_argument("model")
    p.add_argument("--text", action="append")
    p.add_argument("--text-pair", action="append")
    p.add_argument("--question")
    p.add_argument("--context")
    p.add_argument("--null-threshold", type=float, default=0.0)
    p.add_argument("--max-seq-length", type=positive, default=512)
    _backend_arg(p)
    p = sub.add_parser("fill-mask", help="the likeliest tokens for each [MASK]")
    p.add_argument("model")
    p.add_argument("text", nargs="+")
    p.add_argument("--top-k", type=positive, default=5)
    p.add_argument("--max-seq-length", type=positive, default=512)
    _backend_arg(p)
    p = sub.add_parser("embed", help="sentence embeddings")
    p.add_argument("model")
    p.add_argument("--text", action="append")
    p.add_argument("--file")
    p.add_argument("--pooling", choices=["mean", "cls"], default="mean")
    p.add_argument("--out", help=".npy file (default: print JSON)")
    p.add_argument("--max-seq-length", type=positive, default=512)
    _backend_arg(p)
    from .bench import add_arguments as _bench_args
    _bench_args(sub.add_parser("bench", help="validate, then time, the kernels and the pretraining step against "
                                             "their peers; attention memory"))
    return ap


def run(args):
    c = args.command
    if c == "check":
        from . import check
        if args.ops and len(args.ops) == 1 and not _precision_op(args.ops[0]):
            bad = [d for d in args.dtypes or () if d not in ("float32", "float64")]
            if bad:
                raise ValueError(f"check --ops: --dtypes expected float32 and/or float64, got {', '.join(bad)}")
            return check.ops_main(args.__class__(**{**vars(args), "ops": args.ops[0]}))
        if args.model:
            raise ValueError("check: --model expected --ops FILE (the ops to run the model on), got no file")
        if "float64" in (args.dtypes or ()):
            raise ValueError("check: --dtypes float64 is for --ops FILE; the precision study stores float16, "
                             "bfloat16 or float32")
        if args.ops and not all(map(_precision_op, args.ops)):
            raise ValueError(f"check: --ops expected one file of ops, or op names of the precision study, got "
                             f"{' '.join(args.ops)}")
        status = check.main(args)
        if args.precision or args.device == "cuda":     # the GPU kernels in every precision, and the study
            from . import precision
            status = max(status, precision.main(args))
        return status
    if c == "exercise":
        from .exercise import init
        for path in init(args.dir, args.ops, force=args.force):
            print(path)
        print(f"next: fill in the backward passes of {args.dir}/ops.py, then refbert check --ops {args.dir}/ops.py "
              f"(and --model); {args.dir}/README.md has the order")
        return 0
    if c == "trace":
        from . import trace
        return trace.main(args)
    if c in ("verify", "dump"):
        from . import verify
        return verify.main(args) if c == "verify" else verify.dump_main(args)
    if c == "demo-data":
        from .demo import write_demo_data
        for name, n in write_demo_data(args.out).items():
            print(f"{args.out}/{name}: {n} {'documents' if name.endswith('corpus.txt') else 'rows'}")
        return 0
    if c == "vocab":
        from .tokenization import train_vocab
        print(train_vocab(args.corpus, args.out, vocab_size=args.vocab_size, lowercase=not args.cased))
        return 0
    if c == "bench":
        if args.device == "cuda":
            if args.mixed_precision != "no":       # the mixed section (unless --only says otherwise), that precision
                from .mixed import FLAGS
                args.mixed = FLAGS[args.mixed_precision]
                args.only = getattr(args, "only", None) or ["mixed"]
            from . import bench_cuda
            return bench_cuda.main(args)
        gpu_only = [x for x in (getattr(args, "only", None) or []) if x in ("mixed", "profile")]
        if gpu_only:
            raise ValueError(f"bench: --only {' '.join(gpu_only)} expected --device cuda (sections of the GPU "
                             f"bench), got --device cpu")
        from . import bench
        return bench.main(args)
    from . import inference, train
    if c == "pretrain":
        return train.pretrain(args)
    if c == "finetune":
        return train.finetune(args)
    from .model import no_grad
    with no_grad():                                     # inference: no backward follows, so no activations kept
        return {"predict": inference.predict, "fill-mask": inference.fill_mask, "embed": inference.embed}[c](args)


def _precision_op(name):
    from .precision import OPS
    return name in OPS


def _say_backend(args):
    """One line on stderr when --backend names a file: which ops are yours."""
    backend = getattr(args, "backend", None)
    if isinstance(backend, str) and backend not in ("numpy", "numba", "cuda"):
        from .model import get_backend
        print(get_backend(backend).describe(), file=sys.stderr)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            _say_backend(args)
            code = run(args)
        sys.stdout.flush()                              # a closed pipe shows here, inside the handler below
        return code
    except BrokenPipeError:
        # the reader went away (`refbert ... | head`): stop quietly, as Python's documentation advises (signal
        # module, "Note on SIGPIPE"): point stdout at devnull so that the exit's own flush has nowhere to fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as e:  # user errors (bad values, missing or unwritable files): no traceback
        if os.environ.get("REFBERT_DEBUG"):
            raise
        print(f"refbert {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"refbert {args.command}: error: {e.name or e} is missing: pip install 'refbert[train]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
