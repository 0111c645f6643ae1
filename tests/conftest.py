"""Hypothesis profiles: "ci" (the default) is derandomized with a bounded number of examples and no deadline, so a
slow example never flakes CI and a failure reproduces; HYPOTHESIS_PROFILE=dev explores more, randomly."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
