"""The SFC experiment end to end on CPU: SFC + KL on fresh and stale rollouts against ratio-free
REINFORCE and against what slime users run today (slime's PPO-clip loss with TIS), through slime's
own training loop, SGLang's real server and megatron-core: `python -m bench.studies.stale_rollouts`.

Each run is the loop of bench/slime_loop/loop.py (slime's train.py with slime's own objects in one
process, SGLang's CPU server with the package's plugin, the package's SFC rollout, age clock and
losses, megatron-core's optimizer, weight pushes; staleness as the experiment's own hook: the
engine serves the snapshot `lag` pushes behind the trainer) on the contextual target-token task of
bench/slime_loop/target_task.py, in a fresh process.

The default is the described run's geometry: 16 optimizer steps per rollout, 40 rollouts (640
steps), 32 samples a step, K = 4, beta0 = 0.3. The study, in this order:
- per method of GRID_METHODS (REINFORCE, SFC + KL, PPO + TIS), a 3-point learning-rate grid at lag
  0 (seed 0), whose best rate (the mean reward over the last 64 steps) that method keeps, so that
  the fresh baselines are each at their best before staleness is added; a best rate at an end of
  the grid is not bracketed, so that method's grid grows by the next rate past that end (half
  decades: 1e-4, 3e-4, 1e-3, ...) until its best lies inside;
- the main arms: each of those methods at its rate, and REINFORCE at SFC + KL's rate too (the
  described run's one shared rate; SHARED_RATE), at every lag of `--lags` (0, 4, 8: at lag 8 tokens
  are up to 143 steps old) over `--seeds` seeds, lag by lag;
- then, unless --no-extra, EXTRA_ARMS over the seeds: lag 16 for SFC + KL and PPO + TIS, PPO-clip
  without TIS at lags 4 and 8 (what TIS buys), icepop at lag 8 (at PPO + TIS's rate); the arms of
  each of those three groups seed by seed side by side (EXTRA_GROUPS).
It prints a progress line per run with the time left.

`--trust-region` runs the trust-region study instead (rollouts sixteen pushes, 256 optimizer
steps, stale): first M2PO's threshold, a seed-0 grid of M2PO (the package's policy loss,
`--fusedrl-m2po-tau`) at lag TRUST_REGION_LAG and rate TRUST_REGION_LR over TAU_GRID, extended by
factors of 4 while the learner's reward (bench/slime_loop/learner_reward.py, over the run's last
pushes) still rises at the grid's top (at most MAX_WIDENINGS times); then, at the chosen
threshold, seed by seed, M2PO at lags M2PO_LAGS, and at lag TRUST_REGION_LAG SFC + KL with the same
trust region (`--sfc-m2-tau`) and AReaL's variant through slime's own PPO loss + TIS
(slime_ext/m2_tis.py), and the methods without a trust region (COMPARISON_ARMS), all at
TRUST_REGION_LR and all with the learner's reward at every push.

`--workers N` runs N runs at once, each pinned to a core of its own with its own SGLang server and
one compute thread (bench/slime_loop/loop.py's `pinned`); docs/results.md gives runs per hour
either way.

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
import os
import queue
import sys
import threading
from dataclasses import replace
from pathlib import Path

from ..slime_loop import loop
from . import stale_rollouts_report as report
from .stale_rollouts_store import RunStore

ROOT = loop.ROOT
RUNS_DIR = ROOT / "bench" / "studies" / "stale_rollouts_runs"
REPORT_DIR = ROOT / "docs" / "stale_rollouts"
TRUST_REGION_REPORT_DIR = REPORT_DIR / "trust_region"
WORK_DIR = ROOT / "bench" / "results" / "stale_rollouts"
QUICK_DIR = ROOT / "bench" / "results" / "stale_rollouts_quick"  # --quick's runs, work and report: never committed
METHODS = loop.METHODS
GRID_METHODS = ("reinforce", "sfc", "ppo_tis")  # each at the best rate of its own grid
SHARED_RATE = {"reinforce": "sfc"}  # also run at that method's rate: the described run's one rate for both
# (method, lag) after the main arms, each at the rate of RATE_OF's method (else its own), group by
# group, a group's arms seed by seed side by side (a study cut short leaves comparable arms)
EXTRA_GROUPS = (
    (("sfc", 16), ("ppo_tis", 16)),  # far staler: the ratio-free loss against TIS's clipped weights
    (("ppo", 4), ("ppo", 8)),  # PPO-clip without TIS: what TIS buys
    (("icepop", 8),),
)
EXTRA_ARMS = tuple(arm for group in EXTRA_GROUPS for arm in group)
RATE_OF = {"ppo": "ppo_tis", "icepop": "ppo_tis"}
# The trust-region study: M2PO's threshold grid (the paper's 0.04 for LLMs at lr 1e-6, then
# larger: this task's policy moves far more per step), at the lag and rate it is chosen at.
TAU_GRID = (0.04, 0.16, 0.64)
TRUST_REGION_LAG, TRUST_REGION_LR = 16, 1e-3
M2PO_LAGS = (0, 8, 16)
# what the trust regions are measured against, with the learner's reward too: slime's PPO + TIS
# and SFC + KL, fresh and as stale (TRUST_REGION_LR is the lag-0 grid's best for both)
COMPARISON_ARMS = (("ppo_tis", 0), ("ppo_tis", TRUST_REGION_LAG), ("sfc", TRUST_REGION_LAG), ("sfc", 0))
LR_GRID = (3e-4, 1e-3, 3e-3)  # brackets the pilot's REINFORCE at 1e-3 (0.35 after 320 steps; 3e-3 stalled)
LAGS = (0, 4, 8)


MAX_WIDENINGS = 2  # per method; past that the study says the best rate is still at an end


def study_configs(options) -> tuple:
    """(the grid's configs, a function from the chosen rates to the main configs: the arms of the
    methods whose rate is given, lag by lag, seed by seed, then the extra arms)."""
    base = base_config(options)
    grid = [replace(base, method=method, lr=lr) for method in GRID_METHODS for lr in options.lrs]

    def main(rates: dict, extra: bool = True) -> list:
        arms = [(method, method) for method in GRID_METHODS]
        arms += [(method, rate_of) for method, rate_of in SHARED_RATE.items() if rates.get(rate_of) != rates.get(method)]
        configs = [
            replace(base, method=method, lr=rates[rate_of], lag=lag, seed=seed)
            for lag in options.lags for seed in range(options.seeds) for method, rate_of in arms if rate_of in rates
        ]  # fmt: skip
        configs += [
            replace(base, method=method, lr=rates[RATE_OF.get(method, method)], lag=lag, seed=seed)
            for group in (EXTRA_GROUPS if extra and options.extra else ())
            for seed in range(options.seeds)
            for method, lag in group if RATE_OF.get(method, method) in rates
        ]  # fmt: skip
        return configs

    return grid, main


def base_config(options) -> loop.LoopConfig:
    """The described run's geometry from the options, SFC at the default rate."""
    return loop.LoopConfig(
        "sfc", rollouts=options.steps // options.steps_per_rollout, steps_per_rollout=options.steps_per_rollout,
        samples_per_step=options.samples_per_step, num_draws=options.draws, kl_beta=options.kl_beta,
    )  # fmt: skip


def chosen_tau(options, run, widened=None) -> float:
    """M2PO's threshold: the grid's (TAU_GRID) best by the learner's late reward at lag
    TRUST_REGION_LAG, seed 0, the grid extended by a factor of 4 while its largest is the best;
    `run` gives the records of configs, `widened` (if given) hears of each config an extension adds."""
    base = replace(trust_region_base(options), lag=TRUST_REGION_LAG, seed=0, m2po_tau=TAU_GRID[0])
    taus = list(TAU_GRID)
    while True:
        records = run([replace(base, m2po_tau=tau) for tau in taus])
        best = max(range(len(taus)), key=lambda index: report.late_learner_reward(records[index]))
        if best < len(taus) - 1 or len(taus) == len(TAU_GRID) + MAX_WIDENINGS:
            print(f"M2PO's threshold: {taus[best]:g}, the best learner's reward of {taus}", file=sys.stderr, flush=True)
            return taus[best]
        taus.append(taus[-1] * 4)
        if widened is not None:
            widened(replace(base, m2po_tau=taus[-1]))


def trust_region_base(options) -> loop.LoopConfig:
    """The trust-region study's geometry, rate and learner's reward, M2PO at the first threshold."""
    return replace(base_config(options), method="m2po", lr=TRUST_REGION_LR, m2po_tau=TAU_GRID[0], learner_reward=True)


def trust_region_configs(options, tau: float) -> list:
    """The trust-region study's arms at the threshold `tau`, seed by seed: M2PO lag by lag, at lag
    TRUST_REGION_LAG SFC + KL with the trust region and AReaL's variant through slime's loss, then
    the COMPARISON_ARMS."""
    base = replace(trust_region_base(options), m2po_tau=tau)
    return [
        config for seed in range(options.seeds) for config in
        [replace(base, method="m2po", lag=lag, seed=seed) for lag in M2PO_LAGS]
        + [replace(base, method=method, lag=TRUST_REGION_LAG, seed=seed) for method in ("sfc_m2", "areal_m2")]
        + [replace(base, method=method, lag=lag, seed=seed, m2po_tau=None) for method, lag in COMPARISON_ARMS]
    ]  # fmt: skip


def next_rate(rate: float, direction: int) -> float:
    """The neighbour of `rate` on the half-decade ladder (..., 1e-4, 3e-4, 1e-3, ...), below (-1) or above (+1)."""
    decade, odd = divmod(round(2 * math.log10(rate)) + direction, 2)
    return float(f"{3 if odd else 1}e{decade}")


def bracketed_rates(run, grid: list, widened=None, methods=GRID_METHODS) -> dict:
    """Per method of `methods`, the best lag-0 rate of the grid, widened past whichever end holds
    the best until the best lies inside (at most MAX_WIDENINGS times); `run` gives the records of
    configs, `widened` (if given) hears of each config a widening adds."""
    rates = {}
    for method in methods:
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
    """Runs configs (or reads their records) with a progress line each, `len(engines)` at a time:
    `engines` holds per worker the (host, port) of its SGLang server, whose task lives in
    `work`/task, or None for a server per run; with more than one worker, worker i keeps to core i."""

    def __init__(self, store: RunStore, work: Path, engines=(None,)):
        self.store, self.work, self.engines = store, work, list(engines)
        self.lock = threading.Lock()  # the store's commits and the progress lines, one at a time

    def run(self, configs, progress) -> list:
        """The records of `configs`, running those not recorded yet."""
        todo = queue.Queue()
        for config in dict.fromkeys(config for config in configs if self.store.saved(config) is None):
            todo.put(config)
        failures = []
        workers = [
            threading.Thread(target=self._work, args=(todo, engine, None if len(self.engines) == 1 else cpu, progress, failures))
            for cpu, engine in enumerate(self.engines)
        ]  # fmt: skip
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if failures:
            raise failures[0]
        return [self.store.saved(config) for config in configs]

    def _work(self, todo, engine, cpu, progress, failures) -> None:
        while not failures:
            try:
                config = todo.get_nowait()
            except queue.Empty:
                return
            name = self.store.path(config).stem
            try:
                # the losses on the float64 reference path: the fused kernels through the Triton
                # interpreter would cost seconds per training call (the CI test runs them in the loop)
                observations = loop.run_in_subprocess(
                    config, self.work / "runs" / name, engine, self.work / "task" if engine else None,
                    cpu=cpu, TRITON_INTERPRET=None,
                )  # fmt: skip
            except Exception as error:  # noqa: BLE001: the study stops once the running runs end
                failures.append(error)
                return
            with self.lock:
                record = self.store.save(config, observations, concurrent=len(self.engines))
                # the progress line's own seconds are since the last run ended (two runs overlap)
                progress.finished(
                    f"{name} ({record['seconds']} s): reward over its last steps {report.late_reward(record):.3f}"
                )


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke size: 6 steps of 16 samples, 2 steps per rollout, lags 0 and 2, one seed, "
                        f"no grid (lr 3e-3), no extra arms; runs, work and report in {QUICK_DIR.relative_to(ROOT)}")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lags", type=int, nargs="+", default=list(LAGS), help="staleness of each arm, in weight pushes")
    parser.add_argument("--steps", type=int, default=640, help="optimizer steps per run")
    parser.add_argument("--steps-per-rollout", type=int, default=16, help="optimizer steps per rollout (--steps must be a multiple)")
    parser.add_argument("--samples-per-step", type=int, default=32)
    parser.add_argument("--draws", type=int, default=4, help="K, SFC's draws per token")
    parser.add_argument("--kl-beta", type=float, default=0.3, help="beta0 of SFC's KL")
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LR_GRID), help="the lag-0 learning-rate grid")
    parser.add_argument("--no-extra", dest="extra", action="store_false",
                        help=f"only the grid and the main arms, not the extra arms {list(EXTRA_ARMS)}")  # fmt: skip
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="runs at once, each on a core of its own (default: %(default)s, from the cores this process may use)")  # fmt: skip
    parser.add_argument("--one-server", action="store_true", help="one SGLang server per worker for all its runs (default: one per run)")
    parser.add_argument("--commit", action="store_true", help="git-commit each run's record as it finishes")
    parser.add_argument("--trust-region", action="store_true",
                        help=f"the trust-region study: M2PO's threshold grid {list(TAU_GRID)} at lag {TRUST_REGION_LAG}, "
                        f"then M2PO at lags {list(M2PO_LAGS)}, its SFC and AReaL arms and {list(COMPARISON_ARMS)}")  # fmt: skip
    parser.add_argument("--report", action="store_true", help="only write the table and charts from the recorded runs")
    parser.add_argument("--partial", action="store_true",
                        help="with --report: report the main runs recorded so far (the grid must be complete), naming the missing")
    parser.add_argument("--runs", type=Path, default=RUNS_DIR, help="the runs' records (read to resume, and for the report)")
    parser.add_argument("--work", type=Path, default=WORK_DIR, help="the runs' logs, weights and task")
    parser.add_argument("--report-dir", type=Path,
                        help=f"where the table and charts go (default: {REPORT_DIR}, with --trust-region {TRUST_REGION_REPORT_DIR})")  # fmt: skip
    options = parser.parse_args(argv)
    if options.report_dir is None:
        options.report_dir = TRUST_REGION_REPORT_DIR if options.trust_region else REPORT_DIR
    if options.quick:
        options.seeds, options.lags, options.steps, options.steps_per_rollout = 1, [0, 2], 6, 2
        options.samples_per_step, options.lrs, options.one_server, options.extra = 16, [3e-3], True, False
        options.runs, options.work, options.report_dir = QUICK_DIR / "records", QUICK_DIR, QUICK_DIR
    for name in ("seeds", "steps", "steps_per_rollout", "samples_per_step", "draws", "workers"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.workers > len(os.sched_getaffinity(0)):
        parser.error(f"--workers {options.workers} is more than the {len(os.sched_getaffinity(0))} cores this process may use")
    if options.partial and not options.report:
        parser.error("--partial goes with --report")
    if min(options.lags) < 0:
        parser.error(f"--lags must be >= 0, got {options.lags}")
    if options.steps % options.steps_per_rollout:
        parser.error(f"--steps ({options.steps}) must be a multiple of --steps-per-rollout ({options.steps_per_rollout})")
    return options


def default_workers() -> int:
    """Runs at once by default: two where this process may use two cores or more, which on the
    2-core machine finished 1.8 times the runs per hour of one at a time, quiet and under load
    (docs/results.md); more are untested."""
    return min(2, len(os.sched_getaffinity(0)))


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


def chosen_rates(options, run, grid: list, widened=None, methods=GRID_METHODS) -> dict:
    """The rate per method of `methods`: the bracketed best of the grid, or the one rate."""
    if len(options.lrs) == 1:
        return dict.fromkeys(METHODS, options.lrs[0])
    rates = bracketed_rates(run, grid, widened, methods)
    print(f"learning rates (the best at lag 0 of the grid {options.lrs}, widened where needed): {rates}",
          file=sys.stderr, flush=True)  # fmt: skip
    return rates


def recorded_rates(options, store: RunStore, grid: list) -> dict:
    """The rates of the methods whose grid (and any widening it needs) is recorded already."""
    rates = {}
    for method in GRID_METHODS:
        try:
            rates.update(chosen_rates(options, recorded(store), grid, methods=(method,)))
        except SystemExit:
            continue
    return rates


def write_report(options, store: RunStore, configs, charted=None) -> None:
    """The report of `configs`' records, its charts of `charted`'s (default: the same)."""
    charted_runs = None if charted is None else [store.saved(config) for config in charted]
    text = report.write([store.saved(config) for config in configs], options.report_dir, charted_runs)
    print(text)
    print(f"wrote {report.TABLE}, {report.REWARD_CHART}, {report.STALENESS_CHART} in {options.report_dir}")


def start_engines(options) -> list:
    """A started SGLang server per worker (pinned to its core when there are several)."""
    task_dir = options.work / "task"
    task_dir.mkdir(parents=True, exist_ok=True)
    files = loop.task_files(task_dir, task_dir)
    pin = options.workers > 1
    servers = []
    for worker in range(options.workers):
        folder = options.work / f"server{worker}" if pin else task_dir
        folder.mkdir(parents=True, exist_ok=True)
        servers.append(loop.start_engine(files, folder, cpu=worker if pin else None))
    return servers


def trust_region_grid(options, store: RunStore) -> list:
    """The threshold grid's configs: TAU_GRID's, then each widening recorded in `store`."""
    base = replace(trust_region_base(options), lag=TRUST_REGION_LAG, seed=0)
    taus = list(TAU_GRID)
    while len(taus) < len(TAU_GRID) + MAX_WIDENINGS and store.saved(replace(base, m2po_tau=taus[-1] * 4)) is not None:
        taus.append(taus[-1] * 4)
    return [replace(base, m2po_tau=tau) for tau in taus]


def trust_region_report_configs(options, store: RunStore, tau: float) -> list:
    """What the trust-region report's table covers: the threshold grid, then the arms at the
    threshold `tau` (its charts: those arms alone)."""
    return list(dict.fromkeys(trust_region_grid(options, store) + trust_region_configs(options, tau)))


def run_trust_region(options, store: RunStore, study: Study) -> None:
    """The trust-region study: the threshold grid, then M2PO's arms at the chosen threshold, then
    its report."""
    from ..harness.progress import Progress

    grid = [replace(trust_region_base(options), lag=TRUST_REGION_LAG, seed=0, m2po_tau=tau) for tau in TAU_GRID]
    progress = Progress([config.method for config in grid if store.saved(config) is None])

    def widened(config):
        if store.saved(config) is None:
            progress.expect_next([config.method])

    tau = chosen_tau(options, lambda configs: study.run(configs, progress), widened)
    configs = trust_region_configs(options, tau)
    progress.plan([config.method for config in configs if store.saved(config) is None])
    study.run(configs, progress)
    write_report(options, store, trust_region_report_configs(options, store, tau), configs)


def main(argv=None) -> None:
    options = parse(argv)
    from ..harness.progress import Progress

    grid, main_configs = study_configs(options)
    store = RunStore(options.runs, commit=options.commit)
    if options.report:
        charted = None
        if options.trust_region:
            tau = chosen_tau(options, recorded(store))
            configs, charted = trust_region_report_configs(options, store, tau), trust_region_configs(options, tau)
        else:
            configs = main_configs(chosen_rates(options, recorded(store), grid))
        if options.partial:
            missing = [store.path(config).stem for config in configs if store.saved(config) is None]
            configs = [config for config in configs if store.saved(config) is not None]
            charted = charted and ([config for config in charted if config in configs] or None)
            print(f"partial report: {len(configs)} runs recorded, {len(missing)} not yet: {', '.join(missing)}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if not configs:
                raise SystemExit(f"no main run recorded yet in {store.folder}")
        _require_saved(store, configs)
        write_report(options, store, configs, charted)
        return
    servers = start_engines(options) if options.one_server else []
    engines = [(loop.HOST, server.wait_ready(loop.ENGINE_START_TIMEOUT_S).port) for server in servers] or [None] * options.workers
    study = Study(store, options.work, engines)
    if options.trust_region:
        try:
            run_trust_region(options, store, study)
        finally:
            for server in servers:
                server.stop()
        return
    try:
        # First, side by side, the grid's unrecorded runs and the main arms of the methods whose
        # rate the records decide already; then the rates of the rest (widening where needed), the
        # main arms still to come and the extra arms. The runs to come are estimated until the
        # rates are chosen: the undecided methods' arms at any one rate, less their lag-0 seed-0
        # runs, which the grid shares.
        searched = len(options.lrs) > 1
        known = recorded_rates(options, store, grid) if searched else chosen_rates(options, None, grid)
        first = [config for config in grid + main_configs(known, extra=False) if store.saved(config) is None]
        later = [
            config for config in main_configs({**dict.fromkeys(GRID_METHODS, options.lrs[0]), **known})
            if config not in first and store.saved(config) is None
            and not (searched and config.lag == config.seed == 0 and config.method in set(GRID_METHODS) - set(known))
        ]  # fmt: skip
        progress = Progress([config.method for config in dict.fromkeys(first + later)])
        study.run(first, progress)

        def widened(config):  # the next run, unless an earlier session recorded it
            if store.saved(config) is None:
                progress.expect_next([config.method])

        configs = main_configs(chosen_rates(options, lambda configs: study.run(configs, progress), grid, widened))
        progress.plan([config.method for config in configs if store.saved(config) is None])
        study.run(configs, progress)
    finally:
        for server in servers:
            server.stop()
    write_report(options, store, configs)


if __name__ == "__main__":
    main()
