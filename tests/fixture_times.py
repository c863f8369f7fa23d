"""Where a pytest run's fixture set-up time goes, for CI's summary (.ci/run, .ci/file-times
--fixtures): with FUSEDRL_FIXTURE_TIMES naming a file, every fixture set-up of a second or more
appends one JSON line there (the fixture, its scope, the test or module that set it up first, its
seconds). A module fixture that starts servers or runs loops costs minutes once, which the per-test
`--durations` lines charge to whichever test happened to run first."""

import json
import os
import time

import pytest

ENV = "FUSEDRL_FIXTURE_TIMES"
MIN_SECONDS = 1.0


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Time one fixture's set-up (its own code, not the fixtures it depends on: those are set up first)."""
    started = time.perf_counter()
    yield
    seconds = time.perf_counter() - started
    path = os.environ.get(ENV)
    if path and seconds >= MIN_SECONDS:
        record = {"fixture": fixturedef.argname, "scope": fixturedef.scope, "at": request.node.nodeid, "seconds": round(seconds, 1)}
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")
