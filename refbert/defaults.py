"""The defaults of `refbert pretrain`, in one place: cli.py builds the command's options on them, and train.py fills in
what a run was not given from them (so the library never imports its command line). An option the user does not
give is absent from the parsed arguments, which is how a resumed run tells a change from an untouched default."""

PRETRAIN = dict(
    corpus=None, out=None, resume=False, overwrite=False, allow_changed_schedule=False,
    preset="tiny", config=None, init=None, vocab=None, vocab_size=8000, cased=False,
    objective="nsp", max_seq_length=128, short_seq_prob=0.1, mlm_prob=0.15, max_predictions=20, whole_word=False,
    ngram=1, static_masking=False, dupe_factor=10,
    batch_size=32, lr=1e-3, warmup=0.1, no_bias_correction=False, steps=0, epochs=1,
    eval_every=100, save_every=200, stop_after=0, seed=0, backend="numpy", mixed_precision="no", cuda_graph=False,
)

# On --resume, every argument must be the run's own, except these, which --allow-changed-schedule lets change: they
# move where the run stops, saves and evaluates, and --steps extends (or shortens) its learning-rate schedule.
SCHEDULE = ("steps", "save_every", "eval_every", "stop_after")

# How to run rather than what: never compared on --resume.
CONTROL = ("out", "resume", "overwrite", "allow_changed_schedule", "backend", "cuda_graph")

__all__ = ["PRETRAIN", "SCHEDULE", "CONTROL"]
