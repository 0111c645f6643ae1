"""One training step (forward + backward) of a cuda-backend model captured once as a CUDA graph and replayed per
batch. A bf16-mixed BERT-base step is ~1,200 launches; from Python each costs the host more than the GPU spends on
most of them (the H200 profile: the GPU busy 26 of 53 ms), while a replay is one launch for the whole step.

    step = StepGraph(model)                   # model: a refbert model built with backend="cuda" (fp32 or mixed)
    loss, grads = step(input_ids=ids, attention_mask=am, labels=labels, next_sentence_label=nsp)
    optimizer.step(grads)                     # eager, in place: the next replay reads the updated parameters

A replay computes what `out = model(**batch); grads = model.backward(dloss)` computes at that point: the same
kernels on the same arguments, so the same bits (tests/test_cuda_graph.py compares them on a GPU). How:

  capture   the first call runs the step once eagerly on a side stream (one per process; the warm-up: every kernel
            compiled, the memory the step needs cached by a memory pool of the graph's own), then captures the same
            step on that stream (cudaStreamBeginCapture through CuPy). The dropout generator is
            rewound after both: the capture draws nothing.
  inputs    every host-to-device copy of the captured step (backend._h2d: the staged ids / types / positions / mask,
            the labels and the labelled rows) becomes a slot, a device array the graph reads. A replay fills the
            slots from its batch with the step's own host code (the model's input checks and backend.stage_buffer;
            the labels' flat values, labelled positions and their labels, as the model moves them). At the capture
            each slot is matched to the rules that reproduce its bytes from the batch (a copy no rule explains
            refuses the capture); a batch on which those rules disagree (NSP labels' flat values and their labelled
            values part when one is -100) is captured anew. The slots are the warm-up's arrays (the capture's
            copies are handed them in order, backend._held_slot), alive from before the capture to the graph's end:
            a replay writes them BEFORE the graph runs, so no array of the step may share their memory (one made
            inside the capture could get a block the step used and freed earlier: the earlier kernel would
            overwrite the slot before its reader ran). The capture refuses a slot that overlaps any block it took.
  dropout   every dropout kernel adds refbert_stream_shift (csrc/common.cuh, one __constant__ per module) to its
            stream. A replay sets it to the generator's calls now minus its calls at the capture, launches, sets it
            back to 0, and advances the generator by the step's count: each replay draws the streams an eager step
            would.
  params    read where they are: an in-place update is seen by the next replay; a parameter replaced by a new
            array (model.params[name] = ...) needs a new StepGraph.
  outputs   the loss, the gradients and model outputs (`step.output`) are the graph's arrays, overwritten by the
            next replay: copy what you keep (torch.cuda.graphs' rule).
  shapes    a batch whose slots differ in shape from the captured ones (another B or T, another count of labelled
            positions: set model.mlm_rows to pad them to a fixed count, as `refbert pretrain --cuda-graph` does),
            or another dloss (the fp16 loss scale), is captured anew (`step.captures` counts them):
            the previous graph and all it holds dropped first (close()), as a new StepGraph would start.
  what      CUDA C kernels launched by CuPy, CuPy's own kernels and cuBLAS (through ctypes, blas.py: CuPy's cuBLAS
            wrappers refuse to run during a capture). A Numba launch runs on its own stream
            (not captured) and a read back would break the capture, so the capture refuses unless every versioned
            op of the step ran a CUDA C version (versions.RAN) and no CUDA C launcher fell back (cuda_c.FELL_BACK).

  checked   the first replay of every capture is compared with the eager step on the same batch at the same
            dropout position (validate=True, the default: one eager step per capture); a graph that differs by more
            than REPLAY_TOL of a tensor's scale is dropped with a RuntimeError, never used. Why: on an H100 the
            graphs of BERT-base steps replayed bit for bit, but those of a one-layer H128 model on 16 tokens
            replayed NaN (fp32 with 4 labelled positions, not 3; bf16-mixed always: graph_diag.txt in
            benchmarks/results/cuda-nvidia-h100/). Their slots were then made inside the capture (see inputs): the
            cause, fixed since and reproduced on the H200 (2026-11-27, twice: benchmarks/graph_diag.py, whose
            REFBERT_GRAPH_SLOTS_IN_CAPTURE=1 makes the slots the old way: they overlap the step's memory and every
            bf16-mixed replay is NaN, most fp32 ones too; made as now, every replay equals its eager step bit for
            bit).

On the emulator (REFBERT_CUDA_EMULATE=1) there is no graph: StepGraph(model, emulate=True) runs each call eagerly
through the same slots, shift and rules (the replay's host half, tested in CI); a GPU is needed for the capture.
"""
import os

import numpy as np

from . import backend as K
from . import blas, cuda_c, versions

SHIFT = "refbert_stream_shift"
_SHIFTS = {}        # (csrc file, array module) -> that module's refbert_stream_shift as 8 device bytes, or None


def _slot_rules(model, batch):
    """{rule name: host array} the step could copy to the device, computed from the batch by the model's own host
    code: the staged inputs, and for every integer array of the batch its flat values, its labelled positions
    (!= -100) and the labels there (the MLM head's rows and targets)."""
    from refbert.model import _check_inputs
    who = type(model).__name__
    staged = _check_inputs(who, model.config, model.dtype, batch["input_ids"], batch.get("attention_mask"),
                           batch.get("token_type_ids"), batch.get("position_ids"))
    out = {}
    packed = K.stage_buffer(*staged)
    if packed is not None:
        out["stage"] = packed[0]
    for name, a in batch.items():
        if name in ("input_ids", "attention_mask", "token_type_ids", "position_ids") or a is None:
            continue
        a = np.asarray(a)
        if a.dtype.kind not in "iu":
            continue
        flat = np.ascontiguousarray(a.reshape(-1), np.int64)
        rows = np.flatnonzero(flat != -100)
        out[f"{name}"] = flat
        out[f"{name}: labelled positions"] = rows.astype(np.int64)
        out[f"{name}: labels there"] = flat[rows]
        pad = getattr(model, "mlm_rows", None)
        if name == "labels" and pad is not None and len(rows) <= pad:   # the MLM rows padded (model.mlm_rows)
            extra = pad - len(rows)
            out[f"{name}: labelled positions, padded"] = np.concatenate([rows, np.zeros(extra, np.int64)])
            out[f"{name}: labels there, padded"] = np.concatenate([flat[rows], np.full(extra, -100, np.int64)])
    return out


_STREAM = []


def _capture_stream():
    """The one side stream every capture of this process runs on. Made once and never destroyed: a stream made
    anew for each capture can get the address of a destroyed one, and whatever a library cached by that address
    (cuBLAS's workspace for a stream) would be the dead stream's."""
    if not _STREAM:
        _STREAM.append(K.xp.cuda.Stream(non_blocking=True))
    return _STREAM[0]


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def _refuse_uncapturable(ran0, fell0):
    """RuntimeError naming every Numba version the step ran (versions.RAN past ran0) and every CUDA C launcher that
    handed its call to Numba (cuda_c.FELL_BACK_CALLS past fell0): a CUDA graph cannot capture them."""
    numba = sorted({f"{op} ({dt}) version {key}" for (op, dt, key), n in versions.RAN.items()
                    if n > ran0.get((op, dt, key), 0) and versions.numba_key(key)})
    fell = sorted(f"{op} {v} (handed to Numba: {cuda_c.FELL_BACK.get((op, v))})"
                  for (op, v), n in cuda_c.FELL_BACK_CALLS.items() if n > fell0.get((op, v), 0))
    if numba or fell:
        raise RuntimeError(f"StepGraph: the step ran what a CUDA graph cannot capture: {'; '.join(numba + fell)} "
                           f"(a Numba version launches on its own stream; pin CUDA C versions with "
                           f"REFBERT_CUDA_VERSIONS)")


class StepGraph:
    """forward + backward of `model` as one CUDA graph; see the module docstring. dloss: the backward's dloss
    (GradScaler's scale for fp16-mixed); emulate: no graph, each call an eager step through the slots, the shift and
    the rules (the default without a GPU: the emulator's test of the replay's host half); validate: the first replay
    of each capture is compared with the eager step on the same batch at the same dropout position (`checked`:
    (worst difference, tensor)), and a graph that differs by more than REPLAY_TOL is dropped with a RuntimeError."""

    def __init__(self, model, dloss=1.0, emulate=None, validate=True):
        if getattr(model, "backend", None) != "cuda":
            raise ValueError(f"StepGraph: argument 'model' expected a refbert model built with backend='cuda', got "
                             f"backend={getattr(model, 'backend', None)!r}")
        self.model, self.dloss = model, float(dloss)
        self.emulate = K.MODE != "gpu" if emulate is None else bool(emulate)
        if not self.emulate and K.MODE != "gpu":
            raise ValueError(f"StepGraph: argument 'emulate' expected True without a GPU (the backend runs in mode "
                             f"{K.MODE!r}: no CUDA graph), got False")
        self.graph = self.slots = self.pool = self.stream = None
        self.captures, self.replays, self.calls, self.c0 = 0, 0, 0, 0
        self.output = self.grads = None
        self.validate, self.checked = bool(validate), None
        self._allocs, self._found, self._kept = [], None, None
        self.overlaps = []  # under REFBERT_GRAPH_SLOTS_IN_CAPTURE=1 (a diagnostic): the slots sharing the step's memory

    # -- the replay's host half --------------------------------------------------------------------------------
    def _hosts(self, batch):
        """The slots' host arrays for this batch (each by its rule), or None when a shape or dtype differs from
        the captured slot's (a new capture)."""
        rules = _slot_rules(self.model, batch)
        hosts = []
        for d, names in self.slots:
            h = rules.get(names[0])
            if h is None or h.shape != d.shape or h.dtype != d.dtype or \
                    any(not _same(rules.get(r), h) for r in names[1:]):     # rules that agreed at the capture
                return None                                                # and no longer do: capture anew
            hosts.append(h)
        return hosts

    def _set_shift(self, shift):
        """refbert_stream_shift = shift in every CUDA C module compiled so far, in stream order."""
        value = np.array([shift], np.uint64).view(np.uint8)
        for key, mod in list(cuda_c.MODULES.items()):
            if key[1] is not K.xp:
                continue
            if key not in _SHIFTS:                  # each module's 8 bytes, looked up once per process
                try:
                    ptr = mod.get_global(SHIFT)
                    _SHIFTS[key] = ptr if isinstance(ptr, np.ndarray) else K.xp.ndarray((8,), np.uint8, memptr=ptr)
                except Exception:                   # (a module without common.cuh: no dropout in it)
                    _SHIFTS[key] = None
            if _SHIFTS[key] is not None:
                K._h2d(value, out=_SHIFTS[key])

    def _step(self, batch):
        out = self.model(**batch)
        return out, self.model.backward(self.dloss)

    # -- capture -----------------------------------------------------------------------------------------------
    def close(self):
        """Drop the graph and everything it holds (its outputs, slots, memory pool and stream): after the last
        replay, or before a new capture (which starts from this clean state, as a new StepGraph would)."""
        if not self.emulate and self.graph is not None:
            K.xp.cuda.get_current_stream().synchronize()        # (no replay may still be reading what goes)
        self.graph = self.slots = self.output = self.grads = self._kept = self._found = None
        pool, self.pool, self.stream = getattr(self, "pool", None), None, None
        if pool is not None:
            pool.free_all_blocks()

    def _warm_then_capture(self, batch, c0, begin, end):
        """The warm-up step (its copies' device arrays kept: the slots, backend._held_slot), the generator rewound,
        then the step again between begin() and end() (a capture on a GPU), its copies handed the warm-up's arrays
        and listed in self._found. -> (output, grads) of the second step."""
        ran0, fell0 = dict(versions.RAN), dict(cuda_c.FELL_BACK_CALLS)
        K.WARMUP = []
        try:
            self._step(batch)                       # (its results dropped)
        finally:
            held, K.WARMUP = K.WARMUP, None
        # the warm-up ran what the capture would: a Numba launch in it is refused here, by name, before the capture
        # begins (inside one, the launch invalidates the capture and CUDA says only cudaErrorStreamCaptureInvalidated)
        _refuse_uncapturable(ran0, fell0)
        self.model.dropout_rng.calls = c0
        K.CAPTURE, K.HELD = [], list(held)
        try:
            begin()
            try:
                out, grads = self._step(batch)
            finally:
                end()
            if K.HELD:
                raise RuntimeError(f"StepGraph: the captured step copied {len(held) - len(K.HELD)} arrays to the "
                                   f"device where its warm-up copied {len(held)}: the step is not the same step twice")
        finally:
            self._found, K.CAPTURE, K.HELD = K.CAPTURE, None, None
        return out, grads

    def _capture(self, batch):
        rng = self.model.dropout_rng
        c0 = rng.calls
        self.close()
        ran0, fell0 = dict(versions.RAN), dict(cuda_c.FELL_BACK_CALLS)
        if self.emulate:                            # an eager warm-up, then an eager step whose copies are the slots
            out, grads = self._warm_then_capture(batch, c0, lambda: None, lambda: None)
            graph = None
        else:
            xp = K.xp
            xp.cuda.get_current_stream().synchronize()   # the side stream does not wait for the current one
            self.pool = xp.cuda.MemoryPool()        # the graph's memory: nothing else allocates from it
            self.stream = _capture_stream()
            ok, why = blas.usable()
            if not ok:
                raise RuntimeError(f"StepGraph: cannot capture: cuBLAS through ctypes is unavailable ({why}), and "
                                   f"CuPy's cuBLAS wrappers refuse to run during a capture")
            blas.lt_usable()                        # (its self-check reads back: never for the first time in a capture)
            self._allocs = allocs = []              # (pointer, bytes) of every block the capture took (the tests)
            no_reuse = os.environ.get("REFBERT_GRAPH_NO_REUSE", "0") not in ("", "0")
            if no_reuse:
                # a diagnostic (benchmarks/graph_diag.py): every block of the warm-up and the capture kept until
                # close(), so no two arrays of the graph ever share memory
                self._kept = []

            def malloc(n, pool_malloc=self.pool.malloc, kept=self._kept):
                p = pool_malloc(n)
                if K.CAPTURE is not None:
                    allocs.append((int(p.ptr), int(n)))
                if no_reuse:
                    kept.append(p)
                return p
            ended = []

            def begin():
                self.stream.synchronize()
                self.stream.begin_capture()

            def end():
                ended.append(self.stream.end_capture())
            with xp.cuda.using_allocator(malloc), self.stream:
                out, grads = self._warm_then_capture(batch, c0, begin, end)
            graph = ended[0]
        _refuse_uncapturable(ran0, fell0)
        calls = rng.calls - c0                      # the step's dropout calls
        rng.calls = c0
        rules = _slot_rules(self.model, batch)
        slots = []
        for d, host in self._found:
            hit = [r for r, h in rules.items() if _same(h, host)]
            if not hit:
                raise RuntimeError(f"StepGraph: cannot capture: the step copies a host array of shape {host.shape} "
                                   f"and dtype {host.dtype} to the device and no rule reproduces it from the batch")
            slots.append((d, hit))
            if not self.emulate:                    # (the warm-up's arrays: never given to the step's own arrays)
                p, n = int(d.data.ptr), int(d.nbytes)
                if any(p < q + m and q < p + n for q, m in self._allocs):
                    why = f"slot {hit[0]!r} shares device memory with an array the captured step allocates"
                    if os.environ.get("REFBERT_GRAPH_SLOTS_IN_CAPTURE", "0") in ("", "0"):
                        raise RuntimeError(f"StepGraph: cannot capture: {why}")
                    self.overlaps.append(why)       # the diagnostic's slots, made inside the capture: listed
        self.graph, self.slots, self.c0, self.calls = graph, slots, c0, calls
        self.output, self.grads = (None, None) if self.emulate else (out, grads)
        self.captures += 1

    # -- a step ------------------------------------------------------------------------------------------------
    def __call__(self, dloss=None, **batch):
        """(loss, grads) of this batch, as model(**batch); model.backward(dloss) would give them now: the captured
        step replayed (captured first: at the first call, and when a shape or dloss changes)."""
        if "input_ids" not in batch:
            raise ValueError("StepGraph: expected the forward's keyword arguments (input_ids=..., labels=...), "
                             "got no input_ids")
        if dloss is not None and float(dloss) != self.dloss:
            self.dloss, self.slots = float(dloss), None
        hosts = None if self.slots is None else self._hosts(batch)
        if hosts is None:
            self._capture(batch)
            hosts = self._hosts(batch)
            self.checked = None
        rng = self.model.dropout_rng
        now = rng.calls
        reference = self._eager(batch) if self.validate and self.checked is None else None
        for (d, _), h in zip(self.slots, hosts):
            K._h2d(h, out=d)
        self._set_shift(now - self.c0)
        try:
            self._replay(batch, hosts)
        finally:
            self._set_shift(0)
            rng.calls = now + self.calls
        self.replays += 1
        if reference is not None:
            self.checked = _worst(reference, dict(self.grads, loss=self.output["loss"]))
            if not self.checked[0] <= REPLAY_TOL:
                worst, name = self.checked
                self.close()
                raise RuntimeError(f"StepGraph: the captured step's first replay differs from the eager step by "
                                   f"{worst:.2e} of the tensor's scale at {name} (bound {REPLAY_TOL:g}; NaN counts "
                                   f"as a difference): the graph is dropped, run the step eagerly (model(**batch); "
                                   f"model.backward())")
        return self.output["loss"], self.grads

    def _eager(self, batch):
        """The eager step at the dropout position the replay will take, as host copies (the generator rewound)."""
        rng = self.model.dropout_rng
        c = rng.calls
        out = self.model(**batch)
        ref = dict(self.model.backward(self.dloss), loss=out["loss"])
        rng.calls = c
        return {k: np.asarray(K.to_host(v), np.float64) for k, v in ref.items()}

    def _replay(self, batch, hosts):
        if not self.emulate:
            self.graph.launch(K.xp.cuda.get_current_stream())
            return
        rng = self.model.dropout_rng                # the emulator: the step from the captured position, reading
        rng.calls = self.c0                         # the slots its copies would have made
        K.REPLAY = list(zip(self.slots, hosts))
        try:
            self.output, self.grads = self._step(batch)
        finally:
            left, K.REPLAY = K.REPLAY, None
        if left:
            raise RuntimeError(f"StepGraph: the replayed step copied {len(self.slots) - len(left)} of "
                               f"{len(self.slots)} slots")


REPLAY_TOL = 1e-6   # the first replay against the eager step, relative to each tensor's largest |value|: the same
#                     kernels on the same arguments give the same bits (0 on an H100 at BERT-base shapes); 1e-6 leaves
#                     room for a cuBLAS algorithm chosen differently (float32 rounding, ~1e-7 per product sum)


def _worst(reference, got):
    """(worst |got - reference| / max |reference| over the tensors, its name); a NaN or inf anywhere: (inf, name)."""
    worst, where = -1.0, None
    for k, e in reference.items():
        g = np.asarray(K.to_host(got[k]), np.float64)
        if not np.isfinite(g).all():
            return float("inf"), k
        d = float(np.abs(g - e).max(initial=0.0)) / max(float(np.abs(e).max(initial=0.0)), 1e-30)
        if d > worst:
            worst, where = d, k
    return worst, where
