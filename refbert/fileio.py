"""Atomic writes: nothing already saved is lost, and no reader ever sees half a file or half a folder.

A file is written to a temporary name beside its target, flushed to disk, then renamed over it (os.replace is
atomic on POSIX); a new folder is built beside its final place and renamed into it. On any failure the temporary
file or folder is removed and the old contents stay as they were.
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
    renamed into place at the end, so it appears whole or not at all; an existing folder is written in place (each
    file by its own atomic replace)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save_pretrained: argument 'path' expected a folder, got '{path}', which is a file")
    if os.path.isdir(path):
        yield path
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
