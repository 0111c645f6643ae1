"""Every CUDA C file's self-validating main (kernels/cuda/csrc/*.cu), run on CPU threads: g++ compiles each file
under csrc/cpusim.cuh (-DCPUSIM: each CUDA thread a fiber on one OS thread, __syncthreads and warp shuffles as
barriers, blocks one after another) at its small shapes (-DCPUSIM_SMALL: warp, float4 and tile tails, C = 1, T = 1,
every kind, dropout, padding, ignored labels), and the main validates every version against its CPU reference, exactly
as `nvcc -o x file.cu && ./x` does on a GPU. What the kernels compute, with their indexing, reductions, tails and
barriers, is proven here; speed, coalescing, spills (tests/test_cuda_nvcc.py) and races between blocks are not.
-DCPUSIM_HALF adds fp16 / bf16 storage and the tensor-core kernels (cpusim.cuh emulates mma.sync m16n8k16 from its
documented fragment layout and cp.async as a copy): the flash attention's version 2 forward and backward validate
here in both 16-bit types, against the reference of the same rounded inputs.
Needs g++ with C++20; about 2 minutes on 2 cores, most of it g++.
"""
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "kernels" / "cuda" / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))
# what each main prints when every version it validates passed (validate_result exits 1 at the first mismatch)
# (attention: versions 3 skip key tiles of padding and must give version 2's bits, having skipped some; the
# forward's versions 4 and 5 and the backward's version 4 reorganise version 3 and must give its bits (the
# forward's version 6 version 5's, with its own kernel at p = 0), the
# backward's version 5 version 4's, at T % 4 != 0 (a Philox call a score) and == 0 (a call per 4 scores), its
# version 6 (tiles in chunks) version 5's, its version 7 (one pass, dq by atomics) version 5's dk and dv, its
# version 8 (version 7's pass compiled per case) version 7's dk and dv, with dropout and without; a main exits 1 when
# any of these differs). A tuple: every line in it, each at least once.
DONE = {"attention_forward.cu": ("v4 = v5 = v3 bit for bit (f16, bf16): yes",
                                 "v6 = v5 bit for bit (f16, bf16; its kernel, no dropout): yes",
                                 "v6 = v5 bit for bit (f16, bf16; version 5's kernel): yes"),
        "attention_backward.cu": ("v4 = v3 bit for bit (bf16 dq, dk, dv): yes",
                                  "v5 = v4 bit for bit (bf16 dq, dk, dv, T % 4 != 0): yes",
                                  "v5 = v4 bit for bit (bf16 dq, dk, dv, T % 4 == 0): yes",
                                  "v6 = v5 bit for bit (f16 dq, dk, dv): yes",
                                  "v6 = v5 bit for bit (bf16 dq, dk, dv): yes",
                                  "v7 = v5 bit for bit (f16 dk, dv): yes",
                                  "v7 = v5 bit for bit (bf16 dk, dv): yes",
                                  *(f"v8 = v7 bit for bit ({t} dk, dv; {how}): yes" for t in ("f16", "bf16")
                                    for how in ("its kernel, dropout", "its kernel, no dropout"))),
        "attention_f32.cu": ("v6 = v4 bit for bit (dq, dk, dv): yes", "v6 dk, dv = v3 dk, dv bit for bit: yes",
                             "v8 = v6 bit for bit (dq, dk, dv; all key tiles, groups of 1 and 2): yes",
                             "attention_f32: every version ok"),
        "softmax.cu": "dx ok",
        "layernorm.cu": tuple(f"dw, db partials v{v} = v3 bit for bit (rk {rk}): yes" for v in (4, 5)
                              for rk in (-1, 0, 1)) + ("layernorm: every version ok",)}


# mains run again at other sizes (each entry one run's arguments): the attention mains at a T that is a multiple of
# 4 (their default 70 is not, so the forward's versions 4 and 5 and the backward's version 5 would never draw a
# Philox call per 4 keys); the backward's at T = 104, where the first sequence has real keys in its second key tile
# (64 .. 66), so that the words of a tile other than the first are compared too (at 72 every key past 64 is
# padding, skipped), with dropout and without (p = 0: the backward's version 8 and the forward's version 6 have
# kernels of their own without dropout; the other versions' no-dropout path)
AGAIN = {"attention_forward.cu": [["72"], ["72", "0"]], "attention_backward.cu": [["104"], ["104", "0"]],
         "attention_f32.cu": [["72", "0"]]}


def _gpp(src, exe, include=CSRC):
    """g++'s build of a CUDA C file for CPU threads (csrc/cpusim.cuh) at the mains' small shapes, 16-bit types in."""
    return subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-ffp-contract=off", "-DCPUSIM", "-DCPUSIM_SMALL",
                           "-DCPUSIM_HALF", f"-I{include}", "-x", "c++", str(src), "-o", str(exe)], capture_output=True,
                          text=True)


def _mutant(tmp_path, where, old, new, main, count=1):
    """csrc copied into tmp_path with `old` (a str, or a compiled regex) replaced by `new` in file `where` (found
    exactly `count` times there), and `main` built from that copy: the executable. Skips without g++."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ (C++20) to run the CUDA C on CPU threads")
    for f in CSRC.glob("*"):
        (tmp_path / f.name).write_text(f.read_text())
    path = tmp_path / where
    text = path.read_text()
    found = len(old.findall(text)) if isinstance(old, re.Pattern) else text.count(old)
    assert found == count, (where, old, found)
    path.write_text(old.sub(new, text) if isinstance(old, re.Pattern) else text.replace(old, new))
    exe = tmp_path / "x"
    build = _gpp(tmp_path / main, exe, tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    return exe


def _build_and_run(src, tmp):
    exe = Path(tmp) / src.stem
    build = _gpp(src, exe)
    if build.returncode:
        return src.name, build.returncode, "build failed:\n" + build.stderr[-3000:]
    out = ""
    for argv in [[]] + AGAIN.get(src.name, []):
        run = subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=300)
        out += run.stdout + run.stderr
        if run.returncode:
            return src.name, run.returncode, out
    return src.name, 0, out


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20) to run the CUDA C on CPU threads")
def test_every_cuda_c_main_validates_on_cpu_threads():
    assert len(SOURCES) >= 9
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda s: _build_and_run(s, tmp), SOURCES))
    for name, rc, out in results:
        assert rc == 0, f"{name} (rc {rc}):\n{out[-4000:]}"
        assert "mismatch" not in out, f"{name}:\n{out[-4000:]}"
        done = DONE.get(name, "every version ok")
        if isinstance(done, tuple):
            assert all(line in out for line in done), f"{name}:\n{out[-4000:]}"
        else:
            assert out.count(done) >= 1 + len(AGAIN.get(name, [])), f"{name}:\n{out[-4000:]}"
        if name.startswith("attention_") and name != "attention_f32.cu":
            skipped = re.search(r"v3(?:, v4|-v[5-8])?(?:, v5)?(?:, v6)? skipped (\d+)", out)
            assert skipped and int(skipped.group(1)) > 0, f"{name}:\n{out[-4000:]}"


def test_cpusim_catches_a_wrong_kernel(tmp_path):
    """The harness can fail: a kernel that skips the last warp's rows (a tail bug) fails its main's validation."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ (C++20) to run the CUDA C on CPU threads")
    src = (CSRC / "dropout.cu").read_text().replace("if (e >= n) return;", "if (e + 4 > n) return;")
    bad = tmp_path / "dropout_bad.cu"
    bad.write_text(src)
    name, rc, out = _build_and_run(bad, tmp_path)
    assert rc != 0 and "mismatch" in out, out


@pytest.mark.parametrize("where, old, new", [
    # the emulated mma reads a B fragment's second register from the wrong rows: the forward's (already proven on
    # a GPU) validation must fail, or the emulation proves nothing
    ("cpusim.cuh", "fb[4 + (k >= 8 ? 1 : 0)]", "fb[4 + (k >= 8 ? 0 : 1)]"),
    # the tensor-core backward's B fragment (Y's rows as B's columns) loads its second register from the wrong
    # columns: dq and dk go wrong
    ("flash_tc.cuh", "b[1] = *reinterpret_cast<const u32*>(p + 8);\n}",
     "b[1] = *reinterpret_cast<const u32*>(p);\n}"),
    # the emulated ldmatrix.trans hands out a column's two rows swapped: the forward's versions 4 and 5 (V's
    # fragments by ldmatrix.trans) must fail, or the emulation proves nothing about them
    ("cpusim.cuh", "lo = m.row[ph][8 * i + 2 * t][g];", "lo = m.row[ph][8 * i + 2 * t + 1][g];"),
    # the backward's version 5 hands a lane the word of its fourth score from the wrong Philox block (the 4 x 4
    # transpose of the dk, dv pass): that score's keep-mask goes wrong, and dk, dv with it
    ("flash_tc.cuh", "w[e] = pick(got, e ^ a);", "w[e] = pick(got, (e ^ a) ^ (e == 3));"),
])
def test_cpusim_catches_a_wrong_tensor_core_fragment(tmp_path, where, old, new):
    """The tensor-core validation can fail: a fragment read from the wrong place (in the emulation, or in the
    kernel) fails the main's validation."""
    exe = _mutant(tmp_path, where, old, new,
                  "attention_forward.cu" if where == "cpusim.cuh" else "attention_backward.cu")
    run = subprocess.run([str(exe), "20"], capture_output=True, text=True, timeout=300)   # T = 20: one tile, a tail
    assert run.returncode != 0 and "mismatch" in run.stdout, run.stdout[-3000:]


def test_cpusim_catches_the_c6_forward_refilling_a_buffer_too_early(tmp_path):
    """attention_f32.cu v5 (C6's forward) double-buffers K and V: the loads of tile it + 1 go into the buffers tile
    it - 1 used (its scores p were written over K, then read with V), after the barrier that ends every thread's
    reading of them. Without that barrier the first thread to finish a tile refills the buffers while the others
    still read them (here the threads run one after another between barriers, thread 0 first, so thread 0 refills
    them before thread 1 reads, every run; a copy by cp.async lands at once): the main's v5 = v3 bit-for-bit
    comparison must say NO and exit 1 (at its 3-key-tile shape), or it proves nothing about the double buffer's
    barriers."""
    barrier = re.compile(r"\n +__syncthreads\(\); +// \.\.\. for every thread; tile it - 1 is done\n")
    exe = _mutant(tmp_path, "attention_f32.cu", barrier, "\n", "attention_f32.cu")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "v5 forward = v3 forward bit for bit (out, m, 1/l): NO" in run.stdout, \
        run.stdout[-3000:]


def test_cpusim_catches_the_c6_backward_v6_missing_cells(tmp_path):
    """attention_f32.cu's backward version 6 lays the transposing pass's cells out a warp down a column
    (a3_xt_cell): every (query row, 4-key group) of the tile must be some thread's, once. With the odd rows left
    out (r = g & 62: their p z and ds never computed, their transposed cells never written), the main's comparison
    of version 6 with version 4 must say NO and exit 1, or it proves nothing about the layout."""
    exe = _mutant(tmp_path, "attention_f32.cu", "{ r = g & 63; c4 = (g >> 6) * 4; }",
                  "{ r = g & 62; c4 = (g >> 6) * 4; }", "attention_f32.cu")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "v6 = v4 bit for bit (dq, dk, dv): NO" in run.stdout, run.stdout[-3000:]
    assert "v5 forward = v3 forward bit for bit (out, m, 1/l): yes" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("tile", ["query", "key"])
def test_cpusim_catches_a_flash_backward_chunk_taken_out_of_order(tmp_path, tile):
    """attention_backward.cu's version 6 works each 64-wide tile in four chunks (flash_tc.cuh SPLIT), each chunk's
    k-steps of dV and dK (the query tiles of the dk, dv pass) or of dq (the key tiles of the dq pass) added to the
    accumulators in the whole tile's order, to keep version 5's bits. With the chunks of one pass taken last to
    first (versions 2-5, one chunk each, untouched), the main's comparison of version 6 with version 5 must say NO
    and exit 1, or it proves nothing about that pass's order."""
    exe = _mutant(tmp_path, "flash_tc.cuh",
                  f"        for (int nb = 0; nb < 8; nb += NN) {{                  // (SPLIT 1: the whole {tile} tile",
                  f"        for (int nb = 8 - NN; nb >= 0; nb -= NN) {{ // (mutant: last chunk first; the {tile} tile",
                  "attention_backward.cu")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "v6 = v5 bit for bit (f16 dq, dk, dv): NO" in run.stdout, run.stdout[-3000:]
    assert "v5 = v4 bit for bit (f16 dq, dk, dv, T % 4 != 0): yes" in run.stdout, run.stdout[-3000:]


# (version, mutant) -> (old, new): versions 7 and 8 write dS^T into shared memory transposed for dq's share
_DS = "DS[{}] = from_f<T>({}[n][e])"           # (the store; its index transposed, and not)
_DS_T, _DS_N = "(n * 8 + t4 * 2 + (e & 1)) * TC_LD + warp * 16 + g + 8 * (e >> 1)", \
    "(warp * 16 + g + 8 * (e >> 1)) * TC_LD + n * 8 + t4 * 2 + (e & 1)"
ONE_PASS_MUTANTS = {
    (7, "untransposed"): (_DS.format(_DS_T, "ds"), _DS.format(_DS_N, "ds")),
    (7, "half the columns"): ("for (int nb = 0; nb < 8; nb += 4) {        // two halves",
                              "for (int nb = 0; nb < 4; nb += 4) {        // (mutant: one half)"),
    (8, "untransposed"): (_DS.format(_DS_T, "dp"), _DS.format(_DS_N, "dp")),
    (8, "half the columns"): ("for (int nb = 0; nb < 8; nb += 4) {               // two halves",
                              "for (int nb = 0; nb < 4; nb += 4) {               // (mutant: one half)"),
    # version 8's scores on tiles whole inside T (no bounds tests) without the mask: the main's T = 104 has such a
    # tile with padding keys (the second sequence's), so its dk, dv (or dq) must differ from version 7's
    (8, "whole tiles unmasked"): ("const float x = s[n][e] * scale + mk[e >> 1];",
                                  "const float x = s[n][e] * scale + (CHECK ? mk[e >> 1] : 0.f);"),
}


@pytest.mark.parametrize("version, mutant", sorted(ONE_PASS_MUTANTS))
def test_cpusim_catches_a_wrong_one_pass_dq(tmp_path, version, mutant):
    """attention_backward.cu's versions 7 and 8 add each key tile's share of dq, dS K, from dS^T fragments they
    write into shared memory transposed. With dS written untransposed, or the product's second half of the head's
    columns never added, the main's validation of that version's dq against the CPU reference must fail (exit 1,
    naming it), or it proves nothing about the one-pass dq (their dk, dv are compared bit for bit with version 5's
    and 7's). Version 8 runs its own kernel where T % 4 == 0 (T = 104 here; at the main's 70 its dropout case is
    version 7's kernel); its whole tiles' scores without the mask must fail too."""
    old, new = ONE_PASS_MUTANTS[(version, mutant)]
    exe = _mutant(tmp_path, "attention_backward.cu", old, new, "attention_backward.cu")
    run = subprocess.run([str(exe)] + (["104"] if version == 8 else []), capture_output=True, text=True,
                         timeout=300)
    caught = rf"v{version} f16 d[qkv] mismatch|v8 = v7 bit for bit \(f16 dk, dv; its kernel, dropout\): NO"
    assert run.returncode != 0 and re.search(caught, run.stdout), run.stdout[-3000:]
    assert f"v{version - 1} f16 dq ok" in run.stdout, run.stdout[-3000:]      # (what ran before it passed)
    if mutant != "whole tiles unmasked":
        assert f"v{version} f16 dq mismatch" in run.stdout, run.stdout[-3000:]


def test_cpusim_catches_a_forward_v6_without_its_mask(tmp_path):
    """attention_forward.cu's version 6 adds the key tile's additive terms (the mask row, -inf past T) read once per
    two columns. With them left out, the main at p = 0 (where version 6 runs its own kernel) must fail naming
    version 6, after version 5 passed, or its comparison with version 5 proves nothing about that kernel."""
    exe = _mutant(tmp_path, "attention_forward.cu", "__fmul_rn(s[n][e], scale), (e & 1) ? mk.y : mk.x)",
                  "__fmul_rn(s[n][e], scale), 0.f)", "attention_forward.cu")
    run = subprocess.run([str(exe), "72", "0"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and re.search(r"v6 f16 mismatch|v6 = v5 bit for bit \(f16, bf16; its kernel, no "
                                             r"dropout\): NO", run.stdout), run.stdout[-3000:]
    assert "v5 f16 ok" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("depth", [4, 8])
def test_cpusim_catches_layernorm_partials_added_out_of_row_order(tmp_path, depth):
    """layernorm.cu's dw, db partials versions 4 and 5 load D = 4 / 8 rows before adding them, and must add them in
    row order to keep version 3's bits (the order every version's column sums share). With the adds of a group
    reversed in the D = depth body alone, the main's comparison of that version's partials with version 3's must
    say NO and exit 1 (version 4 at the 257-row shape, 5 rows a chunk: one group of 4; version 5 at the 577-row
    shape, 10 rows a chunk: one group of 8), or the comparison proves nothing about that body's order."""
    exe = _mutant(tmp_path, "layernorm.cu",
                  "        for (int i = 0; i < D; i++) dwdb_add4(sw, sb, g[i], v[i], m[i], rs[i]);",
                  f"        for (int i = 0; i < D; i++) {{ const int k = D == {depth} ? D - 1 - i : i; "
                  "dwdb_add4(sw, sb, g[k], v[k], m[k], rs[k]); }", "layernorm.cu")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    version = {4: 4, 8: 5}[depth]
    assert run.returncode != 0 and f"dw, db partials v{version} = v3 bit for bit (rk -1): NO" in run.stdout, \
        run.stdout[-3000:]
    if version == 5:                                   # (version 4's body untouched: it passed first)
        assert "dw, db partials v4 = v3 bit for bit (rk -1): yes" in run.stdout, run.stdout[-3000:]


# (what a later version must keep of its predecessor's bits, the mutation that breaks it, and the main's line that
# must then say so)
LATER_VERSIONS = {
    # gelu.cu's bias + GELU backward version 2 loads 4 rows before their arithmetic and must add each column's terms
    # in row order to keep version 1's bits (dx, the db partials): a group's rows taken last to first ((389, 8):
    # chunks of 7 rows, one group of 4)
    "gelu v2 rows in order": ("gelu.cu", "        for (int u = 0; u < 4; u++)\n            bias_gelu_step2",
                              "        for (int u = 3; u >= 0; u--)\n            bias_gelu_step2",
                              "backward v2 (rk -1, 0, 1; x kept in 16 bits or not): WRONG"),
    # gelu.cu's forward version 3 carries each group's column (e % I, for the bias) from stride to stride by adding
    # the stride's remainder and wrapping past I: without the wrap, a thread's later groups read the bias past its
    # end ((130, 12) on one block of 32 threads: 13 groups a thread)
    "gelu v3 wraps the column": ("gelu.cu", "        j += jstep;\n        if (j >= I) j -= I;\n",
                                 "        j += jstep;\n",
                                 "forward v3: WRONG (rk -1, 0, 1; bias or none;"),
    # ... and forms u = x + 0 without a bias as version 1 does (-0 + 0 is +0, so gelu(-0) is +0): x's -0s without it
    "gelu v3 adds the zero bias": ("gelu.cu", "gelu_f<TANH>(u.x + c.x), gelu_f<TANH>(u.y + c.y),",
                                   "gelu_f<TANH>(HAS_B ? u.x + c.x : u.x), gelu_f<TANH>(u.y + c.y),",
                                   "forward v3: WRONG (rk -1, 0, 1; bias or none;"),
    # attention_f32.cu's backward version 7 runs version 6 over groups of key tiles and carries dq's running sum from
    # group to group in dq itself: each group starting afresh (groups of 1 and 2 key tiles at T = 70 and 136)
    "f32 attention v7 carries dq": ("attention_f32.cu", "float4 s = first ? ld4(p) : ld4(dq + 4 * g);",
                                    "float4 s = first ? ld4(p) : make_float4(0.f, 0.f, 0.f, 0.f);",
                                    "v7 = v6 bit for bit (dq, dk, dv; groups of 1 and 2 key tiles): NO"),
    # attention_f32.cu's backward version 8 stores p and ds^T from the registers of S^T and dP^T, claiming version
    # 6's bits at p = 0 (its main compares them when run as `72 0`): ds with another query's D
    "f32 attention v8 stores ds^T": ("attention_f32.cu", "Pb[cl * A3_LD + rl] = p * (dpt[i][j] - drow[rl]);",
                                     "Pb[cl * A3_LD + rl] = p * (dpt[i][j] - drow[tx]);",
                                     "v8 = v6 bit for bit (dq, dk, dv; all key tiles, groups of 1 and 2): NO",
                                     ["72", "0"]),
    # cross_entropy.cu's version 3 finishes in the block holding the last ticket, which puts the counter back to 0:
    # without that the second call has no last block (its m and loss stay as the main poisoned them)
    "cross-entropy v3 resets its counter": ("cross_entropy.cu", "    if (t == 0) *done = 0u;", "",
                                            "v3 = v2 bit for bit (m, s, term, kept, loss, count; twice): NO"),
}


@pytest.mark.parametrize("case", sorted(LATER_VERSIONS))
def test_cpusim_catches_a_later_version_losing_its_predecessors_bits(tmp_path, case):
    """A version that claims its predecessor's bits is compared with it by its file's main; with the mutation that
    breaks the claim (LATER_VERSIONS) the main must say so and exit 1, or the comparison proves nothing."""
    where, old, new, says, *argv = LATER_VERSIONS[case]              # (argv: the main's arguments, if any)
    exe = _mutant(tmp_path, where, old, new, where)
    run = subprocess.run([str(exe), *(argv[0] if argv else [])], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and says in run.stdout, run.stdout[-3000:]

def test_cpusim_stops_at_a_misaligned_tensor_core_load(tmp_path):
    """ldmatrix and cp.async fault on a GPU when an address is not 16-byte aligned, which a CPU would not notice:
    the emulation checks every address and stops. A forward whose shared tiles are padded by 8 bytes (rows of
    136 bytes) instead of 16 is stopped at its first cp.async, naming it."""
    exe = _mutant(tmp_path, "attention_forward.cu", "LD = HS + 8;", "LD = HS + 4;", "attention_forward.cu", count=2)
    run = subprocess.run([str(exe), "20"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "not 16-byte aligned" in run.stderr, (run.stdout[-2000:], run.stderr[-2000:])


_ORDER = r"""
#include "cpusim.cuh"
#include <cstdio>
#include <cstring>
__global__ void neighbours(int* up, int* down) {  // s[t] written and read with no barrier between: a race
    __shared__ int s[64];
    const int t = threadIdx.x;
    s[t] = 0;
    __syncthreads();
    s[t] = t + 1;
    up[t] = t + 1 < 64 ? s[t + 1] : -1;           // a higher thread's value
    down[t] = t > 0 ? s[t - 1] : -1;              // a lower thread's
}
__global__ void stuck(int* x) {                   // lane 0 waits for the block, lanes 1-31 for the warp: neither
    if (threadIdx.x == 0) __syncthreads();        // barrier can complete
    else __syncwarp();
    x[threadIdx.x] = 1;
}
int main(int argc, char** argv) {
    int *up, *down;
    cudaMalloc(&up, 64 * sizeof(int));
    cudaMalloc(&down, 64 * sizeof(int));
    if (argc > 1 && !std::strcmp(argv[1], "stuck")) {
        LAUNCH(stuck, 1, 32, up);
        std::printf("finished\n");
        return 0;
    }
    LAUNCH(neighbours, 1, 64, up, down);
    int stale_up = 0, stale_down = 0;
    for (int t = 0; t < 64; t++) {
        stale_up += t + 1 < 64 && up[t] != t + 2;
        stale_down += t > 0 && down[t] != t;
    }
    std::printf("stale up %d down %d\n", stale_up, stale_down);
    return 0;
}
"""


@pytest.fixture(scope="module", params=["switch", "ucontext"])
def order_exe(request, tmp_path_factory):
    """The program above built with cpusim.cuh's fiber switch (x86-64's hand-written one where it has one) and with
    its portable fallback, ucontext's swapcontext (-DCPUSIM_UCONTEXT)."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ (C++20) to run the CUDA C on CPU threads")
    d = tmp_path_factory.mktemp("order")
    src = d / "order.cu"
    src.write_text(("#define CPUSIM_UCONTEXT\n" if request.param == "ucontext" else "") + _ORDER)
    build = _gpp(src, d / "order")
    assert build.returncode == 0, build.stderr[-3000:]
    return d / "order"


@pytest.mark.parametrize("order, stale", [(None, "up 63 down 0"), ("reverse", "up 0 down 63")])
def test_cpusim_runs_a_phase_in_thread_order(order_exe, order, stale):
    """Between two barriers a block's threads run one after another, thread 0 first (CPUSIM_ORDER=reverse: the
    last first), each to its next wait. A read of shared memory that another thread writes in the same phase (a
    barrier missing) therefore gets the old value exactly when the writer runs later: all 63 reads of the next
    thread's word in thread order, all 63 of the previous thread's in reverse, and none of the others."""
    env = {k: v for k, v in os.environ.items() if k != "CPUSIM_ORDER"} | ({"CPUSIM_ORDER": order} if order else {})
    run = subprocess.run([str(order_exe)], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0 and f"stale {stale}\n" in run.stdout, (run.stdout, run.stderr)


def test_cpusim_stops_a_deadlock_instead_of_hanging(order_exe):
    """Lane 0 at __syncthreads, lanes 1-31 at __syncwarp: on a GPU the block hangs (or worse); here the waits find
    nothing that can complete them and the program stops, naming the block, rather than hanging the suite."""
    run = subprocess.run([str(order_exe), "stuck"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "finished" not in run.stdout, (run.stdout, run.stderr)
    assert "cpusim: deadlock in block (0, 0, 0): 32 of 32 threads wait" in run.stderr, run.stderr
