"""Atomic writes: nothing already saved is lost, and no reader ever sees half a file or half a folder.

A file is written to a temporary name beside its target, flushed to disk, then renamed over it (os.replace is
atomic on POSIX); a new folder is built beside its final place and renamed into it; the files of a save into an
existing folder are all written first, into a temporary folder inside it, and only then renamed over the old ones.
On any failure the temporary file or folder is removed and the old contents stay as they were.
"""
import contextlib
import os
import shutil
import tempfile


def parent_folder(path):
    """The folder the file `path` goes into, which must exist. Checked before the temporary file is made: without
    it, a missing folder is reported as the temporary file's name ('No such file or directory: out/.x.json.k2j.tmp'),
    a file the user never asked for."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        shown = os.path.dirname(path) or directory
        raise FileNotFoundError(f"cannot write '{path}': the folder '{shown}' "
                                f"{'is a file' if os.path.exists(directory) else 'does not exist'}")
    return directory


def write_text(path, text):
    """Replace the file `path` with `text` (UTF-8) atomically. The umask decides the permissions, as for open()."""
    path = os.fspath(path)
    directory, name = parent_folder(path), os.path.basename(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)                    # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def folder(path):
    """`with folder(path) as target:` write the files into `target`. A new folder is built beside `path` and
    renamed into place at the end, so it appears whole or not at all. Into an existing folder the files (plain
    files, not folders) are written first into a temporary folder inside it; once the block has written every one
    they are renamed over their namesakes in name order (config.json before model.safetensors), files the block
    did not write staying as they were. A failure while writing (a full disk, Ctrl-C) so leaves every old file as
    it was: a checkpoint's config and weights are never mixed by a failed save; only a crash between the renames,
    microseconds apart, could mix them."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save_pretrained: argument 'path' expected a folder, got '{path}', which is a file")
    if os.path.isdir(path):
        stage = tempfile.mkdtemp(prefix=".tmp-", dir=path)
        try:
            yield stage
            for name in sorted(os.listdir(stage)):
                os.replace(os.path.join(stage, name), os.path.join(path, name))
            os.rmdir(stage)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        return
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    target = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        yield target
        os.chmod(target, 0o777 & ~_umask())
        os.rename(target, path)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def utf8_named(path):
    """Reading `path` as UTF-8 text inside: a byte that is not UTF-8 becomes a ValueError that names the file (a
    UnicodeDecodeError names only the codec and the byte, and `refbert` would print just that)."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise ValueError(f"{os.fspath(path)}: expected UTF-8 text, got a byte that is not UTF-8 at offset {e.start} "
                         f"({e.reason}; a binary file?)") from None
