"""The SFC experiment end to end on CPU: ratio-free REINFORCE against SFC + KL on fresh and stale
rollouts, through slime's own training loop, SGLang's real server and megatron-core:
`python -m bench.studies.stale_rollouts`.

Each run is the loop of bench/slime_loop/loop.py (slime's train.py with slime's own objects in one
process, SGLang's CPU server with the package's plugin, the package's SFC rollout, age clock and
losses, megatron-core's optimizer, weight pushes; staleness as the experiment's own hook: the
engine serves the snapshot `lag` pushes behind the trainer) on the contextual target-token task of
bench/slime_loop/target_task.py, in a fresh process.

The default is the described run's geometry: 16 optimizer steps per rollout, 40 rollouts (640
steps), 32 samples a step, K = 4, beta0 = 0.3, token-sum. The study: per method, a 3-point
learning-rate grid at lag 0 (seed 0), whose best rate (the mean reward over the last 64 steps) that
method keeps, so that the fresh baselines are each at their best before staleness is added; a best
rate at an end of the grid is not bracketed, so that method's grid grows by the next rate past that
end (half decades: 1e-4, 3e-4, 1e-3, ...) until its best lies inside; then both methods at every
lag of `--lags` (0, 4, 8: at lag 8 tokens are up to 143 steps old) over `--seeds` seeds: 22 runs
and one per widening. It prints a progress line per run with the time left.

Each finished run's record (bench/studies/stale_rollouts_store.py) goes to `--runs`
(bench/studies/stale_rollouts_runs/, tracked; `--commit` commits each as it finishes): a run
recorded there is never run again, so the study resumes where any machine left it. Logs, weights
and the task go to `--work` (bench/results/stale_rollouts/, ignored). At the end, and alone with
`--report`, it writes the closing table and both charts from the records
(bench/studies/stale_rollouts_report.py) to `--report-dir` (docs/stale_rollouts/); `--report
--partial` reports the runs recorded so far while the sweep spans sessions.

It needs the test stack (SGLang, megatron-core; docs/install.md) and slime's source
(FUSEDRL_SLIME_SRC, as for the tests).
"""

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

from ..slime_loop import loop
from . import stale_rollouts_report as report
from .stale_rollouts_store import RunStore

ROOT = loop.ROOT
RUNS_DIR = ROOT / "bench" / "studies" / "stale_rollouts_runs"
REPORT_DIR = ROOT / "docs" / "stale_rollouts"
WORK_DIR = ROOT / "bench" / "results" / "stale_rollouts"
QUICK_DIR = ROOT / "bench" / "results" / "stale_rollouts_quick"  # --quick's runs, work and report: never committed
METHODS = loop.METHODS
LR_GRID = (3e-4, 1e-3, 3e-3)  # brackets the pilot's REINFORCE at 1e-3 (0.35 after 320 steps; 3e-3 stalled)
LAGS = (0, 4, 8)


MAX_WIDENINGS = 2  # per method; past that the study says the best rate is still at an end


def study_configs(options) -> tuple:
    """(the grid's configs, a function from the chosen rates to the main configs)."""
    base = loop.LoopConfig(
        "sfc", rollouts=options.steps // options.steps_per_rollout, steps_per_rollout=options.steps_per_rollout,
        samples_per_step=options.samples_per_step, num_draws=options.draws, kl_beta=options.kl_beta,
    )  # fmt: skip
    grid = [replace(base, method=method, lr=lr) for method in METHODS for lr in options.lrs]

    def main(rates: dict) -> list:
        # lag by lag, seed by seed, both methods side by side: a sweep cut short by a session's end
        # leaves comparable arms
        return [
            replace(base, method=method, lr=rates[method], lag=lag, seed=seed)
            for lag in options.lags for seed in range(options.seeds) for method in METHODS
        ]  # fmt: skip

    return grid, main


def next_rate(rate: float, direction: int) -> float:
    """The neighbour of `rate` on the half-decade ladder (..., 1e-4, 3e-4, 1e-3, ...), below (-1) or above (+1)."""
    decade, odd = divmod(round(2 * math.log10(rate)) + direction, 2)
    return float(f"{3 if odd else 1}e{decade}")


def bracketed_rates(run, grid: list, widened=None) -> dict:
    """Per method, the best lag-0 rate of the grid, widened past whichever end holds the best until
    the best lies inside (at most MAX_WIDENINGS times); `run` gives the records of configs,
    `widened` (if given) hears of each config a widening adds."""
    rates = {}
    for method in METHODS:
        tried = sorted((config for config in grid if config.method == method), key=lambda config: config.lr)
        for widening in range(MAX_WIDENINGS + 1):
            records = run(tried)
            best = max(range(len(tried)), key=lambda index: report.late_reward(records[index]))
            at_end = len(tried) > 2 and best in (0, len(tried) - 1)
            if not at_end or widening == MAX_WIDENINGS:
                break
            outward = replace(tried[best], lr=next_rate(tried[best].lr, -1 if best == 0 else 1))
            print(f"{method}: the best rate {tried[best].lr:g} is at an end of {[c.lr for c in tried]}; "
                  f"adding {outward.lr:g}", file=sys.stderr, flush=True)  # fmt: skip
            tried.insert(0 if best == 0 else len(tried), outward)
            if widened is not None:
                widened(outward)
        rates[method] = tried[best].lr
        if at_end:
            print(f"{method}: the best rate {rates[method]:g} is still at an end of {[c.lr for c in tried]}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return rates


class Study:
    """Runs configs (or reads their records) with a progress line each; `engine`: (host, port) of
    one SGLang server for every run, whose task lives in `work`/task."""

    def __init__(self, store: RunStore, work: Path, engine=None):
        self.store, self.work, self.engine = store, work, engine

    def run(self, configs, progress) -> list:
        """The records of `configs`, running those not recorded yet."""
        records = []
        for config in configs:
            record = self.store.saved(config)
            if record is None:
                name = self.store.path(config).stem
                task_dir = self.work / "task" if self.engine else None
                # the losses on the float64 reference path: the fused kernels through the Triton
                # interpreter would cost seconds per training call (the CI test runs them in the loop)
                observations = loop.run_in_subprocess(
                    config, self.work / "runs" / name, self.engine, task_dir, TRITON_INTERPRET=None
                )
                record = self.store.save(config, observations)
                progress.finished(f"{name}: reward over its last steps {report.late_reward(record):.3f}")
            records.append(record)
        return records


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke size: 6 steps of 16 samples, 2 steps per rollout, lags 0 and 2, one seed, "
                        f"no grid (lr 3e-3); runs, work and report in {QUICK_DIR.relative_to(ROOT)}")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lags", type=int, nargs="+", default=list(LAGS), help="staleness of each arm, in weight pushes")
    parser.add_argument("--steps", type=int, default=640, help="optimizer steps per run")
    parser.add_argument("--steps-per-rollout", type=int, default=16, help="optimizer steps per rollout (--steps must be a multiple)")
    parser.add_argument("--samples-per-step", type=int, default=32)
    parser.add_argument("--draws", type=int, default=4, help="K, SFC's draws per token")
    parser.add_argument("--kl-beta", type=float, default=0.3, help="beta0 of SFC's KL")
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LR_GRID), help="the lag-0 learning-rate grid")
    parser.add_argument("--one-server", action="store_true", help="one SGLang server for every run (default: one per run)")
    parser.add_argument("--commit", action="store_true", help="git-commit each run's record as it finishes")
    parser.add_argument("--report", action="store_true", help="only write the table and charts from the recorded runs")
    parser.add_argument("--partial", action="store_true",
                        help="with --report: report the main runs recorded so far (the grid must be complete), naming the missing")
    parser.add_argument("--runs", type=Path, default=RUNS_DIR, help="the runs' records (read to resume, and for the report)")
    parser.add_argument("--work", type=Path, default=WORK_DIR, help="the runs' logs, weights and task")
    parser.add_argument("--report-dir", type=Path, default=REPORT_DIR, help="where the table and charts go")
    options = parser.parse_args(argv)
    if options.quick:
        options.seeds, options.lags, options.steps, options.steps_per_rollout = 1, [0, 2], 6, 2
        options.samples_per_step, options.lrs, options.one_server = 16, [3e-3], True
        options.runs, options.work, options.report_dir = QUICK_DIR / "records", QUICK_DIR, QUICK_DIR
    for name in ("seeds", "steps", "steps_per_rollout", "samples_per_step", "draws"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.partial and not options.report:
        parser.error("--partial goes with --report")
    if min(options.lags) < 0:
        parser.error(f"--lags must be >= 0, got {options.lags}")
    if options.steps % options.steps_per_rollout:
        parser.error(f"--steps ({options.steps}) must be a multiple of --steps-per-rollout ({options.steps_per_rollout})")
    return options


def _require_saved(store: RunStore, configs) -> None:
    missing = [store.path(config).stem for config in configs if store.saved(config) is None]
    if missing:
        raise SystemExit(f"no recorded runs {', '.join(missing)} in {store.folder}")


def recorded(store: RunStore):
    """A `run` for bracketed_rates that only reads records, naming any missing one."""

    def run(configs) -> list:
        _require_saved(store, configs)
        return [store.saved(config) for config in configs]

    return run


def chosen_rates(options, run, grid: list, widened=None) -> dict:
    """The rate per method: the bracketed best of the grid, or the one rate."""
    if len(options.lrs) == 1:
        return dict.fromkeys(METHODS, options.lrs[0])
    rates = bracketed_rates(run, grid, widened)
    print(f"learning rates (the best at lag 0 of the grid {options.lrs}, widened where needed): {rates}",
          file=sys.stderr, flush=True)  # fmt: skip
    return rates


def write_report(options, store: RunStore, configs) -> None:
    text = report.write([store.saved(config) for config in configs], options.report_dir)
    print(text)
    print(f"wrote {report.TABLE}, {report.REWARD_CHART}, {report.STALENESS_CHART} in {options.report_dir}")


def main(argv=None) -> None:
    options = parse(argv)
    from ..harness.progress import Progress

    grid, main_configs = study_configs(options)
    searched = len(options.lrs) > 1
    store = RunStore(options.runs, commit=options.commit)
    if options.report:
        configs = main_configs(chosen_rates(options, recorded(store), grid))
        if options.partial:
            missing = [store.path(config).stem for config in configs if store.saved(config) is None]
            configs = [config for config in configs if store.saved(config) is not None]
            print(f"partial report: {len(configs)} runs recorded, {len(missing)} not yet: {', '.join(missing)}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if not configs:
                raise SystemExit(f"no main run recorded yet in {store.folder}")
        _require_saved(store, configs)
        write_report(options, store, configs)
        return
    study = Study(store, options.work)
    server = None
    if options.one_server:
        task_dir = options.work / "task"
        task_dir.mkdir(parents=True, exist_ok=True)
        server = loop.start_engine(loop.task_files(task_dir, task_dir), task_dir)
        study.engine = (loop.HOST, server.wait_ready(loop.ENGINE_START_TIMEOUT_S).port)
    try:
        # Runs to come, by method: the grid's unrecorded ones, then, until the grid has chosen the
        # rates, every main one but those the grid runs (lag 0, seed 0, at the chosen rate); once
        # it has, the main ones not recorded yet.
        grid_kinds = [config.method for config in grid if searched and store.saved(config) is None]
        shared = searched and 0 in options.lags
        main_kinds = [
            method for lag in options.lags for seed in range(options.seeds) for method in METHODS
            if not (shared and lag == 0 and seed == 0)
        ]  # fmt: skip
        progress = Progress(grid_kinds + main_kinds)

        def widened(config):  # the next run, unless an earlier session recorded it
            if store.saved(config) is None:
                progress.expect_next([config.method])

        configs = main_configs(chosen_rates(options, lambda configs: study.run(configs, progress), grid, widened))
        progress.plan([config.method for config in configs if store.saved(config) is None])
        study.run(configs, progress)
    finally:
        if server is not None:
            server.stop()
    write_report(options, store, configs)


if __name__ == "__main__":
    main()
