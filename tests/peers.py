"""The parity peers (torch, transformers): a test that needs one asks for it here (`peer("torch")`, or the `torch`
and `transformers` fixtures of conftest.py) and skips where it is missing, alone, rather than taking a whole file
with it. Under CI (the environment variable CI set, as CI runners set it; .ci/run installs the dev extra) a missing
peer fails the test instead: a parity test that skips there would pass unseen."""
import importlib
import os

import pytest

PEERS = ("torch", "transformers")


def in_ci():
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def peer(name):
    """The module `name` (torch, transformers or one of their modules), or skip the test (fail it under CI)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing = f"{name} is missing ({e})"
        if in_ci() and name.split(".")[0] in PEERS:
            pytest.fail(f"{missing}: CI runs every parity test (pip install -e '.[dev]')", pytrace=False)
        pytest.skip(missing)
