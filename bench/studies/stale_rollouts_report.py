"""The stale-rollouts study's report, from its committed runs alone (bench/studies/stale_rollouts.py):
the closing table and two charts.

A run here is the compact record the study commits (`stale_rollouts_store.compact`): its
configuration and per-step series (`reward`, `drift`, `grad_norm`, `pg_loss`, `max_age`). An arm
is a method at a lag, over its seeds.

- `table`: per arm, the reward at checkpoints (the mean over the CHECKPOINT_WINDOW steps ending at
  each fifth of the run: seed mean, seed range in brackets), the drift range over the last
  DRIFT_WINDOW steps, the largest gradient norm and the largest SFC age (the described run's
  closing table, plus the ages that say how stale the tokens were).
- `plot_reward`: reward against step, a panel per method, a line per lag (seed mean of the
  SMOOTHING-step moving mean, the seed range as a band).
- `plot_staleness`: late reward (the last CHECKPOINT_WINDOW steps) and drift (the mean |drift| of
  the last DRIFT_WINDOW steps) against the lag, a line per method, seed range as error bars.
"""

import statistics
from pathlib import Path

LABELS = {"reinforce": "REINFORCE", "sfc": "SFC + KL"}
COLOURS = {"reinforce": "tab:red", "sfc": "tab:blue"}
CHECKPOINTS = 5  # reward read at each fifth of the run
CHECKPOINT_WINDOW = 64  # steps averaged for a checkpoint's reward (the pilot's 64-step means)
DRIFT_WINDOW = 64  # last steps over which the drift is read (as in the described run)
SMOOTHING = 16  # steps of the reward chart's moving mean: one rollout of the described geometry
REWARD_CHART, STALENESS_CHART, TABLE = "reward_by_step.png", "reward_and_drift_by_lag.png", "table.md"


def arms(runs) -> dict:
    """{(method, lag): [runs, by seed]}, sorted by method then lag."""
    grouped = {}
    for run in runs:
        grouped.setdefault((run["config"]["method"], run["config"]["lag"]), []).append(run)
    return {arm: sorted(grouped[arm], key=lambda run: run["config"]["seed"]) for arm in sorted(grouped)}


def steps_of(runs) -> int:
    """The runs' common length in optimizer steps (the report compares like with like)."""
    lengths = {len(run["series"]["reward"]) for run in runs}
    if len(lengths) != 1:
        raise ValueError(f"the runs differ in length ({sorted(lengths)} steps): report one geometry at a time")
    return lengths.pop()


def checkpoints(steps: int) -> tuple:
    """(window, [last step of each checkpoint]): CHECKPOINTS even ends, each reading the mean of
    the `window` steps up to it (CHECKPOINT_WINDOW, or less for a short run)."""
    window = max(1, min(CHECKPOINT_WINDOW, steps // CHECKPOINTS))
    return window, sorted({max(window, steps * i // CHECKPOINTS) for i in range(1, CHECKPOINTS + 1)})


def window_mean(series: list, end: int, width: int) -> float:
    """Mean of series[end - width : end]."""
    return statistics.fmean(series[end - width : end])


def late_reward(run) -> float:
    """Mean reward of the run's last CHECKPOINT_WINDOW steps (its whole length if shorter)."""
    rewards = run["series"]["reward"]
    return window_mean(rewards, len(rewards), min(CHECKPOINT_WINDOW, len(rewards)))


def late_drift(run) -> float:
    """Mean |drift| over the run's last DRIFT_WINDOW steps."""
    return statistics.fmean(abs(d) for d in run["series"]["drift"][-DRIFT_WINDOW:])


def _mean_and_range(values: list) -> str:
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.3f}{spread}"


def table(runs) -> str:
    """The closing table, in markdown: a row per arm."""
    steps = steps_of(runs)
    window, ends = checkpoints(steps)
    header = ["run", "lr", "seeds", *(f"reward, steps {end - window + 1}-{end}" for end in ends),
              f"drift, last {min(DRIFT_WINDOW, steps)} steps", "max grad norm", "max SFC age"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (method, lag), seeds in arms(runs).items():
        cells = [f"{LABELS[method]}, lag {lag}", f"{seeds[0]['config']['lr']:g}", str(len(seeds))]
        cells += [_mean_and_range([window_mean(run["series"]["reward"], end, window) for run in seeds]) for end in ends]
        drifts = [d for run in seeds for d in run["series"]["drift"][-DRIFT_WINDOW:]]
        cells.append(f"{min(drifts):.3g} to {max(drifts):.3g}")
        cells.append(f"{max(g for run in seeds for g in run['series']['grad_norm']):.3g}")
        ages = [age for run in seeds for age in run["series"]["max_age"] if age is not None]
        cells.append(str(max(ages)) if ages else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(runs) -> str:
    """The configuration the runs share, for the charts (two lines)."""
    config = runs[0]["config"]
    rates = ", ".join(f"{LABELS[m]} {seeds[0]['config']['lr']:g}" for (m, lag), seeds in arms(runs).items() if lag == 0)
    counts = sorted({len(seeds) for seeds in arms(runs).values()})
    seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (
        "contextual target token (16 contexts, vocabulary 64, 8 answer tokens); slime's train.py on CPU, SGLang's "
        "server with the plugin, megatron-core; lag: the engine serves the snapshot `lag` pushes behind the trainer\n"
        f"{steps_of(runs)} steps of {config['samples_per_step']} samples, {config['steps_per_rollout']} steps per "
        f"rollout, token-sum; SFC K = {config['num_draws']}, beta0 = {config['kl_beta']}; lr {rates}; "
        f"{seeds} seed{'s' if counts[-1] > 1 else ''} per arm"
    )


def moving_mean(values: list, width: int) -> list:
    return [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, runs, path: Path) -> None:
    fig.text(0.01, 0.01, describe(runs), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)


def plot_reward(runs, path: Path) -> None:
    """Reward against step: a panel per method, a line per lag, the seed range as a band."""
    plt = _pyplot()
    grouped = arms(runs)
    methods = sorted({method for method, _ in grouped})
    lags = sorted({lag for _, lag in grouped})
    shades = dict(zip(lags, plt.get_cmap("viridis")([i / max(1, len(lags) - 1) * 0.85 for i in range(len(lags))])))
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 4.6), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods):
        for lag in lags:
            smoothed = [moving_mean(run["series"]["reward"], SMOOTHING) for run in grouped.get((method, lag), [])]
            if not smoothed:
                continue
            per_step = list(zip(*smoothed))
            ax.plot([statistics.fmean(v) for v in per_step], color=shades[lag], label=f"lag {lag}")
            ax.fill_between(range(len(per_step)), [min(v) for v in per_step], [max(v) for v in per_step],
                            color=shades[lag], alpha=0.2, linewidth=0)  # fmt: skip
        ax.set(title=LABELS[method], xlabel="optimizer step", ylim=(0, 1))
        ax.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel(f"reward ({SMOOTHING}-step moving mean; seed mean, seed range)")
    _save(fig, runs, path)
    plt.close(fig)


def plot_staleness(runs, path: Path) -> None:
    """Late reward and late drift against the lag, a line per method, the seed range as error bars."""
    plt = _pyplot()
    fig, (reward_ax, drift_ax) = plt.subplots(1, 2, figsize=(12, 4.6))
    by_method = {}
    for (method, lag), seeds in arms(runs).items():
        by_method.setdefault(method, []).append((lag, seeds))
    for method, points in by_method.items():
        lags = [lag for lag, _ in points]
        for ax, measure in ((reward_ax, late_reward), (drift_ax, late_drift)):
            values = [[measure(run) for run in seeds] for _, seeds in points]
            means = [statistics.fmean(v) for v in values]
            errors = [[m - min(v) for m, v in zip(means, values)], [max(v) - m for m, v in zip(means, values)]]
            ax.errorbar(lags, means, yerr=errors, color=COLOURS[method], marker="o", capsize=4, label=LABELS[method])
            ax.set_xticks(lags)
    steps = steps_of(runs)
    reward_ax.set(xlabel="lag (weight pushes behind the trainer)", ylim=(0, 1),
                  ylabel=f"reward over the last {min(CHECKPOINT_WINDOW, steps)} steps", title="late reward")  # fmt: skip
    drift_ax.set(xlabel="lag (weight pushes behind the trainer)", yscale="log", title="drift from the sampler",
                 ylabel=f"mean |ppo_kl| over the last {min(DRIFT_WINDOW, steps)} steps")  # fmt: skip
    reward_ax.legend(fontsize=8)
    _save(fig, runs, path)
    plt.close(fig)


def write(runs, folder: Path) -> str:
    """The table and both charts into `folder`; the table's text."""
    folder.mkdir(parents=True, exist_ok=True)
    plot_reward(runs, folder / REWARD_CHART)
    plot_staleness(runs, folder / STALENESS_CHART)
    text = table(runs)
    (folder / TABLE).write_text(text + "\n")
    return text
