"""The optimizer's step on the GPU in a few launches: csrc/optim.cu's multi-tensor kernels behind refbert.optim.

refbert.optim (AdamW.step, clip_grad_norm, GradScaler.unscale_) is the spec: per-array NumPy code that, on CuPy
arrays, launches 13 element-wise kernels a parameter for AdamW's update (14 with weight decay) and 5 more for its
check and the clipping (BERT-base's 206 tensors: 3,788 launches a step, benchmarks/results/host_overhead.md; its
forward and backward make 560). When every array of a call is a device array this module takes (`why_not(arrays)`
is None), refbert.optim hands the call here instead:

    grad_stats(arrays)       per tensor (sum of g² in float64, max |g|): one launch pair for every tensor and one
                             copy to the host; AdamW's checks read the maxima (NumPy's exactly), clip_grad_norm the
                             sums (float64 in a fixed order, not NumPy's pairwise one: within 4e-14 relative of
                             the exact sum at BERT's sizes, csrc/optim.cu), GradScaler.unscale_ the maxima
                             (non-finite: an inf or NaN found)
    scale_(arrays, f)        g *= f in place, f cast to g's dtype: NumPy's bits (clipping, unscaling)
    adamw_(...)              AdamW.step's update of p, m, v in place, NumPy's operations in NumPy's order: its bits

Versions: optim.cu v1 (the only one). REFBERT_FUSED_OPTIM=0 turns this path off (refbert.optim then runs its
per-array code on the device arrays: the A/B of benchmarks and the spec's own run). Which path ran is what
refbert.optim.LAST_PATH records (refbert.optim.describe()).

Tables: a tensor's data pointer, size and blocks go to the device once per set of arrays (a set seen before reuses
its tables: the model's parameters and moments never move, and a CUDA-graph step hands back the same gradient
buffers every step, so such a step copies nothing to the device; an eager step's new gradient arrays cost two
small copies of their addresses, benchmarks/results/host_overhead.md).
"""
import collections

import numpy as np

from . import _common as C
from . import cuda_c

SOURCE = "optim.cu"
CHUNK = 4096            # elements a block (csrc/optim.cu OPT_CHUNK)
THREADS = 256           # threads a block (csrc/optim.cu's OPT_THREADS, on a GPU and on CPU threads alike)
_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
_CACHE = collections.OrderedDict()      # (kind, xp, device, key) -> tables; the most recent _KEEP kept
_KEEP = 16


KERNELS = ("adamw_v1_f32", "adamw_v1_f64", "scale_v1_f32", "scale_v1_f64", "grad_stats_partial_v1_f32",
           "grad_stats_partial_v1_f64", "grad_stats_final_v1")


def prepare(arrays):
    """Build every kernel of this module for the arrays' array module and device (NVRTC on a GPU, g++ on the
    emulator; once): refbert.optim calls it before it commits to this path, so a kernel that fails to build means
    the per-array code, said, instead of an error halfway through a step."""
    xp = C.xp_of(arrays[0])
    with xp.cuda.Device(_device(arrays[0])):
        for name in KERNELS:
            cuda_c.kernel(SOURCE, name, xp)


def owns(arrays):
    """Whether these are arrays of the kind this module is for (CuPy's or the emulator's device arrays): for those,
    refbert.optim says when the kernels cannot take them; another library's arrays simply take the per-array code."""
    return bool(arrays) and all(C.on_device(a) for a in arrays)


def why_not(arrays):
    """None when the kernels take these arrays (device arrays, CuPy's or the emulator's, of one array module,
    float32 / float64, C-contiguous), else why not, in words."""
    if not arrays:
        return "no arrays"
    xp = None
    for a in arrays:
        if not C.on_device(a):
            return f"{type(a).__module__.split('.')[0]} arrays (the kernels take CuPy's)"
        if xp is None:
            xp, dev = C.xp_of(a), _device(a)
        elif C.xp_of(a) is not xp or _device(a) != dev:
            return "arrays of more than one array module or device"
        if a.dtype not in _SUFFIX:
            return f"dtype {a.dtype} (the kernels take float32 and float64)"
        if not a.flags.c_contiguous:
            return "a non-contiguous array"
    return None


def _device(a):
    """The device an array lives on, as a number (CuPy's Device id; 0 for the emulator's arrays)."""
    return int(getattr(getattr(a, "device", None), "id", 0) or 0)


def _cached(kind, xp, key, make):
    """The device table of (kind, key) on the current device, made by make() the first time."""
    full = (kind, xp, xp.cuda.Device().id, key)                 # (the current device: the arrays')
    t = _CACHE.get(full)
    if t is None:
        t = _CACHE[full] = make()
        while len(_CACHE) > _KEEP:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(full)
    return t


def _layout(xp, sizes):
    """(size, btens, bfirst, first, nb) of tensors of these sizes: CHUNK elements a block (csrc/optim.cu)."""
    def make():
        nblk = [(n + CHUNK - 1) // CHUNK for n in sizes]
        nb = sum(nblk)
        btens = np.repeat(np.arange(len(sizes), dtype=np.int32), nblk)
        bfirst = np.concatenate([np.arange(k, dtype=np.int64) * CHUNK for k in nblk] or [np.zeros(0, np.int64)])
        first = np.concatenate([[0], np.cumsum(nblk)]).astype(np.int32)
        dev = [xp.asarray(np.ascontiguousarray(a)) for a in (np.asarray(sizes, np.int64), btens if nb else
                                                             np.zeros(1, np.int32), bfirst if nb else
                                                             np.zeros(1, np.int64), first)]
        return (*dev, nb)
    return _cached("layout", xp, tuple(sizes), make)


def _pointers(xp, groups):
    """The (k, N) uint64 table of the data pointers of k lists of N arrays, on the device."""
    key = tuple(a.data.ptr for g in groups for a in g)
    return _cached(("ptr", len(groups)), xp, key,
                   lambda: xp.asarray(np.asarray(key, np.uint64).reshape(len(groups), -1)))


def _by_dtype(arrays):
    """{dtype: [index, ...]} in the arrays' order."""
    out = {}
    for i, a in enumerate(arrays):
        out.setdefault(a.dtype, []).append(i)
    return out


def _grad_stats(arrays):
    """(N, 2) float64 NumPy array: per array, the sum of its squares in float64 and its largest magnitude (NaN if
    it holds a NaN, inf if an inf), by csrc/optim.cu grad_stats_partial_v1 / grad_stats_final_v1; one copy to the
    host for all of them (the only synchronisation)."""
    xp = C.xp_of(arrays[0])
    outs = []
    for dt, idx in _by_dtype(arrays).items():
        group = [arrays[i] for i in idx]
        size, btens, bfirst, first, nb = _layout(xp, [a.size for a in group])
        out = xp.zeros((len(group), 2), np.float64)
        if nb:
            ptr = _pointers(xp, [group])
            psum, pmax = xp.empty(nb, np.float64), xp.empty(nb, np.float64)
            cuda_c.kernel(SOURCE, f"grad_stats_partial_v1_{_SUFFIX[dt]}", xp)(
                (nb,), (THREADS,), (ptr, size, btens, bfirst, psum, pmax))
            cuda_c.kernel(SOURCE, "grad_stats_final_v1", xp)(
                (-(-len(group) // (THREADS // 32)),), (THREADS,),        # a warp a tensor
                (psum, pmax, first, cuda_c._i(len(group)), out))
        outs.append((idx, out))
    host = xp.concatenate([o for _, o in outs]).get() if len(outs) > 1 else outs[0][1].get()
    res = np.empty((len(arrays), 2), np.float64)
    res[np.concatenate([idx for idx, _ in outs])] = host
    return res


def _scale_(arrays, factor):
    """Every array *= factor in place (factor cast to each array's dtype, as NumPy casts a Python float)."""
    xp = C.xp_of(arrays[0])
    for dt, idx in _by_dtype(arrays).items():
        group = [arrays[i] for i in idx]
        size, btens, bfirst, _, nb = _layout(xp, [a.size for a in group])
        if nb:
            cuda_c.kernel(SOURCE, f"scale_v1_{_SUFFIX[dt]}", xp)(
                (nb,), (THREADS,), (_pointers(xp, [group]), size, btens, bfirst, dt.type(factor)))


def _adamw_(params, grads, ms, vs, decay, b1, omb1, b2, omb2, eps, lr, wd, dfac, step, bc2, correct):
    """refbert.optim.AdamW.step's update of every (p, g, m, v) in place, one launch per dtype (csrc/optim.cu
    adamw_v1_f32 / _f64). decay: per tensor, whether its decay term applies (decayed and λ != 0); the scalars are
    the Python floats AdamW.step computes (b1, 1 - b1, b2, 1 - b2, eps, lr, λ, 1 - lr λ, lr / (1 - b1^t),
    sqrt(1 - b2^t)), cast here to each group's dtype as NumPy casts them."""
    xp = C.xp_of(params[0])
    for dt, idx in _by_dtype(params).items():
        ps, gs, m_, v_ = ([arrays[i] for i in idx] for arrays in (params, grads, ms, vs))
        size, btens, bfirst, _, nb = _layout(xp, [a.size for a in ps])
        if not nb:
            continue
        dec = _cached("decay", xp, tuple(bool(decay[i]) for i in idx),
                      lambda: xp.asarray(np.asarray([bool(decay[i]) for i in idx], np.int32)))
        f = dt.type
        cuda_c.kernel(SOURCE, f"adamw_v1_{_SUFFIX[dt]}", xp)(
            (nb,), (THREADS,), (_pointers(xp, [ps, gs, m_, v_]), size, btens, bfirst, dec, cuda_c._i(len(ps)),
                                f(b1), f(omb1), f(b2), f(omb2), f(eps), f(lr), f(wd), f(dfac), f(step), f(bc2),
                                cuda_c._i(1 if correct else 0)))


def _on_their_device(fn):
    """fn run with the arrays' device current (the tables and launches are made there)."""
    def wrapped(arrays, *args):
        xp = C.xp_of(arrays[0])
        with xp.cuda.Device(_device(arrays[0])):
            return fn(arrays, *args)
    wrapped.__name__, wrapped.__doc__ = fn.__name__.lstrip("_"), fn.__doc__
    return wrapped


grad_stats = _on_their_device(_grad_stats)
scale_ = _on_their_device(_scale_)
adamw_ = _on_their_device(_adamw_)
