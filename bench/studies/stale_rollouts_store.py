"""The stale-rollouts study's finished runs, kept in the repository: one compact JSON per run in
bench/studies/stale_rollouts_runs/ (tracked), named by its configuration.

A run's record is what the report needs and no more (a few tens of KB for 640 steps): the run's
configuration (`LoopConfig` as a dict), its wall-clock seconds and how many runs shared the machine
meanwhile (`concurrent`), and per optimizer step the reward of its samples, the drift from the
sampler, the gradient norm, the policy loss, the largest SFC age of its tokens (None but for SFC,
the one method with an age clock), for slime's PPO loss its clip fraction, TIS weight and TIS
clip fraction and its ppo_kl against the old log-probs, for M2PO its masked fraction and mean M2
before and after masking, each rounded to SIGNIFICANT digits; and per push (the first before any
step) the learner's reward (bench/slime_loop/learner_reward.py), in records written since it
exists. The study reads a run back instead of running it again, on any machine where it is
committed; a record whose configuration differs from the one asked for under the same name is
refused, never reused (a configuration field added since a record was written counts at its default).
"""

import json
import subprocess
from dataclasses import asdict, fields
from pathlib import Path

from ..slime_loop.loop import M2PO_METRICS, PPO_METRICS, LoopConfig

SIGNIFICANT = 5  # digits kept per value: far below the seed-to-seed spread of every quantity reported
SERIES = ("reward", "drift", "grad_norm", "pg_loss")


def run_name(config) -> str:
    """The record's file stem: the method (with M2PO's threshold), learning rate, lag, seed and
    geometry, whether it holds the learner's reward, and the weight push where not slime's full one."""
    method = config.method if config.m2po_tau is None else f"{config.method}-tau{config.m2po_tau:g}"
    learner = "-learner" if config.learner_reward else ""
    push = "" if config.weight_sync == "full" else f"-{config.weight_sync}"
    return (
        f"{method}-lr{config.lr:g}-lag{config.lag}-seed{config.seed}-"
        f"{config.steps_per_rollout}spr-{config.samples_per_step}sps-{config.steps}steps{learner}{push}"
    )


def recorded_config(record: dict) -> dict:
    """The record's configuration, a field `LoopConfig` gained after the record was written at its
    default (what the run had), but `learner_reward` by whether the record holds it."""
    defaults = {field.name: field.default for field in fields(LoopConfig)}
    defaults["learner_reward"] = "learner_reward" in record
    return {**{name: defaults[name] for name in defaults.keys() - record["config"].keys()}, **record["config"]}


def _rounded(value):
    return None if value is None else float(f"{value:.{SIGNIFICANT}g}")


def compact(observations: dict) -> dict:
    """The record of a run from the loop's observations (bench/slime_loop/loop.py's `Observations.result`)."""
    steps = observations["steps"]
    kept = SERIES + tuple(key for key in PPO_METRICS + M2PO_METRICS if any(step.get(key) is not None for step in steps))
    series = {key: [_rounded(step.get(key)) for step in steps] for key in kept}
    series["max_age"] = [max(step["ages"]) if step["ages"] else None for step in steps]
    record = {"config": observations["config"], "seconds": round(observations["seconds"]), "series": series}
    if observations.get("learner_rewards"):  # per push, the first before any step
        record["learner_reward"] = [_rounded(push["reward"]) for push in observations["learner_rewards"]]
    if observations.get("concurrent", 1) != 1:
        record["concurrent"] = observations["concurrent"]
    return record


class RunStore:
    """The records in `folder`; `commit`: commit each new record to git as it is written."""

    def __init__(self, folder: Path, commit: bool = False):
        self.folder, self.commit = folder, commit

    def path(self, config) -> Path:
        return self.folder / f"{run_name(config)}.json"

    def saved(self, config):
        """The record of `config`, or None when it has not run."""
        path = self.path(config)
        if not path.exists():
            return None
        record = json.loads(path.read_text())
        if recorded_config(record) != asdict(config):
            raise SystemExit(f"{path} holds another configuration than {asdict(config)}: {record['config']}")
        return record

    def save(self, config, observations: dict, concurrent: int = 1) -> dict:
        """Write (and with `commit`, commit) the record of `config`'s finished run, one of
        `concurrent` runs at once on the machine; the record."""
        record = compact({**observations, "concurrent": concurrent})
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(config)
        path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
        if self.commit:
            message = f"stale_rollouts: the run {path.stem} ({record['seconds'] // 60} min)"
            subprocess.run(["git", "-C", str(path.parent), "add", path.name], check=True)
            subprocess.run(["git", "-C", str(path.parent), "commit", "-q", "-m", message, "--", path.name], check=True)
        return record
