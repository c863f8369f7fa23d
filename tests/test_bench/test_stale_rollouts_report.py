"""The stale-rollouts study's report (bench/studies/stale_rollouts.py) from made-up observations: the
closing table, the CSV and the chart, the learning-rate choice, and its refusals. The runs
themselves are the loop of tests/test_slime/test_upstream_slime_loop.py."""

import csv

import pytest
from bench_package import import_bench

import_bench()
from bench.studies import stale_rollouts  # noqa: E402

STEPS, SEEDS = 100, 2


def observations(method: str, lag: int, seed: int, lr: float = 3e-3, level: float = 0.5) -> dict:
    """A run whose reward climbs linearly to `level` and whose drift grows with the lag."""
    steps = [
        {"step": n, "rollout": n // 2, "reward": level * n / (STEPS - 1), "drift": lag * 1e-3 * (n % 3 - 1),
         "grad_norm": 1.0 + seed + lag, "pg_loss": 0.1, "ages": [2 * lag + n % 2] if method == "sfc" else None}
        for n in range(STEPS)
    ]  # fmt: skip
    config = {"method": method, "lr": lr, "lag": lag, "seed": seed, "rollouts": STEPS // 2, "steps_per_rollout": 2,
              "samples_per_step": 32, "num_draws": 4, "kl_beta": 0.3}  # fmt: skip
    return {"config": config, "steps": steps}


@pytest.fixture
def results():
    return {
        f"{method}-{lag}-{seed}": observations(method, lag, seed)
        for method in stale_rollouts.METHODS for lag in (0, 4) for seed in range(SEEDS)
    }  # fmt: skip


def test_table_has_a_row_per_arm_and_a_column_per_checkpoint(results):
    lines = stale_rollouts.table(results).splitlines()
    header, rows = lines[0], lines[2:]
    assert "reward, steps 1-50" in header and "reward, steps 51-100" in header
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [
        "REINFORCE, lag 0", "REINFORCE, lag 4", "SFC + KL, lag 0", "SFC + KL, lag 4"]  # fmt: skip
    sfc_stale = rows[3].split(" | ")
    assert sfc_stale[2] == str(SEEDS)
    expected_last = sum(0.5 * n / (STEPS - 1) for n in range(50, STEPS)) / 50
    assert sfc_stale[4] == f"{expected_last:.3f} ({expected_last:.2f}-{expected_last:.2f})"
    assert sfc_stale[-1].rstrip(" |") == "9"  # the largest SFC age: 2 * lag + 1
    assert rows[0].split(" | ")[-1].rstrip(" |") == "-"  # REINFORCE has no ages


def test_report_writes_the_csv_and_the_chart(results, tmp_path):
    stale_rollouts.report(results, tmp_path)
    with open(tmp_path / "steps.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(results) * STEPS
    assert {row["method"] for row in rows} == set(stale_rollouts.METHODS)
    assert (tmp_path / "stale_rollouts.png").stat().st_size > 0
    assert (tmp_path / "table.md").read_text().startswith("| run |")


def test_each_method_keeps_its_best_rate_of_the_grid():
    options = stale_rollouts.parse(["--lrs", "1e-3", "3e-3", "--steps", str(STEPS)])
    grid, _ = stale_rollouts.study_configs(options)
    levels = {("reinforce", 1e-3): 0.2, ("reinforce", 3e-3): 0.6, ("sfc", 1e-3): 0.7, ("sfc", 3e-3): 0.4}
    saved = {stale_rollouts.run_name(c): observations(c.method, 0, 0, c.lr, levels[(c.method, c.lr)]) for c in grid}
    assert stale_rollouts.best_rates(saved, grid) == {"reinforce": 3e-3, "sfc": 1e-3}


@pytest.mark.parametrize(
    "argv, message",
    [(["--steps", "300", "--steps-per-rollout", "16"], "multiple"), (["--seeds", "0"], "--seeds"), (["--lag", "-1"], "--lag")],
)
def test_bad_arguments_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit):
        stale_rollouts.parse(argv)
    assert message in capsys.readouterr().err


def test_report_names_the_runs_it_has_no_observations_of(tmp_path):
    with pytest.raises(SystemExit, match="no saved observations of reinforce-lr0.001-lag0-seed0"):
        stale_rollouts.main(["--report", "--out", str(tmp_path)])
