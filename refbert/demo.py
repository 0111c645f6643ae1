"""Offline demo data, built from text every Python install has: the docstrings of the standard library.

`refbert demo-data DIR` writes
    corpus.txt                        pretraining text: one sentence per line, a blank line between documents
                                      (a document is one docstring), the format `refbert pretrain` reads
    classification_{train,dev}.jsonl  {"text", "label"}: which part of the library a sentence describes
                                      (files, text, numbers, network, time)
    pair_{train,dev}.jsonl            {"text_a", "text_b", "label"}: "next" if b follows a in one docstring,
                                      "other" if b comes from another part of the library
    ner_{train,dev}.jsonl             {"tokens", "tags"}: BIO tags, NAME for a public name of the module the
                                      sentence documents, NUM for a number
    qa_{train,dev}.jsonl              {"question", "context", "answer_text", "answer_start"}: the context lists
                                      4 neighbouring functions of one module as "name: summary."; the question is
                                      "What does NAME do?", the answer that function's summary (a character span
                                      of the context). Every function of a window is asked about (a row each), so
                                      each entry is the answer as often as it is a distractor, and the first
                                      entry's summary (the baseline) is right a quarter of the time; a summary
                                      two functions share (as exact match compares answers) is never asked.
    qa_corpus.txt                     the QA training rows as pretraining text (a document per row: the question
                                      line, then the context line), for `refbert pretrain --init` to continue
                                      pretraining on the task's own text before fine-tuning (task-adaptive
                                      pretraining); no dev text
Train and dev are split by the documented object, so no sentence appears in both. The text is the Python
Software Foundation's, under the PSF License Agreement, as shipped with every CPython; refbert ships none of it
and generates it on the user's machine, so its exact contents follow the local Python version.
"""
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import warnings
import zlib

TOPICS = {
    "files": ["os", "posixpath", "shutil", "pathlib", "glob", "tempfile", "zipfile", "tarfile", "gzip", "fnmatch",
              "filecmp", "stat", "io", "_io"],
    "text": ["re", "string", "textwrap", "difflib", "unicodedata", "codecs", "html", "shlex", "tokenize", "locale",
             "gettext", "_string"],
    "numbers": ["math", "statistics", "decimal", "_decimal", "_pydecimal", "fractions", "random", "cmath", "numbers",
                "array", "struct", "heapq", "bisect", "_heapq", "_bisect", "_random"],
    "network": ["socket", "_socket", "http", "urllib", "email", "smtplib", "ftplib", "poplib", "imaplib", "ipaddress",
                "mimetypes", "select", "selectors"],
    "time": ["datetime", "_datetime", "_pydatetime", "time", "calendar", "threading", "_thread", "subprocess",
             "asyncio", "sched", "signal", "queue", "_queue", "multiprocessing", "concurrent"],
}
_MODULES = ["os", "os.path", "shutil", "pathlib", "glob", "tempfile", "zipfile", "tarfile", "gzip", "fnmatch",
            "filecmp", "stat", "io", "re", "string", "textwrap", "difflib", "unicodedata", "codecs", "html",
            "html.parser", "shlex", "tokenize", "locale", "gettext", "math", "statistics", "decimal", "fractions",
            "random", "cmath", "numbers", "array", "struct", "heapq", "bisect", "socket", "http.client",
            "http.server", "urllib.parse", "urllib.request", "email.message", "email.utils", "smtplib", "ftplib",
            "poplib", "imaplib", "ipaddress", "mimetypes", "select", "selectors", "datetime", "time", "calendar",
            "threading", "subprocess", "asyncio", "sched", "signal", "queue", "multiprocessing",
            "concurrent.futures", "json", "csv", "pickle", "sqlite3", "collections", "itertools", "functools",
            "operator", "logging", "argparse", "typing", "inspect", "dataclasses", "enum", "contextlib", "copy",
            "pprint", "hashlib", "base64", "uuid", "xml.etree.ElementTree", "configparser", "unittest", "traceback",
            "warnings", "ast", "zlib", "platform", "timeit", "pdb"]


def _topic(module_name):
    root = (module_name or "").split(".")[0]
    return next((t for t, roots in TOPICS.items() if root in roots), None)


def _sentences(doc):
    """Prose sentences of a docstring: code examples, signatures and very short fragments dropped."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        lines = [ln.strip() for ln in para.splitlines()]
        if not lines or any(ln.startswith((">>>", "...", "$ ")) for ln in lines):
            continue
        text = " ".join(ln for ln in lines if ln)
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(\"'])", text):
            if len(s.split()) >= 4 and len(s) <= 400 and not s.rstrip().endswith(":"):
                out.append(s)
    return out


def stdlib_docs():
    """[(module the object is defined in, object name, [sentences], public names of its module)], deduplicated,
    in a fixed order.

    The walk runs in a fresh interpreter (isolated: no site-packages, no environment variables): what a module
    holds depends on what was imported before it (concurrent.futures gains ThreadPoolExecutor once something has
    asked for it, a package gains its imported submodules), so the same walk inside pytest, or after numpy, found
    other docstrings than from the command line. A fresh `python -I -S` imports the same modules in the same order
    wherever it is started from."""
    code = ("import sys; sys.path = [p for p in sys.path if p]\n"    # not the current folder (-I: from 3.11 on)
            "import json, runpy\n"
            f"walk = runpy.run_path({os.path.abspath(__file__)!r}, run_name='refbert_demo_walk')['_walk']\n"
            "sys.stdout.write(json.dumps([(m, n, s, sorted(p)) for m, n, s, p in walk()]))\n")
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, encoding="utf-8")
    if p.returncode != 0:
        raise RuntimeError(f"demo-data: the walk of the standard library failed in a fresh interpreter: "
                           f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return [(m, n, s, set(pub)) for m, n, s, pub in json.loads(p.stdout)]


def _walk():
    """stdlib_docs' walk, in the process it runs in (see stdlib_docs)."""
    seen, docs = set(), []
    for m in _MODULES:
        try:
            with warnings.catch_warnings():               # some modules warn on import (deprecations): not ours
                warnings.simplefilter("ignore")
                mod = importlib.import_module(m)
        except ImportError:
            continue
        public = {n for n in dir(mod) if not n.startswith("_") and len(n) > 2}
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            where = getattr(obj, "__module__", None) or m
            # the object, then (for a class) its public methods: each docstring one document
            members = [(name, obj)] + ([(f"{name}.{k}", v) for k, v in sorted(vars(obj).items())
                                        if not k.startswith("_") and callable(v)] if inspect.isclass(obj) else [])
            for qualname, o in members:
                with warnings.catch_warnings():           # typing.io and friends warn when their __doc__ is read
                    warnings.simplefilter("ignore")
                    doc = getattr(o, "__doc__", None)
                doc = doc if isinstance(doc, str) else None
                doc = inspect.cleandoc(doc) if doc else None
                if not doc or doc in seen:
                    continue
                seen.add(doc)
                sents = _sentences(doc)
                if sents:
                    docs.append((where, qualname, sents, public))
    return docs


def _split(name, dev_fraction=0.15):
    return "dev" if zlib.crc32(name.encode()) % 1000 < dev_fraction * 1000 else "train"


def write_demo_data(out_dir, seed=0):
    """Write the corpus and the four fine-tuning sets (see the module docstring). Returns {file name: rows}."""
    import numpy as np                      # here: the walk runs this file in an interpreter without site-packages
    from .train import _qa_normalize        # SQuAD's answer normalising (train.py's exact match)
    rng = np.random.default_rng(seed)
    docs = stdlib_docs()
    os.makedirs(out_dir, exist_ok=True)
    rows = {f"{task}_{split}": [] for task in ("classification", "pair", "ner", "qa") for split in ("train", "dev")}
    by_topic = {}
    for module, name, sents, public in docs:
        split, topic = _split(f"{module}.{name}"), _topic(module)
        if topic:
            by_topic.setdefault(topic, []).append((module, name, sents))
            rows[f"classification_{split}"] += [{"text": s, "label": topic} for s in sents]
        for s in sents:
            words = s.split()
            tags = ["B-NUM" if re.fullmatch(r"[-+]?\d+(\.\d+)?", w.strip(".,;:()")) else
                    "B-NAME" if w.strip(".,;:()'\"`") in public else "O" for w in words]
            if any(t != "O" for t in tags):
                rows[f"ner_{split}"].append({"tokens": words, "tags": tags})
    topics = sorted(by_topic)
    for topic in topics:
        for module, name, sents in by_topic[topic]:
            split = _split(f"{module}.{name}")
            for a, b in zip(sents, sents[1:]):
                if rng.random() < 0.5:
                    rows[f"pair_{split}"].append({"text_a": a, "text_b": b, "label": "next"})
                else:
                    other = by_topic[topics[(topics.index(topic) + int(rng.integers(1, len(topics)))) % len(topics)]]
                    b = other[int(rng.integers(len(other)))][2]
                    rows[f"pair_{split}"].append({"text_a": a, "text_b": b[int(rng.integers(len(b)))], "label": "other"})
    # QA: windows of 4 functions of one module, in the same split
    per_module = {}
    for module, name, sents, _ in docs:
        # each entry reads "name: summary." with one full stop, at its end: a summary that reads like an entry
        # itself ("times_result: Result from ...") or holds a ". " inside would blur where entries start and end
        summary = sents[0] if sents[0].endswith(".") else sents[0] + "."
        if len(summary.split()) <= 25 and not re.search(r"(?:^|\s)[\w.]+: |\.\s", summary):
            per_module.setdefault((module, _split(f"{module}.{name}")), []).append((name, summary))
    for (module, split), entries in sorted(per_module.items()):
        for i in range(len(entries) - 3):              # every window of 4 neighbouring functions
            group = entries[i:i + 4]
            context, starts = "", []
            for name, summary in group:
                starts.append(len(context))
                context += f"{name}: {summary} "
            rng.integers(len(group))                    # (a draw the other files' order depends on)
            names = [n for n, _ in group]
            answers = [_qa_normalize(sm) for _, sm in group]   # as exact match compares them (SQuAD's normalising)
            for j, (name, summary) in enumerate(group):   # every function of the window is asked about
                if answers.count(answers[j]) > 1 or names.count(name) > 1:   # two functions share the summary (up
                    continue                               # to case, punctuation, articles) or the name: no single answer
                rows[f"qa_{split}"].append({"question": f"What does {name} do?", "context": context.strip(),
                                            "answer_text": summary, "answer_start": starts[j] + len(name) + 2})
    with open(os.path.join(out_dir, "corpus.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join("\n".join(sents) for _, _, sents, _ in docs) + "\n")
    # task-adaptive pretraining text (Gururangan et al. 2020, "Don't Stop Pretraining"): the QA training rows as
    # documents of two lines, question then context, so that MLM with NSP pairs masks names in one segment that
    # the other segment spells out; the dev rows stay unseen
    with open(os.path.join(out_dir, "qa_corpus.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(f"{r['question']}\n{r['context']}" for r in rows["qa_train"]) + "\n")
    for key, items in rows.items():
        order = rng.permutation(len(items))
        with open(os.path.join(out_dir, f"{key}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(items[i], ensure_ascii=False) + "\n" for i in order)
    counts = {f"{k}.jsonl": len(v) for k, v in rows.items()}
    counts["corpus.txt"] = len(docs)                   # documents (docstrings)
    counts["qa_corpus.txt"] = len(rows["qa_train"])    # documents (question, context)
    return counts
