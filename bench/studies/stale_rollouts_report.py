"""The stale-rollouts study's report, from its committed runs alone (bench/studies/stale_rollouts.py):
the closing table and two charts.

A run here is the compact record the study commits (`stale_rollouts_store.compact`): its
configuration and per-step series (`reward`, `drift`, `grad_norm`, `pg_loss`, `max_age`; for
slime's PPO loss also `pg_clipfrac`, `tis`, `tis_clipfrac`; for the trust regions
`m2po_masked_frac`, ...) and, in records since it exists, the learner's reward per push. An arm is
a method (with its trust region's threshold) at a learning rate and a lag, over its seeds; a family
is a method at a rate, over its lags.

- `table`: per arm, the reward at checkpoints (the mean over the CHECKPOINT_WINDOW steps ending at
  each fifth of the run: seed mean, seed range in brackets), the share of its family's fresh (lag
  0) late reward it keeps, the drift range over the last DRIFT_WINDOW steps, the largest gradient
  norm, the largest SFC age, and for PPO the clip fraction, TIS weight and TIS clip fraction over
  the last DRIFT_WINDOW steps (the described run's closing table, plus what says how stale the
  tokens were and how much the corrections cut); then, where recorded, the learner's late reward
  (`late_learner_reward`) and its share of the family's fresh one, and the trust region's masked
  fraction over the last DRIFT_WINDOW steps.
- `plot_reward`: reward against step, a panel per family, a line per lag (seed mean of the
  SMOOTHING-step moving mean, the seed range as a band).
- `plot_staleness`: late reward (the last CHECKPOINT_WINDOW steps), the learner's late reward
  (where recorded) and drift (the mean |drift| of the last DRIFT_WINDOW steps) against the lag, a
  line per family, seed range as error bars.
"""

import statistics
from pathlib import Path

LABELS = {"reinforce": "REINFORCE", "sfc": "SFC + KL", "ppo_tis": "PPO + TIS", "ppo": "PPO", "icepop": "PPO + icepop",
          "m2po": "M2PO", "sfc_m2": "SFC + KL + M2", "areal_m2": "PPO + AReaL M2"}  # fmt: skip
COLOURS = {"reinforce": "tab:red", "sfc": "tab:blue", "ppo_tis": "tab:green", "ppo": "tab:olive", "icepop": "tab:purple",
           "m2po": "tab:orange", "sfc_m2": "tab:cyan", "areal_m2": "tab:brown"}  # fmt: skip
LINESTYLES = ("-", "--", ":")  # a method's families by rate, in increasing order
CHECKPOINTS = 5  # reward read at each fifth of the run
CHECKPOINT_WINDOW = 64  # steps averaged for a checkpoint's reward (the pilot's 64-step means)
DRIFT_WINDOW = 64  # last steps over which the drift is read (as in the described run)
SMOOTHING = 16  # steps of the reward chart's moving mean: one rollout of the described geometry
REWARD_CHART, STALENESS_CHART, TABLE = "reward_by_step.png", "reward_and_drift_by_lag.png", "table.md"


def method_of(config) -> tuple:
    """(method, its trust region's threshold or None): what an arm's runs share besides rate and lag."""
    return config["method"], config.get("m2po_tau")


def method_label(method: tuple) -> str:
    name, tau = method
    return LABELS[name] if tau is None else f"{LABELS[name]} tau {tau:g}"


def arms(runs) -> dict:
    """{(method, lr, lag): [runs, by seed]}, method as `method_of` gives it, by method (as LABELS
    orders them, then threshold), rate, then lag."""
    grouped = {}
    for run in runs:
        config = run["config"]
        grouped.setdefault((method_of(config), config["lr"], config["lag"]), []).append(run)
    order = sorted(grouped, key=lambda arm: (list(LABELS).index(arm[0][0]), arm[0][1] or 0, *arm[1:]))
    return {arm: sorted(grouped[arm], key=lambda run: run["config"]["seed"]) for arm in order}


def families(runs) -> dict:
    """{(method, lr): {lag: [runs, by seed]}}: each method at each of its rates."""
    grouped = {}
    for (method, lr, lag), seeds in arms(runs).items():
        grouped.setdefault((method, lr), {})[lag] = seeds
    return grouped


def label(runs, method: tuple, lr: float) -> str:
    """The family's name: the method's, with its rate where the method runs at more than one."""
    rates = {run["config"]["lr"] for run in runs if method_of(run["config"]) == method}
    return method_label(method) if len(rates) == 1 else f"{method_label(method)} at {lr:g}"


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


def fresh_share(seeds, fresh, measure=None) -> str:
    """The arm's late reward (`measure`, default `late_reward`) as a share of its family's at lag 0
    (seed means; "" for lag 0 itself or where either has no record of it)."""
    measure = measure or late_reward
    if fresh is None or fresh is seeds or not all(map(_has_learner, seeds + fresh)) and measure is late_learner_reward:
        return ""
    return f"{statistics.fmean(map(measure, seeds)) / statistics.fmean(map(measure, fresh)):.0%}"


def _has_learner(run) -> bool:
    return bool(run.get("learner_reward"))


def _learner_cell(seeds) -> str:
    """The learner's late reward (seed mean and range), "-" where a run has none."""
    return _mean_and_range([late_learner_reward(run) for run in seeds]) if all(map(_has_learner, seeds)) else "-"


def table(runs) -> str:
    """The closing table, in markdown: a row per arm."""
    steps = steps_of(runs)
    window, ends = checkpoints(steps)
    late = min(DRIFT_WINDOW, steps)
    header = ["run", "lr", "seeds", *(f"reward, steps {end - window + 1}-{end}" for end in ends), "share of fresh",
              f"drift, last {late} steps", "max grad norm", "max SFC age",
              f"clip fraction, last {late}", f"TIS weight, last {late}", f"TIS clip fraction, last {late}",
              f"learner's reward, last {window} steps", "learner's share of fresh",
              f"trust region masked fraction, last {late}"]  # fmt: skip
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
            cells += [_learner_cell(seeds), fresh_share(seeds, lags.get(0), late_learner_reward)]
            cells.append(_late_mean(seeds, "m2po_masked_frac"))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(runs) -> str:
    """The configuration the runs share, for the charts (two lines)."""
    config = runs[0]["config"]
    rates = "; ".join(
        f"{method_label(method)} {', '.join(f'{lr:g}' for m, lr in families(runs) if m == method)}"
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
            if all(map(_has_learner, seeds)):  # the learner's reward at each push, after the rollout's steps
                per_push = [statistics.fmean(v) for v in zip(*(run["learner_reward"] for run in seeds))]
                spr = seeds[0]["config"]["steps_per_rollout"]
                ax.plot([spr * push for push in range(len(per_push))], per_push, color=shades[lag], linestyle=":",
                        label=f"lag {lag}, learner")  # fmt: skip
        ax.set(title=f"{method_label(method)}, lr {lr:g}", xlabel="optimizer step", ylim=(0, 1))
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
    with_learner = any(map(_has_learner, runs))  # its panel only where some run recorded it
    fig, axes = plt.subplots(1, 3 if with_learner else 2, figsize=(18 if with_learner else 12, 4.6))
    reward_ax, drift_ax, learner_ax = axes[0], axes[-1], axes[1] if with_learner else None
    panels = [(reward_ax, late_reward), (drift_ax, late_drift)] + ([(learner_ax, late_learner_reward)] if with_learner else [])
    rates = {}
    for (method, lr), by_lag in families(runs).items():
        rates.setdefault(method, []).append(lr)
        style = LINESTYLES[min(len(rates[method]) - 1, len(LINESTYLES) - 1)]
        for ax, measure in panels:
            recorded = {lag: seeds for lag, seeds in by_lag.items() if measure is not late_learner_reward or all(map(_has_learner, seeds))}
            if not recorded:
                continue
            lags = list(recorded)
            values = [[measure(run) for run in seeds] for seeds in recorded.values()]
            means = [statistics.fmean(v) for v in values]
            errors = [[m - min(v) for m, v in zip(means, values)], [max(v) - m for m, v in zip(means, values)]]
            ax.errorbar(lags, means, yerr=errors, color=COLOURS[method[0]], linestyle=style, marker="o", capsize=4,
                        label=label(runs, method, lr))  # fmt: skip
    every_lag = sorted({lag for (_, _, lag) in arms(runs)})
    steps = steps_of(runs)
    reward_ax.set(xlabel="lag (weight pushes behind the trainer)", ylim=(0, 1), xticks=every_lag,
                  ylabel=f"reward over the last {min(CHECKPOINT_WINDOW, steps)} steps",
                  title="late reward (the sampler's)" if with_learner else "late reward")  # fmt: skip
    if with_learner:
        learner_ax.set(xlabel="lag (weight pushes behind the trainer)", ylim=(0, 1), xticks=every_lag,
                       ylabel="learner's reward at the last pushes", title="the learner's late reward (where recorded)")  # fmt: skip
    drift_ax.set(xlabel="lag (weight pushes behind the trainer)", yscale="log", title="drift from the sampler",
                 xticks=every_lag, ylabel=f"mean |sampler - trainer log-prob| over the last {min(DRIFT_WINDOW, steps)} steps")  # fmt: skip
    reward_ax.legend(fontsize=8)
    _save(fig, runs, path)
    plt.close(fig)


def write(runs, folder: Path, charted=None) -> str:
    """The table of `runs` and both charts of `charted` (default: `runs`) into `folder`; the table's text."""
    folder.mkdir(parents=True, exist_ok=True)
    plot_reward(runs if charted is None else charted, folder / REWARD_CHART)
    plot_staleness(runs if charted is None else charted, folder / STALENESS_CHART)
    text = table(runs)
    (folder / TABLE).write_text(text + "\n")
    return text
