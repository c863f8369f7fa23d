"""The stale-rollouts study's report, from its committed runs alone (bench/studies/stale_rollouts.py):
the closing table and two charts.

A run here is the compact record the study commits (`stale_rollouts_store.compact`): its
configuration and per-step series (`reward`, `drift`, `grad_norm`, `pg_loss`, `max_age`; for
slime's PPO loss also `pg_clipfrac`, `tis`, `tis_clipfrac`). An arm is a method at a learning rate
and a lag, over its seeds; a family is a method at a rate, over its lags.

- `table`: per arm, the reward at checkpoints (the mean over the CHECKPOINT_WINDOW steps ending at
  each fifth of the run: seed mean, seed range in brackets), the share of its family's fresh (lag
  0) late reward it keeps, the drift range over the last DRIFT_WINDOW steps, the largest gradient
  norm, the largest SFC age, and for PPO the clip fraction, TIS weight and TIS clip fraction over
  the last DRIFT_WINDOW steps (the described run's closing table, plus what says how stale the
  tokens were and how much the corrections cut).
- `plot_reward`: reward against step, a panel per family, a line per lag (seed mean of the
  SMOOTHING-step moving mean, the seed range as a band).
- `plot_staleness`: late reward (the last CHECKPOINT_WINDOW steps) and drift (the mean |drift| of
  the last DRIFT_WINDOW steps) against the lag, a line per family, seed range as error bars.
"""

import statistics
from pathlib import Path

LABELS = {"reinforce": "REINFORCE", "sfc": "SFC + KL", "ppo_tis": "PPO + TIS", "ppo": "PPO", "icepop": "PPO + icepop"}
COLOURS = {"reinforce": "tab:red", "sfc": "tab:blue", "ppo_tis": "tab:green", "ppo": "tab:olive", "icepop": "tab:purple"}
LINESTYLES = ("-", "--", ":")  # a method's families by rate, in increasing order
CHECKPOINTS = 5  # reward read at each fifth of the run
CHECKPOINT_WINDOW = 64  # steps averaged for a checkpoint's reward (the pilot's 64-step means)
DRIFT_WINDOW = 64  # last steps over which the drift is read (as in the described run)
SMOOTHING = 16  # steps of the reward chart's moving mean: one rollout of the described geometry
REWARD_CHART, STALENESS_CHART, TABLE = "reward_by_step.png", "reward_and_drift_by_lag.png", "table.md"


def arms(runs) -> dict:
    """{(method, lr, lag): [runs, by seed]}, by method (as LABELS orders them), rate, then lag."""
    grouped = {}
    for run in runs:
        config = run["config"]
        grouped.setdefault((config["method"], config["lr"], config["lag"]), []).append(run)
    order = sorted(grouped, key=lambda arm: (list(LABELS).index(arm[0]), *arm[1:]))
    return {arm: sorted(grouped[arm], key=lambda run: run["config"]["seed"]) for arm in order}


def families(runs) -> dict:
    """{(method, lr): {lag: [runs, by seed]}}: each method at each of its rates."""
    grouped = {}
    for (method, lr, lag), seeds in arms(runs).items():
        grouped.setdefault((method, lr), {})[lag] = seeds
    return grouped


def label(runs, method: str, lr: float) -> str:
    """The family's name: the method's, with its rate where the method runs at more than one."""
    rates = {run["config"]["lr"] for run in runs if run["config"]["method"] == method}
    return LABELS[method] if len(rates) == 1 else f"{LABELS[method]} at {lr:g}"


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


def late_learner_reward(run) -> float:
    """Mean learner's reward (bench/slime_loop/learner_reward.py) at the pushes that end the run's
    last CHECKPOINT_WINDOW steps (one push per rollout; the first push, before any step, left out)."""
    rewards = run["learner_reward"]
    count = max(1, min(CHECKPOINT_WINDOW // run["config"]["steps_per_rollout"], len(rewards) - 1))
    return statistics.fmean(rewards[-count:])


def late_drift(run) -> float:
    """Mean |drift| over the run's last DRIFT_WINDOW steps."""
    return statistics.fmean(abs(d) for d in run["series"]["drift"][-DRIFT_WINDOW:])


def _mean_and_range(values: list) -> str:
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.3f}{spread}"


def _late_mean(seeds, key: str) -> str:
    """The seed mean of `key`'s mean over the last DRIFT_WINDOW steps ("-" where not recorded)."""
    values = [v for run in seeds for v in run["series"].get(key, [])[-DRIFT_WINDOW:] if v is not None]
    return f"{statistics.fmean(values):.3g}" if values else "-"


def fresh_share(seeds, fresh) -> str:
    """The arm's late reward as a share of its family's at lag 0 (seed means; "" for lag 0 itself)."""
    if fresh is None or fresh is seeds:
        return ""
    return f"{statistics.fmean(map(late_reward, seeds)) / statistics.fmean(map(late_reward, fresh)):.0%}"


def table(runs) -> str:
    """The closing table, in markdown: a row per arm."""
    steps = steps_of(runs)
    window, ends = checkpoints(steps)
    late = min(DRIFT_WINDOW, steps)
    header = ["run", "lr", "seeds", *(f"reward, steps {end - window + 1}-{end}" for end in ends), "share of fresh",
              f"drift, last {late} steps", "max grad norm", "max SFC age",
              f"clip fraction, last {late}", f"TIS weight, last {late}", f"TIS clip fraction, last {late}"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (method, lr), lags in families(runs).items():
        for lag, seeds in lags.items():
            cells = [f"{label(runs, method, lr)}, lag {lag}", f"{lr:g}", str(len(seeds))]
            cells += [_mean_and_range([window_mean(run["series"]["reward"], end, window) for run in seeds]) for end in ends]
            cells.append(fresh_share(seeds, lags.get(0)))
            drifts = [d for run in seeds for d in run["series"]["drift"][-DRIFT_WINDOW:]]
            cells.append(f"{min(drifts):.3g} to {max(drifts):.3g}")
            cells.append(f"{max(g for run in seeds for g in run['series']['grad_norm']):.3g}")
            ages = [age for run in seeds for age in run["series"]["max_age"] if age is not None]
            cells.append(str(max(ages)) if ages else "-")
            cells += [_late_mean(seeds, key) for key in ("pg_clipfrac", "tis", "tis_clipfrac")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(runs) -> str:
    """The configuration the runs share, for the charts (two lines)."""
    config = runs[0]["config"]
    rates = "; ".join(
        f"{LABELS[method]} {', '.join(f'{lr:g}' for m, lr in families(runs) if m == method)}"
        for method in dict.fromkeys(m for m, _ in families(runs))
    )
    counts = sorted({len(seeds) for seeds in arms(runs).values()})
    seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (
        "contextual target token (16 contexts, vocabulary 64, 8 answer tokens); slime's train.py on CPU, SGLang's "
        "server with the plugin, megatron-core; lag: the engine serves the snapshot `lag` pushes behind the trainer\n"
        f"{steps_of(runs)} steps of {config['samples_per_step']} samples, {config['steps_per_rollout']} steps per "
        f"rollout; REINFORCE and SFC token-sum, PPO slime's reducer; SFC K = {config['num_draws']}, "
        f"beta0 = {config['kl_beta']}; lr {rates}; "
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
    """Reward against step: a panel per family, a line per lag, the seed range as a band."""
    plt = _pyplot()
    grouped = families(runs)
    lags = sorted({lag for by_lag in grouped.values() for lag in by_lag})
    shades = dict(zip(lags, plt.get_cmap("viridis")([i / max(1, len(lags) - 1) * 0.85 for i in range(len(lags))])))
    columns = min(3, len(grouped))
    rows = -(-len(grouped) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.2 * rows + 0.4), sharey=True, squeeze=False)
    for ax, ((method, lr), by_lag) in zip(axes.flat, grouped.items()):
        for lag, seeds in by_lag.items():
            smoothed = [moving_mean(run["series"]["reward"], SMOOTHING) for run in seeds]
            per_step = list(zip(*smoothed))
            ax.plot([statistics.fmean(v) for v in per_step], color=shades[lag], label=f"lag {lag}")
            ax.fill_between(range(len(per_step)), [min(v) for v in per_step], [max(v) for v in per_step],
                            color=shades[lag], alpha=0.2, linewidth=0)  # fmt: skip
        ax.set(title=f"{LABELS[method]}, lr {lr:g}", xlabel="optimizer step", ylim=(0, 1))
        ax.legend(fontsize=8, loc="upper left")
    for ax in list(axes.flat)[len(grouped) :]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel(f"reward ({SMOOTHING}-step moving mean)")
    _save(fig, runs, path)
    plt.close(fig)


def plot_staleness(runs, path: Path) -> None:
    """Late reward and late drift against the lag, a line per family, the seed range as error bars."""
    plt = _pyplot()
    fig, (reward_ax, drift_ax) = plt.subplots(1, 2, figsize=(12, 4.6))
    rates = {}
    for (method, lr), by_lag in families(runs).items():
        rates.setdefault(method, []).append(lr)
        style = LINESTYLES[min(len(rates[method]) - 1, len(LINESTYLES) - 1)]
        lags = list(by_lag)
        for ax, measure in ((reward_ax, late_reward), (drift_ax, late_drift)):
            values = [[measure(run) for run in seeds] for seeds in by_lag.values()]
            means = [statistics.fmean(v) for v in values]
            errors = [[m - min(v) for m, v in zip(means, values)], [max(v) - m for m, v in zip(means, values)]]
            ax.errorbar(lags, means, yerr=errors, color=COLOURS[method], linestyle=style, marker="o", capsize=4,
                        label=label(runs, method, lr))  # fmt: skip
    every_lag = sorted({lag for (_, _, lag) in arms(runs)})
    steps = steps_of(runs)
    reward_ax.set(xlabel="lag (weight pushes behind the trainer)", ylim=(0, 1), xticks=every_lag,
                  ylabel=f"reward over the last {min(CHECKPOINT_WINDOW, steps)} steps", title="late reward")  # fmt: skip
    drift_ax.set(xlabel="lag (weight pushes behind the trainer)", yscale="log", title="drift from the sampler",
                 xticks=every_lag, ylabel=f"mean |sampler - trainer log-prob| over the last {min(DRIFT_WINDOW, steps)} steps")  # fmt: skip
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
