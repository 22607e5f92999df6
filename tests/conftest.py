"""Settings for the whole suite: under CI no test skips silently (tests/ci_skips.py)."""

pytest_plugins = ["tests.ci_skips"]
