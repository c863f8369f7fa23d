"""The closing lines of tests/conftest.py, from pytest runs on a generated folder: the skip summary
(one line per group of skipped tests, naming the reason, and so the variable or package that
would enable them) and the full tier (tests/tiers.py: left out and counted unless FUSEDRL_FULL=1)."""

import pytest
from tiers import FULL_ENV

# In-process pytest runs (pytester): a subprocess would import torch and the session's conftest
# again for each of the seven runs, most of a minute of CI's second core.
pytest_plugins = ["pytester"]

SKIPPING = {
    "test_env_a.py": 'import pytest\npytest.skip("FUSEDRL_FAKE_SRC is not set: point it at a checkout", allow_module_level=True)\n',
    "test_env_b.py": 'import pytest\npytest.skip("FUSEDRL_FAKE_SRC is not set: point it at a checkout", allow_module_level=True)\n',
    "test_package.py": 'import pytest\npytest.importorskip("fusedrl_no_such_package")\n\ndef test_never():\n    pass\n',
    "test_marked.py": (
        "import pytest\n\n"
        "@pytest.mark.skipif(True, reason='needs FUSEDRL_FAKE_DEVICE=1')\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_marked(n):\n    pass\n\n"
        "def test_runs():\n    pass\n"
    ),
}


@pytest.fixture
def run_pytest(pytester, monkeypatch):
    """run_pytest(files, full=None, returncode=0): the output of pytest -q over `files` written into
    pytester's folder (no conftest of its own, an empty pytest.ini), run in this process with the
    session's conftest loaded as a plugin, under FUSEDRL_FULL=`full` (None: unset); it must exit
    with `returncode`."""

    def run(files: dict, full: str = None, returncode: int = 0) -> str:
        pytester.makefile(".ini", pytest="[pytest]\n")
        for name, text in files.items():
            pytester.path.joinpath(name).write_text(text)
        if full is None:
            monkeypatch.delenv(FULL_ENV, raising=False)
        else:
            monkeypatch.setenv(FULL_ENV, full)
        result = pytester.runpytest_inprocess("-q", "-p", "conftest", "-p", "no:cacheprovider")
        out = "\n".join(result.outlines + result.errlines) + "\n"
        assert result.ret == returncode, out
        return out

    return run


def test_one_line_per_skip_reason_naming_what_enables_it(run_pytest):
    out = run_pytest(SKIPPING)
    summary = out[out.index("skipped, and what would enable them:\n") :].splitlines()[1:4]
    assert summary == [
        "  2 test files (test_env_a.py, test_env_b.py): FUSEDRL_FAKE_SRC is not set: point it at a checkout",
        "  2 tests (test_marked.py): needs FUSEDRL_FAKE_DEVICE=1",
        "  1 test file (test_package.py): could not import 'fusedrl_no_such_package': No module named 'fusedrl_no_such_package'",
    ], out
    assert "1 passed, 5 skipped" in out


def test_nothing_skipped_prints_no_summary(run_pytest):
    out = run_pytest({"test_plain.py": "def test_plain():\n    pass\n"})
    assert "1 passed" in out and "what would enable them" not in out


TIERED = {
    "test_tiered.py": (
        "import pytest\nfrom tiers import with_full_tier\n\n"
        "@pytest.mark.parametrize('v,j', with_full_tier([(1, 1), (7, 9)], (1, 7, 300), (1, 9)))\n"
        "def test_case(v, j):\n    pass\n"
    ),
}


def test_the_full_tier_is_left_out_and_counted_unless_asked_for(run_pytest):
    out = run_pytest(TIERED)
    assert "2 passed, 4 deselected" in out, out
    assert f"the full tier: 4 cases not run ({FULL_ENV}=1 runs them" in out
    for full, summary in (("1", "6 passed"), ("0", "2 passed, 4 deselected")):
        out = run_pytest(TIERED, full)
        assert summary in out, out
    assert "the full tier" not in run_pytest(TIERED, "1")


def test_a_tier_other_than_0_or_1_is_a_usage_error_naming_the_variable(run_pytest):
    out = run_pytest(TIERED, "yes", returncode=4)
    assert f"{FULL_ENV} must be 0 (the default tier) or 1 (the full tier), got 'yes'" in out
