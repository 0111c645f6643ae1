"""Numba's on-disk cache for refbert_kernels, invalidated when a file a kernel imports from changes too.

`@njit(cache=True)` stores a kernel's machine code beside its source file, stamped with that file's contents alone
(Numba 0.68: a sha256 of the source). A kernel compiles the njit helpers it calls from other modules into itself
(layernorm.py's kernels inline _math.py's philox_word; softmax.py's, _math.py's exp), so when only the helper's
file changes, Numba loads the old machine code: the kernel computes with the old helper, silently, and every check
and test of it checks code that is no longer in the repository. It happens in a checkout after a `git pull` that
touches _math.py alone, and after a `pip install --upgrade` that leaves the old __pycache__ behind (pip removes the
files it installed, not Numba's), whenever the kernel's own file did not change. Demonstrated in
tests/test_kernels_cache.py with Numba's own locators (the stale value comes back) and fixed there with these.

The fix: the stamp of a file under one of ROOTS (refbert_kernels' folder, or a test's) is Numba's own stamp and a
sha256 over the contents of every module of the same folder the file imports, directly or through each other
(`from ._math import ...`, `from . import _pool`, `import helper` where helper.py sits beside it). A kernel's cache
is reused exactly when none of the code it can inline has changed; editing one kernel file recompiles that file's
kernels only, editing _math.py every file that imports it. Done by locator classes put in front of Numba's
(numba.core.caching.CacheImpl._locator_classes): each takes only files under ROOTS and otherwise is the Numba
locator it extends (in-tree __pycache__, NUMBA_CACHE_DIR, the user-wide cache), so other code's caching is untouched.
"""
import ast
import functools
import hashlib
import os

ROOTS = [os.path.dirname(os.path.abspath(__file__))]


@functools.lru_cache(maxsize=None)
def _imports(path, mtime_ns, size):
    """The sibling modules (paths) that the Python file at `path` imports: relative imports of the package's
    modules and absolute imports of a module whose file sits in the same folder. (mtime and size: the memo key.)"""
    folder = os.path.dirname(path)
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), path)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:                          # from ._math import exp
                names.append(node.module.split(".")[0])
            elif node.level == 1:                                        # from . import _pool
                names += [a.name for a in node.names]
            elif node.level == 0 and node.module:                        # from helper import f
                names.append(node.module.split(".")[0])
        elif isinstance(node, ast.Import):                               # import helper
            names += [a.name.split(".")[0] for a in node.names]
    found = (os.path.join(folder, n + ".py") for n in names)
    return tuple(sorted({p for p in found if os.path.isfile(p) and p != path}))


def dependencies(path):
    """`path` and every sibling module it imports, directly or through each other: sorted absolute paths."""
    path = os.path.abspath(path)
    seen, todo = set(), [path]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        st = os.stat(p)
        todo += _imports(p, st.st_mtime_ns, st.st_size)
    return tuple(sorted(seen))


def stamp(path):
    """sha256 over the names and contents of dependencies(path): what a kernel of this file can have inlined."""
    return _stamp(tuple((p, st.st_mtime_ns, st.st_size) for p in dependencies(path) for st in (os.stat(p),)))


@functools.lru_cache(maxsize=None)
def _stamp(files):
    """stamp() of these (path, mtime, size): read once a process while none of them changes (hundreds of kernels
    ask, a few files each)."""
    h = hashlib.sha256()
    for p, _, _ in files:
        h.update(os.path.basename(p).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


def _ours(py_file):
    py_file = os.path.abspath(py_file)
    return any(os.path.commonpath([py_file, r]) == r for r in ROOTS)


def _locator(base):
    class Locator(base):
        """Numba's locator `base`, for files under ROOTS only, stamped with their imports' contents too."""

        @classmethod
        def from_function(cls, py_func, py_file):
            if not _ours(py_file):
                return None
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return super().get_source_stamp(), stamp(self._py_file)

    Locator.__name__ = Locator.__qualname__ = "Refbert" + base.__name__
    return Locator


def install(*roots):
    """Put the locators in front of Numba's (once a process) and add `roots` (folders) to ROOTS. Without Numba,
    or with a Numba whose caching module differs from the one this was written against, nothing is done and
    False is returned (Numba's own caching then runs, as before)."""
    for r in roots:
        r = os.path.abspath(r)
        if r not in ROOTS:
            ROOTS.append(r)
    try:
        from numba.core import caching
        impl = caching.CacheImpl
        bases = [getattr(caching, n) for n in ("UserProvidedCacheLocator", "InTreeCacheLocator",
                                                "UserWideCacheLocator")]
    except (ImportError, AttributeError):
        return False
    if not any(getattr(k, "_refbert", False) for k in impl._locator_classes):
        ours = [_locator(b) for b in bases]
        for k in ours:
            k._refbert = True
        impl._locator_classes = ours + list(impl._locator_classes)
    return True


def lock_saves():
    """Numba's on-disk cache saves one function's entries as read index, pick a free data file, write index, write
    data, which two processes saving signatures of one function at once (refbert check's workers, the test suite's
    workers, two commands run side by side, a helper both call in float32 and float64) could interleave into an index
    that loses an entry or points a signature at the other's data (tests/test_kernels_cache.py: 4 processes saving
    at once). Each save here holds an exclusive lock (fcntl) on a file beside that function's index, so saves of one
    function come one at a time; refbert_kernels installs it on import, in every process. True once installed;
    False where it cannot be (no fcntl, a Numba without IndexDataCacheFile.save): refbert check then compiles in one
    process."""
    try:
        import fcntl

        from numba.core import caching
        save = caching.IndexDataCacheFile.save
    except (ImportError, AttributeError):
        return False
    if getattr(save, "refbert_locked", False):
        return True

    def locked_save(self, key, data):
        with open(self._index_path + ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)                 # released when f closes
            return save(self, key, data)

    locked_save.refbert_locked = True
    caching.IndexDataCacheFile.save = locked_save
    return True
