"""The package's layout: the library never imports its command line, and refbert's modules import one another
without a cycle (every import statement counts, those inside functions too)."""
import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "refbert"


def imports_of(path):
    """The refbert modules a module imports, by any import statement in it."""
    mods = {p.stem for p in PKG.glob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or node.module == "refbert" or (node.module or "").startswith("refbert."):
                base = node.module if node.level == 0 else f"refbert.{node.module}" if node.module else "refbert"
                if base == "refbert":                                 # from . import x, y
                    out.update(f"refbert.{a.name}" for a in node.names if a.name in mods)
                else:
                    out.add(base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("refbert."))
    return out - {f"refbert.{path.stem}"}


def graph():
    return {f"refbert.{p.stem}": imports_of(p) for p in PKG.glob("*.py") if p.stem != "__init__"}


def test_import_graph_has_no_cycle():
    g = graph()
    assert g["refbert.train"] and "refbert.errors" in g["refbert.train"]     # the walk sees imports at all
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            assert state.get(n) != "open", "import cycle: " + " -> ".join(path + [n])
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"
    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_the_library_does_not_import_the_command_line():
    g = graph()
    library = [m for m in g if m not in ("refbert.cli", "refbert.__main__")]
    assert not [m for m in library if "refbert.cli" in g[m]]
    code = ("import sys, refbert.train, refbert.inference, refbert.checkpoint, refbert.data;"
            "print(sorted(m for m in sys.modules if m == 'refbert.cli'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr
