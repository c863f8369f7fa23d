"""Toy staleness experiment: ratio-free REINFORCE against SFC + KL on a sparse-reward bandit.

A contextual bandit with a tabular softmax policy (the parameters are the logits, one row per
context) trained with Adam. Each step samples a batch of contexts, one action per context from
the weights `staleness` updates old (the rollout engine of an asynchronous trainer), reward 1 for
the context's single correct action, advantage = reward - batch mean. Every context is seen only a
few times per batch, like a token position in an LLM rollout, so the baseline is not per context.
Half of the contexts start easy (the correct action has a head start), half start uniform.

Why REINFORCE stalls: for `-A log pi(a)` with a ~ q (the stale sampler), the expected update of a
context's logits contains `-E_q[A] (q - pi)`. In hard contexts E_q[A] < 0, so it pushes pi further
from q along whatever drift the staleness created, and Adam turns that push into full-size steps:
hard contexts lock onto wrong actions. SFC's centered score has expected gradient
`E_q[A e_a] - E_q[A] q`, free of that term, and its KL term pulls pi back toward q.

Both arms go through the package's loss code (`centered_scores` and `sfc_token_loss`; the former calls
`fusedrl.kernels.token_stats` at tp = 1; on CPU outside the Triton interpreter that is the eager
reference path). Run `python -m bench.studies.sfc_staleness` for the curves (bench/results/).
"""

import argparse
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
from fusedrl.kernels import token_stats
from fusedrl.slime_ext.losses.sfc import centered_scores, kl_coefficients, sfc_token_loss

METHODS = ("reinforce", "sfc")
STALENESS = (0, 4, 8)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


@dataclass(frozen=True)
class ToyConfig:
    contexts: int = 64
    actions: int = 100
    easy_logit: float = 4.0  # head start of the correct action in the easy half of the contexts
    batch: int = 1024
    draws: int = 4  # K auxiliary draws per sampled action (SFC)
    steps: int = 150
    lr: float = 0.3
    kl_beta: float = 1.0  # beta0 of SFC's KL pull


class Curves(NamedTuple):
    """Per optimizer step: expected reward of the current policy (mean over contexts of
    pi(correct)), and drift = mean over the batch of log q(a) - log pi(a) (slime's ppo_kl)."""

    reward: list
    drift: list


def run_toy(method: str, staleness: int, seed: int, config: ToyConfig = ToyConfig()) -> Curves:
    """Train one policy with `method` ("reinforce" or "sfc") on rollouts `staleness` updates old."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    gen = torch.Generator().manual_seed(seed)
    correct = torch.randint(config.actions, (config.contexts,), generator=gen)
    logits = _initial_logits(config, correct).requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=config.lr)
    snapshots = [logits.detach().clone()]  # oldest first; the sampler uses snapshots[0]
    curves = Curves([], [])
    for step in range(config.steps):
        sampler_logits, age = snapshots[0], len(snapshots) - 1
        contexts = torch.randint(config.contexts, (config.batch,), generator=gen)
        sampler_probs = torch.softmax(sampler_logits[contexts], dim=-1)
        draws = torch.multinomial(sampler_probs, 1 + config.draws, replacement=True, generator=gen)
        actions = draws[:, 0]
        rewards = (actions == correct[contexts]).float()
        advantages = rewards - rewards.mean()
        loss, logp = _loss(method, logits[contexts], draws, advantages, age, config)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        snapshots = (snapshots + [logits.detach().clone()])[-(staleness + 1) :]
        with torch.no_grad():
            sampler_logp = sampler_probs.gather(1, actions[:, None])[:, 0].log()
            curves.drift.append(float((sampler_logp - logp.detach()).mean()))
            policy = torch.softmax(logits, dim=-1)
            curves.reward.append(float(policy.gather(1, correct[:, None]).mean()))
    return curves


def _initial_logits(config: ToyConfig, correct: torch.Tensor) -> torch.Tensor:
    logits = torch.zeros(config.contexts, config.actions)
    easy = torch.arange(config.contexts) < config.contexts // 2
    logits[easy, correct[easy]] = config.easy_logit
    return logits


def _loss(method, batch_logits, draws, advantages, age, config):
    """Mean per-sample loss and log pi(a). `draws[:, 0]` is the sampled action (sampled first,
    then K more from the same distribution); REINFORCE uses only the sampled action."""
    if method == "reinforce":
        logp = token_stats(batch_logits, draws[:, :1]).logp[:, 0]
        return (-advantages * logp).mean(), logp
    ages = torch.full((draws.shape[0],), age)
    scores = centered_scores(batch_logits, draws)
    loss = sfc_token_loss(scores, advantages, kl_coefficients(ages, config.kl_beta))
    return loss.mean(), scores.logp


def run_grid(seeds, config: ToyConfig = ToyConfig(), progress=None):
    """{(method, staleness): [Curves per seed]} over METHODS x STALENESS; `progress` (a
    `bench.harness.progress.Progress` over the runs, of kind `method`) hears of every finished run."""
    grid = {}
    for method in METHODS:
        for staleness in STALENESS:
            for seed in seeds:
                grid.setdefault((method, staleness), []).append(run_toy(method, staleness, seed, config))
                if progress is not None:
                    progress.finished(f"{method} staleness {staleness} seed {seed}")
    return grid


def plot(grid, path: str) -> None:
    """Seed-averaged reward and drift curves, one line per (method, staleness)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward_ax, drift_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for (method, staleness), runs in grid.items():
        style = "-" if method == "sfc" else "--"
        label = f"{'SFC + KL' if method == 'sfc' else 'REINFORCE'}, {staleness} stale"
        reward = torch.tensor([run.reward for run in runs]).mean(0)
        drift = torch.tensor([run.drift for run in runs]).mean(0)
        reward_ax.plot(reward.numpy(), style, label=label)
        drift_ax.plot(drift.numpy(), style, label=label)
    reward_ax.set(xlabel="optimizer step", ylabel="expected reward", title="reward")
    drift_ax.set(xlabel="optimizer step", ylabel="mean log q(a) - log pi(a)", title="drift (ppo_kl)")
    drift_ax.set_yscale("symlog", linthresh=1e-2)
    reward_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0..N-1)")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "staleness_toy.png"))
    args = parser.parse_args(argv)
    from ..harness.progress import Progress

    seeds = range(args.seeds)
    grid = run_grid(seeds, progress=Progress(method for method in METHODS for _ in STALENESS for _ in seeds))
    for (method, staleness), runs in grid.items():
        finals = ", ".join(f"{run.reward[-1]:.3f}" for run in runs)
        peak_drift = max(max(abs(d) for d in run.drift) for run in runs)
        print(f"{method:9s} staleness {staleness}: final reward [{finals}]  max |drift| {peak_drift:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    plot(grid, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
