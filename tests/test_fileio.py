"""refbert.fileio's atomic writes, by failure injection: a write that dies keeps the previous file and leaves no
temporary file behind, the bytes are fsynced before the rename, permissions follow the umask as open() and
os.mkdir's do, a new folder appears whole or not at all, and a save into an existing folder replaces nothing until
every file is written."""
import os
import stat

import numpy as np
import pytest

import refbert
from refbert import fileio
from refbert.config import BertConfig

CFG = dict(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
           max_position_embeddings=16)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def _fail_fsync(monkeypatch):
    def boom(fd):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(os, "fsync", boom)


def _fail_half_written(monkeypatch):
    """os.fdopen hands out a file whose write puts down half the text, then fails as a full disk does."""
    real_fdopen = os.fdopen

    class HalfWriter:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError("disk full (simulated)")

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: HalfWriter(real_fdopen(*a, **k)))


def _interrupt_replace(monkeypatch):
    def interrupted(src, dst):
        raise KeyboardInterrupt                    # a BaseException, not an Exception: cleanup must still run
    monkeypatch.setattr(os, "replace", interrupted)


@pytest.mark.parametrize("fail", [_fail_fsync, _fail_half_written, _interrupt_replace])
def test_failed_write_text_keeps_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch, fail):
    """A write_text that dies (before fsync, halfway through the text, or by Ctrl-C at the rename) leaves the
    previous bytes in place, lets the error through, and leaves no hidden temporary file in the folder."""
    path = tmp_path / "config.json"
    fileio.write_text(path, "previous\n")
    fail(monkeypatch)
    with pytest.raises((OSError, KeyboardInterrupt)):
        fileio.write_text(path, "new text that never lands\n" * 100)
    monkeypatch.undo()
    assert path.read_bytes() == b"previous\n"
    assert os.listdir(tmp_path) == ["config.json"]


def test_failed_first_write_text_leaves_nothing(tmp_path, monkeypatch):
    """With no previous file, a failed write leaves the folder empty: no target, no temporary file."""
    _interrupt_replace(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        fileio.write_text(tmp_path / "x.txt", "text")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_write_text_fsyncs_the_whole_temporary_file_before_renaming_it(tmp_path, monkeypatch):
    """The fsync must reach the file that is then renamed onto the target, with all its bytes, before the rename:
    spies record, at each call, the inode and size (fsync) and the source inode (replace). A rename keeps the
    inode, so the final file's inode names the file that was fsynced."""
    path, text = tmp_path / "out.txt", "héllo\n" * 50
    calls, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        calls.append(("fsync", st.st_ino, st.st_size))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", os.stat(src).st_ino, os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fileio.write_text(path, text)
    monkeypatch.undo()
    ino = os.stat(path).st_ino
    assert calls == [("fsync", ino, len(text.encode("utf-8"))), ("replace", ino, str(path))]
    assert path.read_text(encoding="utf-8") == text


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_write_text_and_folder_modes_follow_the_umask_like_open_and_mkdir(tmp_path, umask):
    """mkstemp and mkdtemp make 0600 / 0700; the file and folder written must get what open() and os.mkdir give
    under the same umask (0644 / 0755 under 022), or a saved checkpoint is unreadable to other users."""
    old = os.umask(umask)
    try:
        fileio.write_text(tmp_path / "ours.txt", "x")
        with open(tmp_path / "theirs.txt", "w"):
            pass
        with fileio.folder(tmp_path / "ours") as target:
            fileio.write_text(os.path.join(target, "f"), "x")
        os.mkdir(tmp_path / "theirs")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "ours.txt") == _mode(tmp_path / "theirs.txt") == 0o666 & ~umask
    assert _mode(tmp_path / "ours") == _mode(tmp_path / "theirs") == 0o777 & ~umask


def test_new_folder_is_built_beside_its_place_and_appears_whole(tmp_path):
    """Inside the block the files go to another folder beside `path`, and `path` does not exist yet; on leaving
    the block that folder is renamed onto `path`, contents and all, and nothing else is left beside it."""
    path = tmp_path / "ckpt"
    with fileio.folder(path) as target:
        assert os.path.abspath(target) != os.path.abspath(path)
        assert os.path.dirname(os.path.abspath(target)) == str(tmp_path)
        assert not path.exists()
        fileio.write_text(os.path.join(target, "config.json"), "{}")
        assert not path.exists()
    assert os.listdir(tmp_path) == ["ckpt"]
    assert os.listdir(path) == ["config.json"] and (path / "config.json").read_text() == "{}"


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_inside_a_new_folder_leaves_nothing(tmp_path, error):
    """An exception (or Ctrl-C) inside `with folder(new)` propagates and leaves neither `new` nor its temporary
    folder, even after files were written into it."""
    with pytest.raises(error):
        with fileio.folder(tmp_path / "new") as target:
            fileio.write_text(os.path.join(target, "config.json"), "{}")
            raise error("failed halfway (simulated)")
    assert os.listdir(tmp_path) == []


def test_folder_onto_a_plain_file_is_refused_by_name(tmp_path):
    """A path that is a plain file is a ValueError saying a folder was expected and the path is a file, for
    folder() and for save_pretrained; the file is left as it was and nothing is made beside it."""
    path = tmp_path / "ckpt"
    path.write_bytes(b"not a folder")
    msg = rf"argument 'path' expected a folder, got '{path}', which is a file"
    with pytest.raises(ValueError, match=msg):
        with fileio.folder(path):
            pass
    with pytest.raises(ValueError, match=msg):
        refbert.BertModel(BertConfig(**CFG), seed=0).save_pretrained(path)
    assert path.read_bytes() == b"not a folder" and os.listdir(tmp_path) == ["ckpt"]


def test_existing_folder_is_staged_then_replaced_file_by_file(tmp_path):
    """folder() on an existing folder (the docstring: every file written first, inside it, then renamed over its
    namesake): inside the block the target is a hidden folder in `path` and nothing in `path` has changed yet; a
    failure inside the block after one file was written keeps every old file (config and weights never mixed) and
    leaves no temporary; a block that finishes replaces what it wrote and keeps the files it did not write."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "vocab.txt").write_text("kept")
    (path / "config.json").write_text("old config")
    (path / "model.safetensors").write_text("old weights")
    old = {p.name: p.read_text() for p in path.iterdir()}
    with pytest.raises(RuntimeError):
        with fileio.folder(path) as target:
            assert os.path.dirname(os.path.abspath(target)) == str(path) and os.path.basename(target)[0] == "."
            fileio.write_text(os.path.join(target, "model.safetensors"), "new weights")
            assert {p.name: p.read_text() for p in path.iterdir() if p.is_file()} == old
            raise RuntimeError("failed before config.json (simulated)")
    assert os.listdir(tmp_path) == ["ckpt"]
    assert {p.name: p.read_text() for p in path.iterdir()} == old
    with fileio.folder(path) as target:
        fileio.write_text(os.path.join(target, "model.safetensors"), "new weights")
        fileio.write_text(os.path.join(target, "config.json"), "new config")
    assert {p.name: p.read_text() for p in path.iterdir()} == {
        "vocab.txt": "kept", "config.json": "new config", "model.safetensors": "new weights"}


def test_failed_save_pretrained_between_its_two_files_keeps_the_old_pair(tmp_path, monkeypatch):
    """save_pretrained over a checkpoint, failing after the weights were written and before config.json (its
    to_json_file raising): the old config.json and model.safetensors both stay, byte for byte, and load as the model
    first saved; no temporary is left."""
    path = tmp_path / "ckpt"
    first = refbert.BertModel(BertConfig(**CFG), seed=0)
    first.save_pretrained(path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def fail(self, where):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(BertConfig, "to_json_file", fail)
    with pytest.raises(OSError, match="simulated"):
        refbert.BertModel(BertConfig(**CFG), seed=1).save_pretrained(path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    loaded = refbert.BertModel.from_pretrained(path)
    assert all(np.array_equal(loaded.params[k], p) for k, p in first.params.items())   # float32 file: exact


def test_failed_save_pretrained_onto_a_checkpoint_keeps_it(tmp_path, monkeypatch):
    """Saving over an existing checkpoint with the disk failing (fsync raises) keeps the old checkpoint's bytes
    and the files beside it (a tokenizer's vocab.txt), and it still loads as the model first saved; a save that
    succeeds then replaces both files and keeps vocab.txt."""
    path = tmp_path / "ckpt"
    first = refbert.BertModel(BertConfig(**CFG), seed=0)
    first.save_pretrained(path)
    (path / "vocab.txt").write_text("[PAD]\n")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    second = refbert.BertModel(BertConfig(**CFG, hidden_dropout_prob=0.0), seed=1)
    _fail_fsync(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        second.save_pretrained(path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    loaded = refbert.BertModel.from_pretrained(path)
    assert all(np.array_equal(loaded.params[k], p) for k, p in first.params.items())   # float32 file: exact
    second.save_pretrained(path)
    loaded = refbert.BertModel.from_pretrained(path)
    assert all(np.array_equal(loaded.params[k], p) for k, p in second.params.items())
    assert loaded.config.hidden_dropout_prob == 0.0
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "vocab.txt"]
