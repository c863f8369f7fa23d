"""The stale-rollouts study (bench/studies/stale_rollouts.py) around made-up observations: the
records it keeps (bench/studies/stale_rollouts_store.py), resuming from them, the learning-rate
choice, the report from the records alone (bench/studies/stale_rollouts_report.py: the closing
table and both charts), and its refusals. The runs themselves are the loop of
tests/test_slime/test_upstream_slime_loop.py."""

import json
from dataclasses import asdict

import pytest
from bench_package import import_bench

import_bench()
from bench.studies import stale_rollouts  # noqa: E402
from bench.studies import stale_rollouts_report as report  # noqa: E402
from bench.studies.stale_rollouts_store import RunStore, compact  # noqa: E402

STEPS, SEEDS, LAGS = 100, 2, (0, 4)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def observations(config, level: float = 0.5) -> dict:
    """The loop's observations of `config`'s run: reward climbing linearly to `level`, drift growing
    with the lag, SFC ages 2 * lag + step % 2."""
    steps = [
        {"step": n, "rollout": n // 2, "reward": level * n / (config.steps - 1), "drift": config.lag * 1e-3 * (n % 3 - 1),
         "grad_norm": 1.0 + config.seed + config.lag, "pg_loss": 0.123456789,
         "ages": [config.lag, 2 * config.lag + n % 2] if config.method == "sfc" else None}
        for n in range(config.steps)
    ]  # fmt: skip
    return {"config": asdict(config), "steps": steps, "rollouts": [], "pushes": [], "seconds": 61.4}


def options(*argv):
    return stale_rollouts.parse(["--steps", str(STEPS), "--steps-per-rollout", "2", "--seeds", str(SEEDS),
                                 "--lags", *map(str, LAGS), *argv])  # fmt: skip


@pytest.fixture
def records():
    _, main = stale_rollouts.study_configs(options("--lrs", "3e-3"))
    return [compact(observations(config)) for config in main(dict.fromkeys(stale_rollouts.METHODS, 3e-3))]


def test_a_record_keeps_the_series_the_report_needs_compactly():
    config = stale_rollouts.loop.LoopConfig("sfc", lag=4, rollouts=40, steps_per_rollout=16)
    record = compact(observations(config))
    assert record["config"] == asdict(config) and record["seconds"] == 61
    assert set(record["series"]) == {"reward", "drift", "grad_norm", "pg_loss", "max_age"}
    assert record["series"]["pg_loss"][:1] == [0.12346]  # 5 significant digits
    assert record["series"]["max_age"][:2] == [8, 9]
    assert len(json.dumps(record, separators=(",", ":"))) < 40_000  # the described run's 640 steps


def test_table_has_a_row_per_arm_and_a_column_per_checkpoint(records):
    lines = report.table(records).splitlines()
    header, rows = lines[0].split(" | "), lines[2:]
    assert header[3:8] == [f"reward, steps {end - 19}-{end}" for end in (20, 40, 60, 80, 100)]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [
        "REINFORCE, lag 0", "REINFORCE, lag 4", "SFC + KL, lag 0", "SFC + KL, lag 4"]  # fmt: skip
    sfc_stale = rows[3].split(" | ")
    assert sfc_stale[2] == str(SEEDS)
    expected_last = sum(0.5 * n / (STEPS - 1) for n in range(80, STEPS)) / 20
    assert sfc_stale[7] == f"{expected_last:.3f} ({expected_last:.2f}-{expected_last:.2f})"
    assert sfc_stale[8] == "-0.004 to 0.004"  # drift over the last 64 steps
    assert sfc_stale[9] == "6"  # the largest gradient norm: 1 + seed 1 + lag 4
    assert sfc_stale[-1].rstrip(" |") == "9"  # the largest SFC age: 2 * lag + 1
    assert rows[0].split(" | ")[-1].rstrip(" |") == "-"  # REINFORCE has no ages


def test_report_writes_the_table_and_both_charts(records, tmp_path):
    text = report.write(records, tmp_path / "report")
    assert (tmp_path / "report" / report.TABLE).read_text() == text + "\n"
    for chart in (report.REWARD_CHART, report.STALENESS_CHART):
        assert (tmp_path / "report" / chart).read_bytes()[:8] == PNG_SIGNATURE, chart


def test_late_reward_and_drift_read_the_last_steps(records):
    sfc_stale = next(r for r in records if r["config"]["method"] == "sfc" and r["config"]["lag"] == 4)
    assert report.late_reward(sfc_stale) == pytest.approx(sum(0.5 * n / 99 for n in range(36, 100)) / 64, abs=1e-4)
    assert report.late_drift(sfc_stale) == pytest.approx(4e-3 * 43 / 64)  # |drift| is 4e-3 on two steps of three


def test_each_method_keeps_its_best_rate_of_the_grid_widened_until_bracketed(tmp_path, capsys):
    grid, _ = stale_rollouts.study_configs(options("--lrs", "1e-3", "3e-3", "1e-2"))
    # reinforce peaks inside the grid; sfc's reward keeps rising below it, peaking at 1e-4
    levels = {"reinforce": {1e-3: 0.2, 3e-3: 0.6, 1e-2: 0.1}, "sfc": {3e-5: 0.5, 1e-4: 0.9, 3e-4: 0.8, 1e-3: 0.7, 3e-3: 0.4, 1e-2: 0.1}}
    ran = []

    def run(configs):
        ran.extend((config.method, config.lr) for config in configs if (config.method, config.lr) not in ran)
        return [compact(observations(config, levels[config.method][config.lr])) for config in configs]

    added = []
    rates = stale_rollouts.bracketed_rates(run, grid, added.append)
    assert rates == {"reinforce": 3e-3, "sfc": 1e-4}
    assert [(config.method, config.lr) for config in added] == [("sfc", 3e-4), ("sfc", 1e-4)]
    assert [lr for method, lr in ran if method == "reinforce"] == [1e-3, 3e-3, 1e-2]
    assert [lr for method, lr in ran if method == "sfc"] == [1e-3, 3e-3, 1e-2, 3e-4, 1e-4]
    assert "sfc: the best rate 0.001 is at an end" in capsys.readouterr().err


def test_widening_stops_after_its_limit_and_says_the_rate_is_still_at_an_end(tmp_path, capsys):
    grid, _ = stale_rollouts.study_configs(options("--lrs", "1e-3", "3e-3", "1e-2"))
    rates = stale_rollouts.bracketed_rates(lambda configs: [compact(observations(c, 1e-4 / c.lr)) for c in configs], grid)
    assert rates == {method: 1e-4 for method in stale_rollouts.METHODS}  # two widenings: 3e-4, then 1e-4
    assert "still at an end" in capsys.readouterr().err


@pytest.mark.parametrize(
    "rate, direction, neighbour", [(3e-4, -1, 1e-4), (1e-3, -1, 3e-4), (3e-3, 1, 1e-2), (1e-2, 1, 3e-2), (1.0, -1, 0.3)]
)
def test_the_next_rate_is_the_half_decade_neighbour(rate, direction, neighbour):
    assert stale_rollouts.next_rate(rate, direction) == neighbour


def test_the_study_resumes_from_the_records_and_runs_only_the_missing(tmp_path, monkeypatch):
    ran = []

    def run_in_subprocess(config, workdir, engine, task_dir, **env):
        ran.append((config.method, config.lag, config.seed))
        return observations(config)

    monkeypatch.setattr(stale_rollouts.loop, "run_in_subprocess", run_in_subprocess)
    _, main = stale_rollouts.study_configs(options("--lrs", "3e-3"))
    configs = main(dict.fromkeys(stale_rollouts.METHODS, 3e-3))
    store = RunStore(tmp_path / "runs")
    store.save(configs[0], observations(configs[0]))  # committed by an earlier session
    progress = type("Quiet", (), {"finished": lambda self, what: None})()
    first = stale_rollouts.Study(store, tmp_path / "work").run(configs, progress)
    assert ran == [(c.method, c.lag, c.seed) for c in configs[1:]]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(f"{store.path(c).stem}.json" for c in configs)
    ran.clear()
    again = stale_rollouts.Study(RunStore(tmp_path / "runs"), tmp_path / "work").run(configs, progress)
    assert ran == [] and again == first


def test_a_resumed_study_counts_only_the_runs_still_to_come(tmp_path, monkeypatch, capsys):
    argv, store, configs = recorded_grid(tmp_path)
    earlier, *missing = [config for config in configs if store.saved(config) is None]
    store.save(earlier, observations(earlier))  # recorded by an earlier session
    monkeypatch.setattr(stale_rollouts.loop, "run_in_subprocess", lambda config, *args, **env: observations(config))
    stale_rollouts.main([*REPORT_GEOMETRY, *argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == [f"[{n}/{len(missing)}" for n in range(1, len(missing) + 1)]


def test_a_record_of_another_configuration_is_refused(tmp_path):
    config = stale_rollouts.loop.LoopConfig("sfc", rollouts=2)
    store = RunStore(tmp_path)
    store.save(config, observations(config))
    record = json.loads(store.path(config).read_text())
    record["config"]["kl_beta"] = 0.1
    store.path(config).write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="holds another configuration"):
        store.saved(config)


REPORT_GEOMETRY = ["--steps", str(STEPS), "--steps-per-rollout", "2", "--seeds", str(SEEDS), "--lags", *map(str, LAGS)]


def recorded_grid(tmp_path) -> tuple:
    """(argv, store, main configs at 3e-3): a grid of 1e-3 and 3e-3 recorded in tmp_path/runs, 3e-3 best."""
    argv = ["--lrs", "1e-3", "3e-3", "--runs", str(tmp_path / "runs"), "--report-dir", str(tmp_path / "report")]
    grid, main = stale_rollouts.study_configs(options(*argv))
    store = RunStore(tmp_path / "runs")
    for config in grid:
        store.save(config, observations(config, 0.3 if config.lr == 1e-3 else 0.6))
    return argv, store, main({"reinforce": 3e-3, "sfc": 3e-3})


def test_report_alone_rewrites_table_and_charts_from_the_records(tmp_path, capsys):
    argv, store, configs = recorded_grid(tmp_path)
    for config in configs:
        if store.saved(config) is None:
            store.save(config, observations(config))
    stale_rollouts.main(["--report", *REPORT_GEOMETRY, *argv])
    table = (tmp_path / "report" / report.TABLE).read_text()
    assert table.count("| 0.003 | 2 |") == 4  # every arm at the grid's best rate, over both seeds
    assert all((tmp_path / "report" / chart).exists() for chart in (report.REWARD_CHART, report.STALENESS_CHART))
    assert table.strip() in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [(["--steps", "300"], "multiple"), (["--seeds", "0"], "--seeds"), (["--lags", "0", "-1"], "--lags")],
)
def test_bad_arguments_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit):
        stale_rollouts.parse(argv)
    assert message in capsys.readouterr().err


def test_the_default_is_the_described_geometry():
    parsed = stale_rollouts.parse([])
    grid, main = stale_rollouts.study_configs(parsed)
    configs = main(dict.fromkeys(stale_rollouts.METHODS, 1e-3))
    assert (parsed.steps, parsed.steps_per_rollout, parsed.samples_per_step, parsed.draws, parsed.kl_beta) == (640, 16, 32, 4, 0.3)
    assert len(grid) == 6 and len(configs) == 18 and {c.lag for c in configs} == {0, 4, 8}
    assert len({stale_rollouts.RunStore(parsed.runs).path(c) for c in grid + configs}) == 22  # the grid's lag-0 seed-0 runs are shared
    assert parsed.runs == stale_rollouts.RUNS_DIR and "results" not in parsed.runs.parts  # tracked, not git-ignored


def test_a_partial_report_covers_the_recorded_runs_and_names_the_missing(tmp_path, capsys):
    argv, store, configs = recorded_grid(tmp_path)
    later = [config for config in configs if config.lag == 4 and config.seed == 1]
    stale_rollouts.main(["--report", "--partial", *REPORT_GEOMETRY, *argv])
    table = (tmp_path / "report" / report.TABLE).read_text()
    assert table.count("| 0.003 | 1 |") == 2 and "lag 4" not in table  # lag 0, seed 0 of each method: the grid's
    err = capsys.readouterr().err
    assert "partial report: 2 runs recorded, 6 not yet" in err and store.path(later[0]).stem in err
    with pytest.raises(SystemExit):
        stale_rollouts.parse(["--partial"])


def test_report_names_the_runs_it_has_no_records_of(tmp_path):
    with pytest.raises(SystemExit, match="no recorded runs reinforce-lr0.0003-lag0-seed0"):
        stale_rollouts.main(["--report", "--runs", str(tmp_path)])


def test_the_charts_caption_states_the_seeds_per_arm(records):
    assert report.describe(records).endswith("2 seeds per arm")
    one_short = [run for run in records if not (run["config"]["lag"] == 4 and run["config"]["seed"] == 1)]
    assert report.describe(one_short).endswith("1-2 seeds per arm")  # a partial report says so
