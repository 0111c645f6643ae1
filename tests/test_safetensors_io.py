"""refbert.safetensors_io against itself (round trips), against the real `safetensors` package (an independent
reader and writer), against damaged files, and under a write that fails midway.

Every comparison is bit-exact (tobytes), since storing and loading must not change a single bit; NaN payloads and
-0.0 are included for that reason. The expected layout facts (8-byte little-endian length, space-padded JSON,
data offsets) come from the format spec, https://github.com/huggingface/safetensors README.
"""
import builtins
import json
import os
import struct

import numpy as np
import pytest

from refbert import safetensors_io as sio

DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_]
SHAPES = [(), (0,), (2, 0, 3), (3,), (2, 5)]


def sample(dtype, shape, rng):
    """Random bits for floats (so NaNs with payloads, infinities, subnormals and -0.0 all occur), ranges for ints."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.integers(0, 256, size=(*shape, dt.itemsize), dtype=np.uint8).view(dt).reshape(shape)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def write_raw(path, header, data=b""):
    """A file laid out by hand from the spec, to feed the reader damaged headers."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


@pytest.fixture
def tensors():
    rng = np.random.default_rng(0)
    return {f"{np.dtype(d).name}_{i}": sample(d, s, rng) for d in DTYPES for i, s in enumerate(SHAPES)}


# ----------------------------------------------------------------------------------------------------------------
# round trip and layout

def test_round_trip_every_dtype_and_shape(tmp_path, tensors):
    sio.save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "np", "note": "ü"})
    got = sio.load_file(tmp_path / "t.safetensors")
    assert got.keys() == tensors.keys()
    for k, a in tensors.items():
        assert same(got[k], a), k
        assert got[k].flags.writeable and got[k].flags.owndata and got[k].flags.c_contiguous, k
    assert sio.load_metadata(tmp_path / "t.safetensors") == {"format": "np", "note": "ü"}


def test_layout_follows_spec(tmp_path):
    sio.save_file({"b": np.arange(3, dtype=np.int64), "a": np.ones((2, 2), np.float32)}, tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8:8 + n].decode().rstrip(" ").endswith("}")   # padded with spaces only
    header = json.loads(raw[8:8 + n])
    assert list(header) == ["a", "b"]                               # sorted names, contiguous offsets
    assert header["a"] == {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    assert header["b"] == {"dtype": "I64", "shape": [3], "data_offsets": [16, 40]}
    assert len(raw) == 8 + n + 40 and sio.load_metadata(tmp_path / "t.safetensors") == {}


def test_non_contiguous_and_big_endian_input(tmp_path):
    a = np.arange(24, dtype=np.float64).reshape(4, 6)
    t = {"strided": a[:, ::2], "fortran": np.asfortranarray(a), "big": a.astype(">f4")}
    sio.save_file(t, tmp_path / "t.safetensors")
    got = sio.load_file(tmp_path / "t.safetensors")
    for k, x in t.items():
        assert np.array_equal(got[k], x) and got[k].dtype == x.dtype.newbyteorder("<"), k


@pytest.mark.parametrize("bad, words", [
    ({"x": [1.0]}, ["'x'", "numpy array", "list"]),
    ({"x": np.zeros(2, np.complex64)}, ["'x'", "complex64"]),
    ({"x": np.array(["a"], dtype=object)}, ["'x'", "object"]),
    ({1: np.zeros(2)}, ["key 1"]),
    ({"__metadata__": np.zeros(2)}, ["'__metadata__'"]),
])
def test_save_rejects_bad_input_and_writes_nothing(tmp_path, bad, words):
    with pytest.raises(ValueError) as e:
        sio.save_file(bad, tmp_path / "t.safetensors")
    assert all(w in str(e.value) for w in words), str(e.value)
    assert os.listdir(tmp_path) == []


def test_save_rejects_bad_metadata(tmp_path):
    with pytest.raises(ValueError, match="metadata"):
        sio.save_file({"x": np.zeros(1)}, tmp_path / "t.safetensors", metadata={"n": 1})


# ----------------------------------------------------------------------------------------------------------------
# dtype conversion on load

def test_dtype_conversion_on_load(tmp_path):
    rng = np.random.default_rng(1)
    t = {"f64": rng.standard_normal((3, 4)), "f16": rng.standard_normal(5).astype(np.float16),
         "i64": np.arange(4), "mask": np.array([True, False])}
    sio.save_file(t, tmp_path / "t.safetensors")
    for dtype in (np.float32, np.float64):
        got = sio.load_file(tmp_path / "t.safetensors", dtype=dtype)
        assert same(got["f64"], t["f64"].astype(dtype)) and same(got["f16"], t["f16"].astype(dtype))
        assert same(got["i64"], t["i64"]) and same(got["mask"], t["mask"])   # non-floats untouched
    with pytest.raises(ValueError, match="'dtype'"):
        sio.load_file(tmp_path / "t.safetensors", dtype=np.int32)


# ----------------------------------------------------------------------------------------------------------------
# interop with the reference implementation

def test_reads_files_written_by_safetensors(tmp_path, tensors):
    st_np = pytest.importorskip("safetensors.numpy")
    st_np.save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"origin": "safetensors"})
    got = sio.load_file(tmp_path / "ref.safetensors")
    assert got.keys() == tensors.keys() and all(same(got[k], a) for k, a in tensors.items())
    assert sio.load_metadata(tmp_path / "ref.safetensors") == {"origin": "safetensors"}


def test_reads_bf16_written_by_safetensors_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3e38, -1.5])
    t = {"w": torch.randn(4, 3, generator=g).bfloat16(), "s": special.bfloat16(), "e": torch.zeros(0, 2).bfloat16(),
         "scalar": torch.tensor(2.5).bfloat16(), "f": torch.randn(3, generator=g)}
    st_torch.save_file(t, str(tmp_path / "bf16.safetensors"))
    for dtype in (None, np.float64):
        got = sio.load_file(tmp_path / "bf16.safetensors", dtype=dtype)
        for k, x in t.items():
            want = x.float().numpy() if dtype is None else x.double().numpy()   # torch's own bf16 -> float
            assert same(got[k], want), k


def test_safetensors_reads_files_written_by_us(tmp_path, tensors):
    safetensors = pytest.importorskip("safetensors")
    st_np = pytest.importorskip("safetensors.numpy")
    sio.save_file(tensors, tmp_path / "ours.safetensors", metadata={"origin": "refbert"})
    got = st_np.load_file(str(tmp_path / "ours.safetensors"))
    assert got.keys() == tensors.keys() and all(same(got[k], a) for k, a in tensors.items())
    with safetensors.safe_open(str(tmp_path / "ours.safetensors"), framework="np") as f:
        assert f.metadata() == {"origin": "refbert"}


# ----------------------------------------------------------------------------------------------------------------
# damaged files: every one a ValueError naming the file (and the tensor, where one is to blame), never a partial dict

@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.safetensors"
    sio.save_file({"a": np.arange(6, dtype=np.float32), "b": np.arange(4, dtype=np.int64)}, path)
    return path


def test_truncated_file_is_rejected_at_every_cut(tmp_path, good):
    raw = good.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    cuts = [0, 3, 7, 8, 8 + n // 2, 8 + n, 8 + n + 1, 8 + n + 24, 8 + n + 30, len(raw) - 1]
    for cut in cuts:
        path = tmp_path / f"cut{cut}.safetensors"
        path.write_bytes(raw[:cut])
        with pytest.raises(ValueError) as e:
            sio.load_file(path)
        assert str(path) in str(e.value), (cut, str(e.value))
        if cut > 8 + n:
            assert "truncated" in str(e.value) and ("'a'" in str(e.value) or "'b'" in str(e.value)), str(e.value)


@pytest.mark.parametrize("header, data, words", [
    (b"\xff\xfe{}", b"", ["UTF-8 JSON"]),
    (b'{"a": ', b"", ["UTF-8 JSON"]),
    (b"[1, 2]", b"", ["JSON object", "list"]),
    ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, ["'a'", "data_offsets"]),
    ({"a": {"dtype": "F8", "shape": [1], "data_offsets": [0, 1]}}, b"\0", ["'a'", "'F8'"]),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, ["'a'", "shape"]),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, ["'a'", "past the end"]),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, ["'a'", "expected 8 bytes"]),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, ["'a'", "out of order"]),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, ["'b'", "overlap"]),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, ["'a'", "gap"]),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, ["trailing"]),
    ({"__metadata__": {"n": 1}}, b"", ["__metadata__"]),
    # a span longer than shape x itemsize (4 bytes for one F32): a mismatch whichever way, not only when short
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, ["'a'", "expected 4 bytes", "got 8"]),
    # JSON true / false are not integers (Python's bool is an int subclass; the spec's fields are unsigned ints)
    ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4, ["'a'", "shape", "True"]),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [False, 4]}}, b"\0" * 4, ["'a'", "data_offsets"]),
    # data_offsets is exactly [begin, end]
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 4]}}, b"\0" * 4, ["'a'", "data_offsets"]),
    ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [0]}}, b"", ["'a'", "data_offsets"]),
    # a real safetensors code this reader does not support (float8) is refused by name, not a KeyError later
    ({"a": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}, b"\0", ["'a'", "'F8_E4M3'"]),
])
def test_malformed_header_is_rejected(tmp_path, header, data, words):
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    for fn in (sio.load_file, sio.load_metadata):
        with pytest.raises(ValueError) as e:
            fn(path)
        assert str(path) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_header_length_past_end_of_file(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        sio.load_file(path)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        sio.load_file(tmp_path / "nope.safetensors")


# ----------------------------------------------------------------------------------------------------------------
# atomic save: a failure at any step leaves the previous file intact and no temporary file behind

def _fail_fsync(monkeypatch):
    def boom(fd):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(os, "fsync", boom)


def _fail_replace(monkeypatch):
    def boom(src, dst):
        raise OSError("rename failed (simulated)")
    monkeypatch.setattr(os, "replace", boom)


def _fail_mid_data(monkeypatch):
    """open() hands out a file whose second write (the first tensor's bytes) dies after writing half of them."""
    real_open = builtins.open

    def fake_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        real_write, calls = f.write, []

        def write(b):
            calls.append(b)
            if len(calls) == 2:
                real_write(memoryview(b).cast("B")[: memoryview(b).nbytes // 2])
                raise KeyboardInterrupt       # not an Exception: the cleanup must still run
            return real_write(b)
        f.write = write
        return f
    monkeypatch.setattr(sio, "open", fake_open, raising=False)


@pytest.mark.parametrize("fail", [_fail_fsync, _fail_replace, _fail_mid_data])
def test_failed_save_keeps_previous_file(tmp_path, monkeypatch, fail):
    path = tmp_path / "model.safetensors"
    sio.save_file({"w": np.arange(8, dtype=np.float32)}, path, metadata={"v": "1"})
    before = path.read_bytes()
    fail(monkeypatch)
    with pytest.raises((OSError, KeyboardInterrupt)):
        sio.save_file({"w": np.full(1000, 7.0), "x": np.ones(3, np.int32)}, path, metadata={"v": "2"})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert same(sio.load_file(path)["w"], np.arange(8, dtype=np.float32))


def test_a_missing_folder_is_named_as_such(tmp_path):
    """An atomic write into a folder that does not exist names that folder, not the hidden temporary file it would
    have made there ('No such file or directory: .../.model.safetensors.3fa2.tmp')."""
    from refbert import fileio
    from refbert.config import BertConfig
    target = tmp_path / "missing" / "model.safetensors"
    writes = [lambda: sio.save_file({"w": np.ones(2)}, target), lambda: fileio.write_text(target, "x"),
              lambda: BertConfig().to_json_file(str(target))]
    for write in writes:
        with pytest.raises(FileNotFoundError) as e:
            write()
        assert str(e.value) == f"cannot write '{target}': the folder '{tmp_path / 'missing'}' does not exist"
    (tmp_path / "afile").write_text("")
    with pytest.raises(FileNotFoundError, match="the folder '.*afile' is a file"):
        fileio.write_text(tmp_path / "afile" / "x.json", "{}")
    assert sorted(os.listdir(tmp_path)) == ["afile"]              # nothing made on the way


# ----------------------------------------------------------------------------------------------------------------
# what a mutation audit found uncaught

ALL_NUMPY_DTYPES = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32,
                    np.uint16, np.uint8, np.bool_]


def header_of(path):
    """The JSON header of a safetensors file, read by hand from the spec's layout (8-byte little-endian length)."""
    raw = path.read_bytes()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])


def test_every_dtype_code_agrees_with_safetensors(tmp_path):
    """For every NumPy dtype the format has, the dtype code and the bytes agree with the `safetensors` package both
    ways: a file it writes loads with the same dtype, bits and code (load_dtypes), and a file we write carries the
    code it writes and loads back through it unchanged. Signed and unsigned ints of one width differ only in their
    code, so a swapped code (I8 read as U8, I16 as U16) shows here and nowhere else."""
    st_np = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(7)
    t = {np.dtype(d).name: sample(d, (5,), rng) for d in ALL_NUMPY_DTYPES}
    st_np.save_file(t, str(tmp_path / "ref.safetensors"))
    codes = {k: v["dtype"] for k, v in header_of(tmp_path / "ref.safetensors").items() if k != "__metadata__"}
    assert len(set(codes.values())) == len(ALL_NUMPY_DTYPES)
    got = sio.load_file(tmp_path / "ref.safetensors")
    assert all(same(got[k], a) for k, a in t.items()) and sio.load_dtypes(tmp_path / "ref.safetensors") == codes
    sio.save_file(t, tmp_path / "ours.safetensors")
    assert {k: v["dtype"] for k, v in header_of(tmp_path / "ours.safetensors").items()} == codes
    back = st_np.load_file(str(tmp_path / "ours.safetensors"))
    assert all(same(back[k], a) for k, a in t.items())


def test_load_dtypes_reports_the_stored_code_not_the_loaded_one(tmp_path):
    """load_dtypes tells the precision a tensor was written in: BF16 stays "BF16" there although load_file widens it
    to float32. The expected codes are those safetensors.torch itself wrote into the header."""
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    t = {"b": torch.ones(2).bfloat16(), "h": torch.ones(2).half(), "f": torch.ones(2)}
    st_torch.save_file(t, str(tmp_path / "m.safetensors"))
    codes = {k: v["dtype"] for k, v in header_of(tmp_path / "m.safetensors").items() if k != "__metadata__"}
    assert codes == {"b": "BF16", "h": "F16", "f": "F32"}
    assert sio.load_dtypes(tmp_path / "m.safetensors") == codes
    assert sio.load_file(tmp_path / "m.safetensors")["b"].dtype == np.float32


def test_header_length_one_byte_past_the_end(tmp_path, good):
    """A file cut inside its header is named as such ("header length ... runs past the end"), found from the length
    field before any JSON is parsed, rather than reported as bad JSON."""
    raw = good.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    path = tmp_path / "cut.safetensors"
    path.write_bytes(raw[:8 + n - 1])
    with pytest.raises(ValueError, match=rf"header length {n} runs past the end of the file \({7 + n} bytes"):
        sio.load_file(path)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, "float16", object])
def test_load_file_refuses_a_target_dtype_other_than_float32_or_float64(tmp_path, good, dtype):
    """load_file's `dtype` converts float tensors to float32 or float64 only (what refbert computes in); float16 or
    anything else is a ValueError naming the argument, what it accepts and what came."""
    with pytest.raises(ValueError, match=r"load_file: argument 'dtype' expected None, np.float32 or np.float64, got"):
        sio.load_file(good, dtype=dtype)


def test_save_rejects_metadata_with_non_str_keys(tmp_path):
    """The spec's __metadata__ is str -> str. A non-str key would be turned into a string by json.dumps and come back
    as another key, so it is refused up front, and nothing is written."""
    with pytest.raises(ValueError, match=r"argument 'metadata' expected None or a dict of str -> str, got \{1: 'x'\}"):
        sio.save_file({"x": np.zeros(1)}, tmp_path / "t.safetensors", metadata={1: "x"})
    assert os.listdir(tmp_path) == []


def test_save_never_overwrites_an_existing_temporary_file(tmp_path, monkeypatch):
    """The temporary file is created exclusively: if its name already exists (another writer's file, here forced by
    fixing the random part of the name), save_file fails with FileExistsError and neither touches that file nor
    deletes it. The name is learnt from a first save whose rename is made to fail."""
    monkeypatch.setattr(sio.secrets, "token_hex", lambda n: "0" * (2 * n))
    names = []

    def record(src, dst):
        names.append(src)
        raise OSError("rename failed (simulated)")
    with monkeypatch.context() as m:
        m.setattr(os, "replace", record)
        with pytest.raises(OSError, match="simulated"):
            sio.save_file({"w": np.ones(2)}, tmp_path / "t.safetensors")
    (tmp := tmp_path / os.path.basename(names[0])).write_bytes(b"another writer's bytes")
    with pytest.raises(FileExistsError):
        sio.save_file({"w": np.ones(2)}, tmp_path / "t.safetensors")
    assert tmp.read_bytes() == b"another writer's bytes" and sorted(os.listdir(tmp_path)) == [tmp.name]
