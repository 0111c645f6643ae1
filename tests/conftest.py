"""Hypothesis profiles: "ci" (the default) is derandomized with a bounded number of examples and no deadline, so a
slow example never flakes CI and a failure reproduces; HYPOTHESIS_PROFILE=dev explores more, randomly.

The parity peers: fixtures `torch` and `transformers` (tests/peers.py) skip the test that asks for a missing one, or
fail it under CI; and under CI a `pytest.importorskip("torch")` / `("transformers")` that skips is turned into a
failure too, so that no parity test skips unseen there."""
import os
import re

import pytest
from hypothesis import HealthCheck, settings

from peers import in_ci, peer

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def torch():
    return peer("torch")


@pytest.fixture
def transformers():
    return peer("transformers")


_PEER_SKIP = re.compile(r"could not import '(torch|transformers)'")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and call.excinfo is not None and _PEER_SKIP.search(str(call.excinfo.value)):
        report.outcome = "failed"
        report.longrepr = f"{call.excinfo.value}: CI runs every parity test (pip install -e '.[dev]')"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and _PEER_SKIP.search(str(report.longrepr)):
        report.outcome = "failed"                 # a whole file skipped for a missing peer: an error under CI
