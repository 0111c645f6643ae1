"""Read and write safetensors files (the format of huggingface/safetensors) with NumPy alone.

A file is three parts, back to back:
    8 bytes     N, the header length, an unsigned 64-bit little-endian integer
    N bytes     the header, a UTF-8 JSON object {name: {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}}
                with an optional "__metadata__": {str: str}; writers pad it with spaces to a multiple of 8 bytes
    the rest    the data buffer: tensor `name` is its bytes [b, e), little-endian, C order
The tensors tile the buffer exactly (sorted by offset, each begins where the previous one ends and the last ends at
the end of the file), and e - b = prod(shape) * itemsize. BF16 is the top half of a float32, so it loads exactly as
float32. Spec: https://github.com/huggingface/safetensors (README, "Format").
"""
import contextlib
import json
import math
import os
import secrets

import numpy as np

from .fileio import parent_folder

# dtype code -> NumPy dtype of the stored bytes (BF16 is read as its raw uint16 bits, then widened to float32)
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
           "I8": "|i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "|u1", "BOOL": "|b1"}
_CODES = {s: c for c, s in _DTYPES.items() if c != "BF16"}   # NumPy dtype string -> code, for writing


def _error(path, msg, key=None):
    where = f"safetensors file '{path}'" + (f", tensor '{key}'" if key is not None else "")
    return ValueError(f"{where}: {msg}")


def _natural(x):
    return type(x) is int and x >= 0        # type(): JSON true/false are bools, a subclass of int


def _header(f, path):
    """Parse and check the header of the open file f, before any data is read.
    Returns ({name: (code, shape, b, e)}, metadata, offset of the data buffer in the file)."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise _error(path, f"expected at least 8 bytes (the header length), got {size}")
    n = int.from_bytes(f.read(8), "little")
    if n > size - 8:
        raise _error(path, f"header length {n} runs past the end of the file ({size} bytes; truncated?)")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except ValueError as e:                  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
        raise _error(path, f"header expected UTF-8 JSON, got {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise _error(path, f"header expected a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _error(path, f"'__metadata__' expected an object of str -> str, got {meta!r}")
    entries, size = {}, size - 8 - n         # from here on, size is that of the data buffer
    for key, ent in header.items():
        if not (isinstance(ent, dict) and {"dtype", "shape", "data_offsets"} <= ent.keys()):
            raise _error(path, f"expected an object with dtype, shape and data_offsets, got {ent!r}", key)
        code, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
        if code not in _DTYPES:
            raise _error(path, f"dtype expected one of {', '.join(_DTYPES)}, got {code!r}", key)
        if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
            raise _error(path, f"shape expected a list of non-negative ints, got {shape!r}", key)
        if not (isinstance(offs, list) and len(offs) == 2 and all(_natural(o) for o in offs)):
            raise _error(path, f"data_offsets expected [begin, end] of non-negative ints, got {offs!r}", key)
        entries[key] = (code, tuple(shape), *offs)
    end = 0
    for key, (code, shape, b, e) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
        if b != end or e < b:
            raise _error(path, f"data_offsets expected [{end}, >={end}] (right after the previous tensor), "
                               f"got [{b}, {e}] (out of order, a gap or an overlap)", key)
        if e > size:
            raise _error(path, f"data_offsets [{b}, {e}] run past the end of the {size}-byte data buffer "
                               f"(truncated file?)", key)
        want = math.prod(shape) * np.dtype(_DTYPES[code]).itemsize
        if e - b != want:
            raise _error(path, f"expected {want} bytes for {code} of shape {list(shape)}, got {e - b}", key)
        end = e
    if end != size:
        raise _error(path, f"the tensors cover {end} bytes of the {size}-byte data buffer (trailing bytes)")
    return entries, meta, 8 + n


def load_file(path, dtype=None):
    """Every tensor of the file, as {name: fresh, writable, C-contiguous array}. BF16 loads as float32.
    dtype (np.float32 or np.float64, optional) converts float tensors; integer and bool tensors are kept."""
    try:
        ok = dtype is None or np.dtype(dtype).type in (np.float32, np.float64)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"load_file: argument 'dtype' expected None, np.float32 or np.float64, got {dtype!r}")
    path, out = os.fspath(path), {}
    with open(path, "rb") as f:
        entries, _, start = _header(f, path)  # checked whole first: a bad file never yields a partial dict
        for key, (code, shape, b, e) in entries.items():
            x = np.empty(shape, _DTYPES[code])
            f.seek(start + b)
            if f.readinto(x.reshape(-1).view(np.uint8)) != e - b:   # reads straight into the owned array
                raise _error(path, "file ended while reading (changed on disk?)", key)
            if code == "BF16":                # bf16 bits are the high 16 bits of the float32 of the same value
                bits, x = x, np.empty(shape, "<f4")
                np.left_shift(bits, 16, out=x.view("<u4"), dtype="<u4")
            if dtype is not None and x.dtype.kind == "f":
                x = x.astype(dtype, copy=False)
            out[key] = x
    return out


def load_metadata(path):
    """The file's "__metadata__" dict of str -> str, or {} when it has none."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        return _header(f, path)[1]


def load_dtypes(path):
    """{name: the dtype code stored in the file ("F32", "BF16", ...)}: what load_file's arrays were before BF16
    was widened to float32, for a caller that must know the precision a tensor was written in."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        return {key: ent[0] for key, ent in _header(f, path)[0].items()}


def save_file(tensors, path, metadata=None):
    """Write {name: array} to path (names sorted, tensors back to back) with optional str -> str metadata.
    Atomic: the bytes go to a temporary file beside path, are fsynced, then renamed onto path, so path holds either
    the previous file or the complete new one, never a partial write."""
    path = os.fspath(path)
    if not isinstance(tensors, dict):
        raise ValueError(f"save_file: argument 'tensors' expected a dict of str -> numpy array, "
                         f"got {type(tensors).__name__}")
    if metadata is not None and not (isinstance(metadata, dict) and
                                     all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ValueError(f"save_file: argument 'metadata' expected None or a dict of str -> str, got {metadata!r}")
    for key in tensors:                       # before sorted(), which fails obscurely on mixed key types
        if not isinstance(key, str) or key == "__metadata__":
            raise ValueError(f"save_file: key {key!r} expected a str other than '__metadata__'")
    header = {} if metadata is None else {"__metadata__": metadata}
    arrays, end = [], 0
    for key in sorted(tensors):
        a = tensors[key]
        if not isinstance(a, np.ndarray):
            raise ValueError(f"save_file: tensor '{key}' expected a numpy array, got {type(a).__name__}")
        code = _CODES.get(a.dtype.newbyteorder("<").str)
        if code is None:
            raise ValueError(f"save_file: tensor '{key}' expected dtype one of {', '.join(_CODES.values())}, "
                             f"got {a.dtype}")
        a = a.astype(_DTYPES[code], order="C", copy=False)   # little-endian, C order; copies only if needed
        header[key] = {"dtype": code, "shape": list(a.shape), "data_offsets": [end, end + a.nbytes]}
        arrays.append(a)
        end += a.nbytes
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    head += b" " * (-len(head) % 8)           # pad so the data buffer starts 8-byte aligned
    tmp = os.path.join(parent_folder(path), f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    f = open(tmp, "xb")                       # "x": never clobber another writer's file; umask applies as usual
    try:
        with f:
            f.write(len(head).to_bytes(8, "little") + head)
            for a in arrays:
                f.write(a.data)
            f.flush()
            os.fsync(f.fileno())              # the bytes are on disk before the name points at them
        os.replace(tmp, path)                 # atomic: readers see the old file or the new one, never a mix
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
