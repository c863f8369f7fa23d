"""The stale-rollouts study (bench/studies/stale_rollouts.py) around made-up observations: the
records it keeps (bench/studies/stale_rollouts_store.py), resuming from them, the learning-rate
choice, the report from the records alone (bench/studies/stale_rollouts_report.py: the closing
table and both charts), and its refusals. The runs themselves are the loop of
tests/test_slime/test_upstream_slime_loop.py."""

import json
import threading
from dataclasses import asdict, replace

import pytest
from bench_package import import_bench

import_bench()
from bench.studies import stale_rollouts  # noqa: E402
from bench.studies import stale_rollouts_report as report  # noqa: E402
from bench.studies.stale_rollouts_store import RunStore, compact, run_name  # noqa: E402

STEPS, SEEDS, LAGS = 100, 2, (0, 4)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def observations(config, level: float = 0.5) -> dict:
    """The loop's observations of `config`'s run: reward climbing linearly to `level`, drift growing
    with the lag, SFC ages 2 * lag + step % 2; for slime's PPO loss its metrics (TIS's only with a
    correction): clip fraction 0.1 + lag / 100, TIS weight 1 + lag / 10 on even steps, 1 on odd
    ones, TIS clip fraction lag / 100."""
    ppo = config.method in stale_rollouts.loop.PPO_CORRECTIONS
    corrected = ppo and config.method != "ppo"
    steps = [
        {"step": n, "rollout": n // 2, "reward": level * n / (config.steps - 1), "drift": config.lag * 1e-3 * (n % 3 - 1),
         "grad_norm": 1.0 + config.seed + config.lag, "pg_loss": 0.123456789,
         "ages": [config.lag, 2 * config.lag + n % 2] if config.method == "sfc" else None,
         **({"pg_clipfrac": 0.1 + config.lag / 100, "ppo_kl": 0.0, "tis": 1 + config.lag / 10 * (n % 2 == 0) if corrected else None,
             "tis_clipfrac": config.lag / 100 if corrected else None} if ppo else {})}
        for n in range(config.steps)
    ]  # fmt: skip
    return {"config": asdict(config), "steps": steps, "rollouts": [], "pushes": [], "seconds": 61.4}


def options(*argv):
    return stale_rollouts.parse(["--steps", str(STEPS), "--steps-per-rollout", "2", "--seeds", str(SEEDS),
                                 "--lags", *map(str, LAGS), *argv])  # fmt: skip


@pytest.fixture
def records():
    """Every arm at 3e-3, extra arms included."""
    _, main = stale_rollouts.study_configs(options("--lrs", "3e-3"))
    return [compact(observations(config)) for config in main(dict.fromkeys(stale_rollouts.METHODS, 3e-3))]


def rows_by_name(text: str) -> dict:
    """{the row's name: its cells} of a table."""
    rows = [line.strip("| ").split(" | ") for line in text.splitlines()[2:]]
    return {cells[0]: cells for cells in rows}


def test_a_record_keeps_the_series_the_report_needs_compactly():
    config = stale_rollouts.loop.LoopConfig("sfc", lag=4, rollouts=40, steps_per_rollout=16)
    record = compact(observations(config))
    assert record["config"] == asdict(config) and record["seconds"] == 61
    assert set(record["series"]) == {"reward", "drift", "grad_norm", "pg_loss", "max_age"}
    assert record["series"]["pg_loss"][:1] == [0.12346]  # 5 significant digits
    assert record["series"]["max_age"][:2] == [8, 9]
    assert "concurrent" not in record  # one run at a time on the machine
    assert len(json.dumps(record, separators=(",", ":"))) < 40_000  # the described run's 640 steps


@pytest.mark.parametrize("method, kept", [("ppo_tis", {"pg_clipfrac", "tis", "tis_clipfrac", "ppo_kl"}), ("ppo", {"pg_clipfrac", "ppo_kl"})])
def test_a_ppo_record_keeps_what_slime_reports_of_its_clip_and_correction(method, kept):
    config = stale_rollouts.loop.LoopConfig(method, lag=4, rollouts=40, steps_per_rollout=16)
    record = compact({**observations(config), "concurrent": 2})
    assert set(record["series"]) == {"reward", "drift", "grad_norm", "pg_loss", "max_age"} | kept
    assert record["series"]["pg_clipfrac"][:1] == [0.14] and record["concurrent"] == 2
    assert len(json.dumps(record, separators=(",", ":"))) < 60_000


def test_table_has_a_row_per_arm_and_a_column_per_checkpoint(records):
    lines = report.table(records).splitlines()
    header, rows = lines[0].split(" | "), lines[2:]
    assert header[3:8] == [f"reward, steps {end - 19}-{end}" for end in (20, 40, 60, 80, 100)]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [
        "REINFORCE, lag 0", "REINFORCE, lag 4", "SFC + KL, lag 0", "SFC + KL, lag 4", "SFC + KL, lag 16",
        "PPO + TIS, lag 0", "PPO + TIS, lag 4", "PPO + TIS, lag 16", "PPO, lag 4", "PPO, lag 8", "PPO + icepop, lag 8"]  # fmt: skip
    sfc_stale = rows_by_name(report.table(records))["SFC + KL, lag 4"]
    assert sfc_stale[2] == str(SEEDS)
    expected_last = sum(0.5 * n / (STEPS - 1) for n in range(80, STEPS)) / 20
    assert sfc_stale[7] == f"{expected_last:.3f} ({expected_last:.2f}-{expected_last:.2f})"
    assert sfc_stale[8] == "100%"  # of the fresh arm's late reward: the made-up runs climb alike at every lag
    assert sfc_stale[9] == "-0.004 to 0.004"  # drift over the last 64 steps
    assert sfc_stale[10] == "6"  # the largest gradient norm: 1 + seed 1 + lag 4
    assert sfc_stale[11] == "9"  # the largest SFC age: 2 * lag + 1
    assert sfc_stale[12:15] == ["-", "-", "-"]  # no PPO metrics
    assert sfc_stale[15:] == ["-", "", "-"]  # no learner's reward recorded, no trust region
    assert rows[0].split(" | ")[8] == ""  # the fresh arm is its own reference
    assert rows[0].split(" | ")[11] == "-"  # REINFORCE has no ages


def test_table_gives_ppo_clip_and_tis_over_the_last_steps_and_the_share_of_fresh(records):
    level = {0: 0.8, 4: 0.6, 16: 0.2}
    runs = [
        {**record, "series": {**record["series"], "reward": [level[record["config"]["lag"]]] * STEPS}}
        for record in records if record["config"]["method"] == "ppo_tis"
    ]  # fmt: skip
    rows = rows_by_name(report.table(runs))
    stale = rows["PPO + TIS, lag 4"]
    assert stale[8] == "75%"  # 0.6 of 0.8
    assert stale[12:15] == ["0.14", "1.2", "0.04"]  # clip fraction, TIS weight (1.4 and 1 alternately), TIS clip fraction
    assert rows["PPO + TIS, lag 16"][8] == "25%"


def test_trust_region_arms_are_families_by_threshold_with_the_learners_reward(tmp_path):
    """M2PO at two thresholds is two families; the learner's late reward (the mean over the pushes
    ending the last 64 steps: 32 pushes here, one per 2-step rollout) and its share of fresh, and
    the masked fraction over the last 64 steps, come from the records; the report draws both rewards."""
    runs = []
    for tau in (0.04, 0.16):
        for lag in (0, 16):
            config = stale_rollouts.loop.LoopConfig("m2po", lr=1e-3, lag=lag, rollouts=STEPS // 2, steps_per_rollout=2, m2po_tau=tau)
            learner = [0.1] * (STEPS // 2 - 31) + [0.8 if lag == 0 else 0.6] * 32  # the first push, then one per rollout
            steps = [{**step, "m2po_masked_frac": tau} for step in observations(config)["steps"]]
            pushes = [{"pushed": v + 1, "reward": r} for v, r in enumerate(learner)]
            runs.append(compact({**observations(config), "steps": steps, "learner_rewards": pushes}))
    assert report.late_learner_reward(runs[1]) == pytest.approx(0.6)
    rows = rows_by_name(report.table(runs))
    assert list(rows) == ["M2PO tau 0.04, lag 0", "M2PO tau 0.04, lag 16", "M2PO tau 0.16, lag 0", "M2PO tau 0.16, lag 16"]
    assert rows["M2PO tau 0.16, lag 16"][15:] == ["0.600", "75%", "0.16"]
    assert rows["M2PO tau 0.16, lag 0"][15:] == ["0.800", "", "0.16"]
    report.write(runs, tmp_path)
    assert (tmp_path / report.STALENESS_CHART).read_bytes()[:8] == PNG_SIGNATURE


def test_a_method_at_two_rates_is_two_families(records):
    shared = [
        {**record, "config": {**record["config"], "lr": 1e-3}}
        for record in records if record["config"]["method"] == "reinforce"
    ]  # fmt: skip
    rows = rows_by_name(report.table(records + shared))
    assert rows["REINFORCE at 0.001, lag 4"][1] == "0.001" and rows["REINFORCE at 0.003, lag 4"][1] == "0.003"
    assert "SFC + KL, lag 4" in rows  # one rate: the method's name alone
    assert "REINFORCE 0.001, 0.003" in report.describe(records + shared)


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
    levels = {"reinforce": {1e-3: 0.2, 3e-3: 0.6, 1e-2: 0.1}, "sfc": {3e-5: 0.5, 1e-4: 0.9, 3e-4: 0.8, 1e-3: 0.7, 3e-3: 0.4, 1e-2: 0.1},
              "ppo_tis": {1e-3: 0.3, 3e-3: 0.4, 1e-2: 0.35}}
    ran = []

    def run(configs):
        ran.extend((config.method, config.lr) for config in configs if (config.method, config.lr) not in ran)
        return [compact(observations(config, levels[config.method][config.lr])) for config in configs]

    added = []
    rates = stale_rollouts.bracketed_rates(run, grid, added.append)
    assert rates == {"reinforce": 3e-3, "sfc": 1e-4, "ppo_tis": 3e-3}
    assert [(config.method, config.lr) for config in added] == [("sfc", 3e-4), ("sfc", 1e-4)]
    assert [lr for method, lr in ran if method == "reinforce"] == [1e-3, 3e-3, 1e-2]
    assert [lr for method, lr in ran if method == "sfc"] == [1e-3, 3e-3, 1e-2, 3e-4, 1e-4]
    assert "sfc: the best rate 0.001 is at an end" in capsys.readouterr().err


def test_widening_stops_after_its_limit_and_says_the_rate_is_still_at_an_end(tmp_path, capsys):
    grid, _ = stale_rollouts.study_configs(options("--lrs", "1e-3", "3e-3", "1e-2"))
    rates = stale_rollouts.bracketed_rates(lambda configs: [compact(observations(c, 1e-4 / c.lr)) for c in configs], grid)
    assert rates == {method: 1e-4 for method in stale_rollouts.GRID_METHODS}  # two widenings: 3e-4, then 1e-4
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



@pytest.mark.parametrize("learner", [False, True])
def test_a_record_from_before_the_learner_field_is_read_by_whether_it_holds_the_learners_reward(tmp_path, learner):
    """A record written before LoopConfig had `learner_reward` reads back as the run it was: with
    the learner's reward where it holds one (named so), without it elsewhere; the same arm with
    and without it are two records."""
    config = stale_rollouts.loop.LoopConfig("ppo_tis", rollouts=2, learner_reward=learner)
    store = RunStore(tmp_path)
    pushes = [{"pushed": 1, "reward": 0.5}, {"pushed": 2, "reward": 0.75}, {"pushed": 3, "reward": 1.0}]
    store.save(config, {**observations(config), "learner_rewards": pushes if learner else []})
    record = json.loads(store.path(config).read_text())
    del record["config"]["learner_reward"]
    store.path(config).write_text(json.dumps(record))
    assert store.saved(config) == record
    assert store.path(config).stem.endswith("-learner") == learner
    assert store.saved(stale_rollouts.loop.LoopConfig("ppo_tis", rollouts=2, learner_reward=not learner)) is None


def test_the_trust_region_arms_and_their_comparisons_all_hold_the_learners_reward_at_one_rate():
    configs = stale_rollouts.trust_region_configs(options("--trust-region"), 2.56)
    assert all(config.learner_reward and config.lr == stale_rollouts.TRUST_REGION_LR for config in configs)
    arms = {(config.method, config.lag, config.m2po_tau) for config in configs}
    assert {(method, lag, None) for method, lag in stale_rollouts.COMPARISON_ARMS} < arms
    assert len(configs) == SEEDS * len(arms)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"method": "ppo_clip"}, "method must be one of"),
        ({"method": "m2po"}, "m2po_tau goes with"),
        ({"method": "sfc", "m2po_tau": 1.0}, "m2po_tau goes with"),
        ({"lag": -1}, "lag must be >= 0"),
        ({"samples_per_step": 12}, "samples_per_step \\(12\\) must be a multiple"),
        ({"weight_sync": "nccl"}, "weight_sync must be one of"),
        ({"weight_sync": "delta", "lag": 2}, "weight_sync 'delta' takes lag 0"),
        ({"weight_sync": "delta", "learner_reward": True}, "weight_sync 'delta' takes lag 0 and no learner's reward"),
    ],
)
def test_a_run_configuration_that_cannot_run_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        stale_rollouts.loop.LoopConfig(**{"method": "sfc", **fields})


def test_a_run_on_another_weight_push_has_a_name_of_its_own():
    names = {run_name(stale_rollouts.loop.LoopConfig("sfc", weight_sync=sync))
             for sync in stale_rollouts.loop.WEIGHT_SYNCS}  # fmt: skip
    assert len(names) == len(stale_rollouts.loop.WEIGHT_SYNCS)

REPORT_GEOMETRY = ["--steps", str(STEPS), "--steps-per-rollout", "2", "--seeds", str(SEEDS), "--lags", *map(str, LAGS)]


def recorded_grid(tmp_path) -> tuple:
    """(argv, store, main configs at 3e-3, the extra arms' included): a grid of 1e-3 and 3e-3 recorded
    in tmp_path/runs, 3e-3 best for every method."""
    argv = ["--lrs", "1e-3", "3e-3", "--runs", str(tmp_path / "runs"), "--report-dir", str(tmp_path / "report")]
    grid, main = stale_rollouts.study_configs(options(*argv))
    store = RunStore(tmp_path / "runs")
    for config in grid:
        store.save(config, observations(config, 0.3 if config.lr == 1e-3 else 0.6))
    return argv, store, main(dict.fromkeys(stale_rollouts.GRID_METHODS, 3e-3))


def test_report_alone_rewrites_table_and_charts_from_the_records(tmp_path, capsys):
    argv, store, configs = recorded_grid(tmp_path)
    for config in configs:
        if store.saved(config) is None:
            store.save(config, observations(config))
    stale_rollouts.main(["--report", *REPORT_GEOMETRY, *argv])
    table = (tmp_path / "report" / report.TABLE).read_text()
    # every arm at the grid's best rate, over both seeds: 3 methods at 2 lags, 5 extra arms
    assert table.count("| 0.003 | 2 |") == len(table.splitlines()) - 2 == 11
    assert all((tmp_path / "report" / chart).exists() for chart in (report.REWARD_CHART, report.STALENESS_CHART))
    assert table.strip() in capsys.readouterr().out


def with_learner(config, late: float) -> dict:
    """`observations` of `config` with the learner's reward per push, `late` over the last 32 pushes."""
    learner = [0.1] * (config.rollouts + 1 - 32) + [late] * 32
    return {**observations(config), "learner_rewards": [{"pushed": v + 1, "reward": r} for v, r in enumerate(learner)]}


def test_the_trust_region_report_covers_the_threshold_grid_and_the_arms_at_the_chosen_one(tmp_path, capsys):
    """`--trust-region --report`: the grid at lag 16 (its best, 0.64, at the top, so one widening
    is recorded too, below it), then every arm at 0.64 over the seeds, each once, in
    docs/stale_rollouts/trust_region unless told otherwise."""
    argv = [*REPORT_GEOMETRY, "--trust-region", "--runs", str(tmp_path / "runs"), "--report-dir", str(tmp_path / "report")]
    options = stale_rollouts.parse(argv)
    store = RunStore(tmp_path / "runs")
    base = replace(stale_rollouts.trust_region_base(options), lag=stale_rollouts.TRUST_REGION_LAG)
    for tau, late in ((0.04, 0.2), (0.16, 0.4), (0.64, 0.9), (2.56, 0.5)):
        config = replace(base, m2po_tau=tau)
        store.save(config, with_learner(config, late))
    for config in stale_rollouts.trust_region_configs(options, 0.64):
        if store.saved(config) is None:
            store.save(config, with_learner(config, 0.7))
    stale_rollouts.main(["--report", *argv])
    rows = rows_by_name((tmp_path / "report" / report.TABLE).read_text())
    grid = [f"M2PO tau {tau:g}, lag 16" for tau in (0.04, 0.16, 2.56)]
    arms = ["M2PO tau 0.64, lag 0", "M2PO tau 0.64, lag 8", "M2PO tau 0.64, lag 16", "SFC + KL, lag 0", "SFC + KL, lag 16",
            "PPO + TIS, lag 0", "PPO + TIS, lag 16", "SFC + KL + M2 tau 0.64, lag 16", "PPO + AReaL M2 tau 0.64, lag 16"]  # fmt: skip
    assert sorted(rows) == sorted(grid + arms)
    assert [rows[name][2] for name in grid] == ["1"] * 3 and [rows[name][2] for name in arms] == [str(SEEDS)] * len(arms)
    assert "M2PO's threshold: 0.64" in capsys.readouterr().err
    assert stale_rollouts.parse(["--trust-region"]).report_dir == stale_rollouts.TRUST_REGION_REPORT_DIR

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
    main_arms = [c for c in configs if (c.method, c.lag) not in stale_rollouts.EXTRA_ARMS]
    assert len(grid) == 9 and len(main_arms) == 27 and {c.lag for c in main_arms} == {0, 4, 8}
    assert len(configs) == 27 + 15 and {c.lag for c in configs} == {0, 4, 8, 16}  # 5 extra arms, 3 seeds each
    assert len({stale_rollouts.RunStore(parsed.runs).path(c) for c in grid + configs}) == 48  # the grid's lag-0 seed-0 runs are shared
    assert parsed.runs == stale_rollouts.RUNS_DIR and "results" not in parsed.runs.parts  # tracked, not git-ignored


def test_a_partial_report_covers_the_recorded_runs_and_names_the_missing(tmp_path, capsys):
    argv, store, configs = recorded_grid(tmp_path)
    later = [config for config in configs if config.lag == 4 and config.seed == 1]
    stale_rollouts.main(["--report", "--partial", *REPORT_GEOMETRY, *argv])
    table = (tmp_path / "report" / report.TABLE).read_text()
    assert table.count("| 0.003 | 1 |") == 3 and "lag 4" not in table  # lag 0, seed 0 of each method: the grid's
    err = capsys.readouterr().err
    assert "partial report: 3 runs recorded, 19 not yet" in err and store.path(later[0]).stem in err
    with pytest.raises(SystemExit):
        stale_rollouts.parse(["--partial"])


def test_report_names_the_runs_it_has_no_records_of(tmp_path):
    with pytest.raises(SystemExit, match="no recorded runs reinforce-lr0.0003-lag0-seed0"):
        stale_rollouts.main(["--report", "--runs", str(tmp_path)])


def test_the_charts_caption_states_the_seeds_per_arm(records):
    assert report.describe(records).endswith("2 seeds per arm")
    one_short = [run for run in records if not (run["config"]["lag"] == 4 and run["config"]["seed"] == 1)]
    assert report.describe(one_short).endswith("1-2 seeds per arm")  # a partial report says so


def test_reinforce_also_runs_at_sfcs_rate_and_the_extra_arms_at_their_methods_rates():
    _, main = stale_rollouts.study_configs(options())
    configs = main({"reinforce": 3e-4, "sfc": 1e-3, "ppo_tis": 3e-3})
    arms = {(c.method, c.lr, c.lag) for c in configs}
    assert {("reinforce", 3e-4, 4), ("reinforce", 1e-3, 4), ("sfc", 1e-3, 4), ("ppo_tis", 3e-3, 4)} <= arms
    assert {("sfc", 1e-3, 16), ("ppo_tis", 3e-3, 16), ("ppo", 3e-3, 8), ("icepop", 3e-3, 8)} <= arms
    assert not {("reinforce", 3e-3, 0), ("sfc", 3e-4, 0)} & arms
    # lag by lag, the main arms before the extra ones
    assert [c.lag for c in configs[: 4 * SEEDS * len(LAGS)]] == sorted(c.lag for c in configs[: 4 * SEEDS * len(LAGS)])
    extras = [(c.method, c.lag, c.seed) for c in configs[4 * SEEDS * len(LAGS) :]]
    # group by group, each group's arms seed by seed side by side
    assert extras == [
        (method, lag, seed)
        for group in stale_rollouts.EXTRA_GROUPS for seed in range(SEEDS) for method, lag in group
    ]  # fmt: skip
    assert extras[:4] == [("sfc", 16, 0), ("ppo_tis", 16, 0), ("sfc", 16, 1), ("ppo_tis", 16, 1)]
    _, without = stale_rollouts.study_configs(options("--no-extra"))
    assert len(without({"reinforce": 3e-4, "sfc": 1e-3, "ppo_tis": 3e-3})) == 4 * SEEDS * len(LAGS)
    assert len(main({"sfc": 1e-3})) == (2 * len(LAGS) + 1) * SEEDS  # only the arms at the rates known


def test_workers_share_the_runs_each_on_its_own_core_and_the_records_say_so(tmp_path, monkeypatch):
    ran, both_started = [], threading.Barrier(2, timeout=60)

    def run_in_subprocess(config, workdir, engine, task_dir, cpu=None, **env):
        if all(entry[-1] != cpu for entry in ran):  # each worker's first run waits for the other's:
            both_started.wait()  # an instant fake run would let one worker drain the queue alone
        ran.append((config.method, config.lag, config.seed, engine, cpu))
        return observations(config)

    monkeypatch.setattr(stale_rollouts.loop, "run_in_subprocess", run_in_subprocess)
    _, main = stale_rollouts.study_configs(options("--no-extra"))
    configs = main(dict.fromkeys(stale_rollouts.GRID_METHODS, 3e-3))
    store = RunStore(tmp_path / "runs")
    finished = []
    progress = type("Lines", (), {"finished": lambda self, what: finished.append(what)})()
    engines = [("127.0.0.1", 30000), ("127.0.0.1", 30001)]
    records = stale_rollouts.Study(store, tmp_path / "work", engines).run(configs, progress)
    assert sorted(r[:3] for r in ran) == sorted((c.method, c.lag, c.seed) for c in configs)  # each once
    assert {(engine, cpu) for *_, engine, cpu in ran} == {(engines[0], 0), (engines[1], 1)}
    assert len(finished) == len(configs) and all(record["concurrent"] == 2 for record in records)
    assert [record["config"]["seed"] for record in records] == [c.seed for c in configs]  # in the order asked


def test_a_failed_run_stops_the_study_with_its_error(tmp_path, monkeypatch):
    def run_in_subprocess(config, *args, **env):
        raise RuntimeError(f"the loop exited with 1 ({config.method})")

    monkeypatch.setattr(stale_rollouts.loop, "run_in_subprocess", run_in_subprocess)
    _, main = stale_rollouts.study_configs(options("--no-extra"))
    progress = type("Quiet", (), {"finished": lambda self, what: None})()
    study = stale_rollouts.Study(RunStore(tmp_path / "runs"), tmp_path / "work", [None, None])
    with pytest.raises(RuntimeError, match="the loop exited with 1"):
        study.run(main(dict.fromkeys(stale_rollouts.GRID_METHODS, 3e-3)), progress)
    assert not (tmp_path / "runs").exists()


def test_more_workers_than_cores_is_refused(capsys):
    with pytest.raises(SystemExit):
        stale_rollouts.parse(["--workers", "999"])
    assert "--workers 999" in capsys.readouterr().err


@pytest.mark.parametrize("cores, workers", [({0}, 1), ({0, 1}, 2), (set(range(8)), 2)])
def test_two_runs_at_once_by_default_where_two_cores_are_free(monkeypatch, cores, workers):
    monkeypatch.setattr(stale_rollouts.os, "sched_getaffinity", lambda pid: cores)
    assert stale_rollouts.parse([]).workers == workers
