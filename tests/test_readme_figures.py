"""The README quotes no measurement that its committed results files do not hold (tests/readme_figures.py).

Each README passage that quotes measurements sits in a `<!-- figures: FILE ... -->` block naming the results
files it comes from; every figure (a number with a unit) in it must be in one of them, with the same unit, at the
precision quoted. `python tests/readme_figures.py` lists every figure and where it was found."""
import os
import subprocess

import readme_figures as R


def test_every_readme_figure_is_in_the_results_file_it_cites():
    problems = [f"README.md:{n}: {value} {unit}: {why}" for n, value, unit, why, _ in R.check() if why]
    assert not problems, "\n".join(problems)


def test_cited_results_files_are_committed_results():
    """The blocks cite files under benchmarks/results/ (what a benchmark command wrote), not arbitrary text, and
    every one is tracked by git (a file only on the author's disk is no committed measurement)."""
    text = open(os.path.join(R.ROOT, "README.md"), encoding="utf-8").read()
    cited = [p for b in R.BLOCK.finditer(text) for p in b.group("files").split()]
    cited += [b.group("file") for b in R.OUTPUT.finditer(text)]
    assert cited, "the README cites no results file"
    assert all(p.startswith("benchmarks/results/") for p in cited), cited
    if os.path.isdir(os.path.join(R.ROOT, ".git")):        # a checkout (CI clones one); an sdist has no history
        tracked = subprocess.run(["git", "ls-files", "--", *sorted(set(cited))], cwd=R.ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
        assert sorted(set(cited)) == sorted(tracked), sorted(set(cited) - set(tracked))


def _readme(tmp_path, body, results):
    (tmp_path / "r.md").write_text(results, encoding="utf-8")
    path = tmp_path / "README.md"
    path.write_text(body.replace("FILE", str(tmp_path / "r.md")), encoding="utf-8")
    return str(path)


def test_checker_finds_a_stale_figure(tmp_path):
    results = "| impl | fwd+bwd ms | GB/s | speed-up vs torch |\n|---|---|---|---|\n| v5 | 57.362 | 1.32 | 1.44× |\n" \
              "Copy bandwidth: **27.30 GB/s**.\n"
    good = "<!-- figures: FILE -->\nv5 runs 57.4 ms (1.44× torch) at 27.3 GB/s copy, ≥ 1.0× the target.\n" \
           "<!-- /figures -->\n"
    assert [r[3] for r in R.check(_readme(tmp_path, good, results))] == [None] * 3
    stale = good.replace("57.4 ms", "57.5 ms").replace("27.3 GB/s", "24.5 GB/s")
    rows = R.check(_readme(tmp_path, stale, results))
    assert sorted(r[1] for r in rows if r[3]) == ["24.5", "57.5"]


def test_checker_needs_the_same_unit_and_a_citation(tmp_path):
    results = "| impl | ms |\n|---|---|\n| v1 | 12.0 |\n"
    wrong_unit = "<!-- figures: FILE -->\nv1 reaches 12.0 GB/s.\n<!-- /figures -->\n"
    assert [r[3] is not None for r in R.check(_readme(tmp_path, wrong_unit, results))] == [True]
    uncited = "v1 runs 12.0 ms.\n"
    rows = R.check(_readme(tmp_path, uncited, results))
    assert len(rows) == 1 and "outside" in rows[0][3]


def test_figure_parsing():
    got = [(v, u) for _, v, u, _ in R.figures("softmax 4×12×512×512: 14.0–41.1 ms, 0.65-0.69x, 21,200 tokens/s, "
                                              "86% of copy; target ≥ 75%, B=8 T=512")]
    assert got == [("14.0", "ms"), ("41.1", "ms"), ("0.65", "×"), ("0.69", "×"), ("21,200", "tokens/s"), ("86", "%")]


def test_checker_holds_sample_output_to_its_file(tmp_path):
    (tmp_path / "out.txt").write_text("op   err\nlinear  1.2e-11  pass\nsoftmax  3.0e-11  pass\n", encoding="utf-8")
    body = "<!-- output: OUT -->\n```\nop   err\nlinear  1.2e-11  pass\n...\n```\n<!-- /output -->\n"
    path = tmp_path / "README.md"
    path.write_text(body.replace("OUT", str(tmp_path / "out.txt")), encoding="utf-8")
    assert R.check(str(path)) == []
    path.write_text(body.replace("OUT", str(tmp_path / "out.txt")).replace("1.2e-11", "1.3e-11"), encoding="utf-8")
    assert [r[3] for r in R.check(str(path))] == [f"line not in {tmp_path / 'out.txt'}"]


def test_escaped_pipes_and_bounds(tmp_path):
    """A cell holding an escaped pipe ("\\|w\\|") keeps the columns in place; a figure after a bound is no measurement."""
    results = "| model | \\|w - w0\\| / \\|w0\\| | pass (CPU s) |\n|---|---|---|\n| base | 0.07 | 3.53 |\n"
    body = "<!-- figures: FILE -->\nThe pass took 3.53 s, within 5 s of the target.\n<!-- /figures -->\n"
    assert [r[3] for r in R.check(_readme(tmp_path, body, results))] == [None]
