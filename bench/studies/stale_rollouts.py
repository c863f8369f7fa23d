"""The SFC experiment end to end on CPU: ratio-free REINFORCE against SFC + KL on fresh and stale
rollouts, through slime's own training loop, SGLang's real server and megatron-core:
`python -m bench.studies.stale_rollouts`.

Each run is the loop of tests/test_slime/slime_loop.py (slime's train.py with slime's own objects
in one process, SGLang's CPU server with the package's plugin, the package's SFC rollout, age clock
and losses, megatron-core's optimizer, weight pushes through `/update_weights_from_disk`; staleness
as the experiment's own hook: the engine serves the snapshot `lag` pushes behind the trainer) on
the contextual target-token task of tests/test_slime/target_task.py, in a fresh process.

The study: per method, a small learning-rate grid at lag 0 (seed 0), whose best rate (the mean
reward over the last 50 steps) that method keeps, so that the fresh baselines match before
staleness is added; then both methods at lag 0 and at `--lag`, over `--seeds` seeds. It prints a
progress line per run with the time left, and writes to `--out` (bench/results/stale_rollouts/):
each run's observations and logs (`runs/`), `steps.csv` (reward, drift, gradient norm and SFC ages
per step and run), `stale_rollouts.png` (reward and drift per step, seed means, the configuration
on the figure) and `table.md` (the closing table: reward at checkpoints, drift range, largest
gradient norm), which it also prints. A run whose observations are in `runs/` is not run again,
so an interrupted study resumes; `--report` writes the CSV, chart and table from them alone.

It needs the test stack (SGLang, megatron-core; docs/install.md) and slime's source
(FUSEDRL_SLIME_SRC, as for the tests).
"""

import argparse
import csv
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for folder in ("tests", "tests/test_slime", "tests/test_sglang"):  # the loop and its stand-ins live there
    if str(ROOT / folder) not in sys.path:
        sys.path.insert(0, str(ROOT / folder))

import slime_loop  # noqa: E402
from slime_loop import LoopConfig  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results" / "stale_rollouts"
METHODS = slime_loop.METHODS
LABELS = {"reinforce": "REINFORCE", "sfc": "SFC + KL"}
LR_GRID = (1e-3, 3e-3, 1e-2)
CHECKPOINT_WINDOW = 50  # steps averaged for a checkpoint's reward
DRIFT_WINDOW = 64  # last steps over which the drift range is read (as in the described run)
SMOOTHING = 10  # steps of the chart's moving means


def study_configs(options) -> tuple:
    """(the grid's configs, a function from the chosen rates to the main configs)."""
    base = LoopConfig(
        "sfc", rollouts=options.steps // options.steps_per_rollout, steps_per_rollout=options.steps_per_rollout,
        samples_per_step=options.samples_per_step, num_draws=options.draws, kl_beta=options.kl_beta,
    )  # fmt: skip
    grid = [replace(base, method=method, lr=lr) for method in METHODS for lr in options.lrs]

    def main(rates: dict) -> list:
        return [
            replace(base, method=method, lr=rates[method], lag=lag, seed=seed)
            for method in METHODS for lag in (0, options.lag) for seed in range(options.seeds)
        ]  # fmt: skip

    return grid, main


def run_name(config: LoopConfig) -> str:
    return (
        f"{config.method}-lr{config.lr:g}-lag{config.lag}-seed{config.seed}-"
        f"{config.steps_per_rollout}spr-{config.samples_per_step}sps-{config.steps}steps"
    )


def window(steps: int) -> int:
    """Steps averaged for a checkpoint's reward: CHECKPOINT_WINDOW, or all of a shorter run."""
    return min(CHECKPOINT_WINDOW, steps)


def last_reward(result: dict) -> float:
    rewards = [step["reward"] for step in result["steps"]]
    return statistics.fmean(rewards[-window(len(rewards)) :])


class Study:
    """Runs configs (or reads their saved observations) under `out`, with a progress line each."""

    def __init__(self, out: Path, engine=None):
        self.out, self.engine = out, engine
        (out / "runs").mkdir(parents=True, exist_ok=True)

    def saved(self, config: LoopConfig):
        path = self.out / "runs" / f"{run_name(config)}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def run(self, configs, progress) -> dict:
        """{run name: observations} for `configs`, running those not saved yet."""
        results = {}
        for config in configs:
            name = run_name(config)
            result = self.saved(config)
            if result is None:
                workdir = self.out / "runs" / name
                task_dir = self.out / "task" if self.engine else None
                # the losses on the float64 reference path: the fused kernels through the Triton
                # interpreter would cost seconds per training call (the CI test runs them in the loop)
                result = slime_loop.run_in_subprocess(config, workdir, self.engine, task_dir, TRITON_INTERPRET=None)
                (self.out / "runs" / f"{name}.json").write_text(json.dumps(result))
                progress.finished(f"{name}: reward over its last {window(config.steps)} steps {last_reward(result):.3f}")
            results[name] = result
        return results


def best_rates(grid_results: dict, grid: list) -> dict:
    """Per method, the grid's rate with the best reward over the last steps."""
    rates = {}
    for method in METHODS:
        tried = [config for config in grid if config.method == method]
        rates[method] = max(tried, key=lambda config: last_reward(grid_results[run_name(config)])).lr
    return rates


def write_csv(results: dict, path: Path) -> None:
    fields = ("run", "method", "lr", "lag", "seed", "step", "rollout", "reward", "drift", "grad_norm", "pg_loss", "max_age")
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        for name, result in results.items():
            config = result["config"]
            for step in result["steps"]:
                ages = step["ages"]
                writer.writerow([
                    name, config["method"], config["lr"], config["lag"], config["seed"], step["step"], step["rollout"],
                    step["reward"], step["drift"], step["grad_norm"], step["pg_loss"], max(ages) if ages else "",
                ])  # fmt: skip


def arms(results: dict) -> dict:
    """{(method, lag): [observations per seed]} of the main runs."""
    grouped = {}
    for result in results.values():
        config = result["config"]
        grouped.setdefault((config["method"], config["lag"]), []).append(result)
    return dict(sorted(grouped.items()))


def _seed_mean(runs, key) -> list:
    """Per step, the mean over the runs of `key`."""
    series = [[step[key] for step in run["steps"]] for run in runs]
    return [statistics.fmean(values) for values in zip(*series)]


def table(results: dict) -> str:
    """The closing table (markdown): per method and lag, the reward at checkpoints (the mean over
    the window of steps ending there: seed mean, and the range over seeds), the drift range over
    the last steps and the largest gradient norm."""
    steps = len(next(iter(results.values()))["steps"])
    span = window(steps)
    checkpoints = list(range(span, steps + 1, span))
    header = ["run", "lr", "seeds"] + [f"reward, steps {c - span + 1}-{c}" for c in checkpoints] + [
        f"drift, last {min(DRIFT_WINDOW, steps)} steps", "max grad norm", "max SFC age"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (method, lag), runs in arms(results).items():
        cells = [f"{LABELS[method]}, lag {lag}", f"{runs[0]['config']['lr']:g}", str(len(runs))]
        for checkpoint in checkpoints:
            per_seed = [statistics.fmean(step["reward"] for step in run["steps"][checkpoint - span : checkpoint]) for run in runs]
            spread = f" ({min(per_seed):.2f}-{max(per_seed):.2f})" if len(runs) > 1 else ""
            cells.append(f"{statistics.fmean(per_seed):.3f}{spread}")
        drifts = [step["drift"] for run in runs for step in run["steps"][-DRIFT_WINDOW:]]
        cells.append(f"{min(drifts):.3g} to {max(drifts):.3g}")
        cells.append(f"{max(step['grad_norm'] for run in runs for step in run['steps']):.3g}")
        ages = [max(step["ages"]) for run in runs for step in run["steps"] if step["ages"]]
        cells.append(str(max(ages)) if ages else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(results: dict) -> str:
    """The configuration the runs share, for the figure (two lines)."""
    config = next(iter(results.values()))["config"]
    rates = {result["config"]["method"]: result["config"]["lr"] for result in results.values()}
    seeds = max(len(runs) for runs in arms(results).values())
    return (
        "contextual target token (16 contexts, vocabulary 64, 8 answer tokens); slime's train.py on CPU, SGLang's "
        "server with the plugin, megatron-core; staleness: the engine serves the snapshot `lag` pushes behind\n"
        f"{config['steps_per_rollout'] * config['rollouts']} steps of {config['samples_per_step']} samples, "
        f"{config['steps_per_rollout']} steps per rollout, token-sum; SFC K = {config['num_draws']}, "
        f"beta0 = {config['kl_beta']}; lr " + ", ".join(f"{LABELS[m]} {r:g}" for m, r in sorted(rates.items()))
        + f"; {seeds} seed{'s' if seeds > 1 else ''} per line (mean)"
    )


def _moving_mean(values: list, width: int) -> list:
    return [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def plot(results: dict, path: Path) -> None:
    """Seed-mean reward and drift per step (moving means over SMOOTHING steps), one line per
    method and lag: a colour per method, solid when fresh."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward_ax, drift_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = {"reinforce": "tab:red", "sfc": "tab:blue"}
    for (method, lag), runs in arms(results).items():
        style = dict(color=colours[method], linestyle="-" if lag == 0 else "--", label=f"{LABELS[method]}, lag {lag}")
        reward_ax.plot(_moving_mean(_seed_mean(runs, "reward"), SMOOTHING), **style)
        drift_ax.plot(_moving_mean(_seed_mean(runs, "drift"), SMOOTHING), **style)
    smoothed = f" ({SMOOTHING}-step moving mean)" if SMOOTHING > 1 else ""
    reward_ax.set(xlabel="optimizer step", ylabel="reward of the step's samples" + smoothed, title="reward")
    drift_ax.set(xlabel="optimizer step", ylabel="ppo_kl: log q(a) - log pi(a)" + smoothed, title="drift from the sampler")
    drift_ax.set_yscale("symlog", linthresh=1e-3)
    reward_ax.legend(fontsize=8)
    fig.text(0.01, 0.01, describe(results), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: dict, out: Path) -> str:
    write_csv(results, out / "steps.csv")
    plot(results, out / "stale_rollouts.png")
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    return text


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke size: 6 steps of 16 samples, lag 2, one seed, no grid (lr 3e-3), one SGLang server")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lag", type=int, default=4, help="staleness of the stale arm, in weight pushes")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--steps-per-rollout", type=int, default=2,
                        help="optimizer steps per rollout; the described run's geometry is 16 (with --steps 320: "
                        "--steps must be a multiple)")  # fmt: skip
    parser.add_argument("--samples-per-step", type=int, default=32)
    parser.add_argument("--draws", type=int, default=4, help="K, SFC's draws per token")
    parser.add_argument("--kl-beta", type=float, default=0.3, help="beta0 of SFC's KL")
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LR_GRID), help="the lag-0 learning-rate grid")
    parser.add_argument("--one-server", action="store_true", help="one SGLang server for every run (default: one per run)")
    parser.add_argument("--report", action="store_true", help="only write the CSV, chart and table from the saved runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    options = parser.parse_args(argv)
    if options.quick:
        options.seeds, options.lag, options.steps, options.steps_per_rollout = 1, 2, 6, 2
        options.samples_per_step, options.lrs, options.one_server = 16, [3e-3], True
        if options.out == RESULTS_DIR:
            options.out = RESULTS_DIR.parent / "stale_rollouts_quick"
    for name in ("seeds", "steps", "steps_per_rollout", "samples_per_step", "draws"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.lag < 0:
        parser.error(f"--lag must be >= 0, got {options.lag}")
    if options.steps % options.steps_per_rollout:
        parser.error(f"--steps ({options.steps}) must be a multiple of --steps-per-rollout ({options.steps_per_rollout})")
    return options


def _require_saved(results: dict, out: Path) -> None:
    missing = [name for name, result in results.items() if result is None]
    if missing:
        raise SystemExit(f"no saved observations of {', '.join(missing)} in {out / 'runs'}")


def main(argv=None) -> None:
    options = parse(argv)
    from ..harness.progress import Progress

    grid, main_configs = study_configs(options)
    searched = len(options.lrs) > 1
    study = Study(options.out)
    if options.report:
        grid_results = {run_name(c): study.saved(c) for c in grid} if searched else {}
        _require_saved(grid_results, options.out)
        rates = best_rates(grid_results, grid) if searched else dict.fromkeys(METHODS, options.lrs[0])
        results = {run_name(c): study.saved(c) for c in main_configs(rates)}
        _require_saved(results, options.out)
        print(report(results, options.out))
        return
    server = None
    if options.one_server:
        task_dir = options.out / "task"
        task_dir.mkdir(parents=True, exist_ok=True)
        server = slime_loop.start_engine(slime_loop.task_files(task_dir, task_dir), task_dir)
        study.engine = (slime_loop.HOST, server.wait_ready(slime_loop.ENGINE_START_TIMEOUT_S).port)
    try:
        # Runs to come, by method: the grid's unsaved ones, then the main ones but the lag-0 seed-0
        # run at the chosen rate, which the grid ran.
        grid_kinds = [config.method for config in grid if searched and study.saved(config) is None]
        main_kinds = [method for method in METHODS for _ in range(2 * options.seeds - searched)]
        progress = Progress(grid_kinds + main_kinds)
        rates = best_rates(study.run(grid, progress), grid) if searched else dict.fromkeys(METHODS, options.lrs[0])
        print(f"learning rates (the best at lag 0 of {options.lrs}): {rates}", file=sys.stderr, flush=True)
        results = study.run(main_configs(rates), progress)
    finally:
        if server is not None:
            server.stop()
    print(report(results, options.out))
    print(f"wrote {options.out / 'steps.csv'}, {options.out / 'stale_rollouts.png'}, {options.out / 'table.md'}")


if __name__ == "__main__":
    main()
