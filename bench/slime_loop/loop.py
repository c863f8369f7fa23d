"""slime's synchronous training loop end to end on CPU, in one process: the SFC workflow as one loop.

`run(config, workdir, engine)` runs slime's own `train.py` (`train(args)`, its loop unchanged:
push v1, then per rollout `rollout_manager.generate` -> `actor_model.async_train` ->
`actor_model.update_weights`) on slime's own objects: `RolloutManager`, `RayTrainGroup`,
`MegatronTrainRayActor` and `SGLangEngine`, built in this process (bench/slime_loop/stand_ins.py
says what stands in for Ray, the GPU and Megatron-LM's training package). On the way every real
function runs: slime's `sglang_rollout.generate_rollout` on its event-loop thread, the package's
SFC rollout wrapper (`fusedrl.slime_ext.rollout.sfc_draws.generate`) around slime's `generate`,
SGLang's real CPU server with the package's plugin answering `top_logprobs_num = K` with the
sampled token plus K draws, the task's reward (`target_task.reward`), GRPO normalisation, slime's
conversion to train data and DP split, `get_batch` with the package's carried inputs,
`forward_only` on the package's log-prob path, `train_one_step` with the package's
before-train-step hook (the age clock), slime's `loss_function` with the package's SFC loss or its
REINFORCE (`--pg-loss-type reinforce` of `fusedrl.slime_ext.losses.policy_loss`) or slime's own
PPO-clip policy loss with its off-policy corrections (`PPO_CORRECTIONS`), megatron-core's
optimizer, `UpdateWeightFromDisk` (the package's push recorder) writing the HF checkpoint, and
SGLang's `/update_weights_from_disk` with the weight version. The Megatron model starts from the
task's tiny Llama initialised with the run's seed (slime's HF load, `--load`), which the first push
gives the server.

Staleness is the experiment's own hook, not slime's (`serve_lagged`): after each push the engine is
given the snapshot `lag` versions older (`--update-weight-disk-keep-files` keeps them), so rollout
tokens are sampled by weights `lag` pushes behind the trainer, and the package's age clock counts
their age in optimizer steps.

What the run saw (`Observations`) comes back as JSON: per optimizer step the reward of its samples,
the drift (SGLang's log-prob of each sampled token minus Megatron's at the step: the losses'
`ppo_kl` for REINFORCE and SFC, `sampler_drift` for slime's PPO loss, whose `ppo_kl` is against
the old log-probs), the gradient norm, the SFC ages of its tokens and, for the PPO arms, what
slime reports of its clip and TIS (pg_clipfrac, tis, tis_clipfrac); per rollout the weight versions
that sampled it and its draws; per push the version served. Each run needs a fresh process
(slime's and megatron-core's state is per process):

    python -m bench.slime_loop.loop CONFIG.json OUT.json [--engine HOST:PORT]

from the repository root (`loop_environment`); without --engine the run starts its
own SGLang server. `run_in_subprocess` does both.
"""

import argparse
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

from . import learner_reward, sglang_server, stand_ins, target_task, upstream_slime

ROOT = Path(__file__).resolve().parents[2]  # the repository, whose `bench` package the loop process imports
# slime's PPO-clip loss (--loss-type policy_loss) as slime users run it on stale rollouts, by its
# off-policy correction against the sampler's log-probs: none, TIS (--use-tis --tis-clip 2, the
# trainer's old log-probs over the sampler's, clipped at 2) or icepop (slime's icepop_function:
# ratios outside 0.5-2 weigh 0). The clip band is slime's example scripts' clip-higher 0.2 / 0.28.
PPO_CLIP = ["--eps-clip", "0.2", "--eps-clip-high", "0.28"]
PPO_CORRECTIONS = {
    "ppo": [],
    "ppo_tis": ["--use-tis", "--tis-clip", "2"],
    "icepop": ["--use-tis", "--tis-clip", "2", "--tis-clip-low", "0.5",
               "--custom-tis-function-path", "slime.backends.megatron_utils.loss.icepop_function"],
}  # fmt: skip
# The trust-region methods, each at a threshold (LoopConfig.m2po_tau): M2PO on the package's policy
# loss, SFC + KL with the same trust region, AReaL's variant through slime's own PPO loss + TIS.
TRUST_REGION_METHODS = ("m2po", "sfc_m2", "areal_m2")
METHODS = ("reinforce", "sfc", *PPO_CORRECTIONS, *TRUST_REGION_METHODS)
# How the trainer's weights reach the engine: slime's full-checkpoint disk push (the study's), its
# delta push (--update-weight-mode delta) or the full push with the train actors released after
# every push and started anew (--release-train).
WEIGHT_SYNCS = ("full", "delta", "release_train")
HOST = sglang_server.HOST
ENGINE_START_TIMEOUT_S = 1200.0  # SGLang's start-up has taken over 7 minutes on a busy 2-core machine


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """One run: the method, its learning rate, the staleness (lag, in pushes) and the geometry."""

    method: str
    lr: float = 3e-3
    lag: int = 0
    rollouts: int = 40  # the described run: 40 rollouts of 16 optimizer steps
    steps_per_rollout: int = 16
    samples_per_step: int = 32
    samples_per_prompt: int = 8
    seed: int = 0
    num_draws: int = 4  # K
    kl_beta: float = 0.3  # beta0
    max_tokens_per_step: int = 2048
    m2po_tau: Optional[float] = None  # the trust region's threshold: TRUST_REGION_METHODS' alone
    learner_reward: bool = False  # the learner's reward at every push (`record_learner_reward`)
    weight_sync: str = "full"  # one of WEIGHT_SYNCS

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if (self.method in TRUST_REGION_METHODS) != (self.m2po_tau is not None):
            raise ValueError(f"m2po_tau goes with the methods {TRUST_REGION_METHODS} and no other, got {self.m2po_tau!r} for {self.method!r}")
        if self.lag < 0:
            raise ValueError(f"lag must be >= 0, got {self.lag}")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNCS}, got {self.weight_sync!r}")
        if self.weight_sync == "delta" and (self.lag or self.learner_reward):
            raise ValueError(
                f"the lag and the learner's reward hook slime's full-checkpoint reload, which delta pushes do not "
                f"use: weight_sync 'delta' takes lag 0 and no learner's reward, got lag {self.lag}, "
                f"learner_reward {self.learner_reward}"
            )
        if self.samples_per_step % self.samples_per_prompt:
            raise ValueError(
                f"samples_per_step ({self.samples_per_step}) must be a multiple of samples_per_prompt "
                f"({self.samples_per_prompt})"
            )

    @property
    def steps(self) -> int:
        return self.rollouts * self.steps_per_rollout


class Files(NamedTuple):
    model: Path
    prompts: Path
    weights: Path  # --update-weight-disk-dir
    local_weights: Path  # --update-weight-local-checkpoint-dir (delta pushes)
    checkpoints: Path  # --save (--release-train)


def task_files(task_dir: Path, workdir: Path, seed: int = 0) -> Files:
    """The task's prompts and the model initialised with `seed` in `task_dir` (each written there
    once), and the run's weight folder in `workdir`. A server started on one seed's model serves
    any run: the run's first push replaces the server's weights by its own before it samples."""
    model = task_dir / f"model_seed{seed}"
    if not (model / "config.json").exists():
        target_task.write_model(model, seed)
    prompts = task_dir / "prompts.jsonl"
    if not prompts.exists():
        target_task.write_prompts(prompts)
    return Files(model, prompts, workdir / "weights", workdir / "local_weights", workdir / "checkpoints")


SYNC_FLAGS = {
    "full": lambda files: [],
    "delta": lambda files: ["--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", str(files.local_weights)],
    "release_train": lambda files: ["--release-train", "--save", str(files.checkpoints)],
}  # fmt: skip


def slime_argv(config: LoopConfig, files: Files) -> list:
    """slime's command line for the run (the package's flags among slime's, as its entry point takes them)."""
    rollout_prompts = config.samples_per_step * config.steps_per_rollout // config.samples_per_prompt
    argv = [
        "--hf-checkpoint", str(files.model), "--load", str(files.model),
        "--prompt-data", str(files.prompts), "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle",
        "--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout",
        "--custom-rm-path", f"{target_task.__name__}.reward",
        "--num-rollout", str(config.rollouts), "--rollout-batch-size", str(rollout_prompts),
        "--n-samples-per-prompt", str(config.samples_per_prompt),
        "--rollout-max-response-len", str(target_task.ANSWER_TOKENS), "--rollout-temperature", "1.0",
        "--num-steps-per-rollout", str(config.steps_per_rollout), "--global-batch-size", str(config.samples_per_step),
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(config.max_tokens_per_step),
        "--advantage-estimator", "grpo", "--lr", str(config.lr), "--seed", str(config.seed),
        "--rollout-seed", str(config.seed), "--entropy-coef", "0",
        "--update-weight-transport", "disk", "--update-weight-disk-dir", str(files.weights),
        "--update-weight-disk-keep-files", *SYNC_FLAGS[config.weight_sync](files),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1",
    ]  # fmt: skip
    if config.method in ("sfc", "sfc_m2"):
        return argv + [
            "--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.sfc_loss",
            "--sfc-num-auxiliary-token-samples", str(config.num_draws), "--sfc-kl-beta", str(config.kl_beta),
            "--sfc-loss-agg-mode", "token-sum",
        ] + (["--sfc-m2-tau", str(config.m2po_tau)] if config.method == "sfc_m2" else [])  # fmt: skip
    if config.method == "areal_m2":
        # slime's own PPO loss with AReaL's M2 trust region as its TIS function (slime_ext/m2_tis.py)
        return argv + [
            "--loss-type", "policy_loss", *PPO_CLIP, *PPO_CORRECTIONS["ppo_tis"],
            "--custom-tis-function-path", "fusedrl.slime_ext.m2_tis.m2_trust_region_tis",
            "--fusedrl-m2-tis-tau", str(config.m2po_tau),
        ]  # fmt: skip
    if config.method == "m2po":
        # the package's policy loss with M2PO's trust region in the paper's form: the ratio to the
        # sampler (the rollout log-probs), no clip, the token mean over the step's tokens
        return argv + [
            "--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.policy_loss",
            "--fusedrl-m2po-tau", str(config.m2po_tau), "--loss-aggregation", "token_mean",
            "--use-rollout-logprobs",  # ppo_kl, its clip fraction and the drift against the sampler, as for REINFORCE
        ]  # fmt: skip
    if config.method in PPO_CORRECTIONS:
        # slime's own loss and aggregation (its default reducer: the mean over each sample's tokens,
        # summed over samples); old log-probs recomputed by the trainer before each rollout's first step
        return argv + ["--loss-type", "policy_loss", *PPO_CLIP, *PPO_CORRECTIONS[config.method]]
    # Ratio-free REINFORCE, token-sum; the rollout log-probs as the old ones, so that ppo_kl is the
    # drift from the sampler (REINFORCE reads no old log-prob otherwise).
    return argv + [
        "--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.policy_loss",
        "--pg-loss-type", "reinforce", "--loss-aggregation", "constant", "--loss-aggregation-divisor", "1",
        "--use-rollout-logprobs",
    ]  # fmt: skip


def build_args(config: LoopConfig, files: Files):
    """slime's args for the run: slime's parse (with its SGLang half) and the package's startup
    checks, Megatron-LM's flags from the model (`stand_ins.megatron_args`)."""
    from fusedrl.slime_ext import train as entry
    from fusedrl.slime_ext.arguments import add_fusedrl_arguments
    from transformers import AutoConfig

    args, unknown = upstream_slime.parse_known_args(slime_argv(config, files), add_fusedrl_arguments, with_sglang=True)
    if unknown:
        raise ValueError(f"slime's parser left flags unparsed: {unknown}")
    entry.validate(args)
    for name, value in stand_ins.megatron_args(AutoConfig.from_pretrained(files.model)).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def serve_launch_weights(engine: tuple, model: Path) -> None:
    """Have the engine at `engine` serve `model` as SGLang's `"default"` weights, as an engine
    slime launched on --hf-checkpoint `model` would: a delta run's first call only captures that
    base (no push), and a shared server holds the last run's weights."""
    status, body = sglang_server.post(
        engine[1], "/update_weights_from_disk", {"model_path": str(model), "weight_version": "default"}
    )
    if status != 200 or not (isinstance(body, dict) and body.get("success")):
        raise RuntimeError(f"the engine at {engine[0]}:{engine[1]} did not load {model}: {status} {body}")


def serve_lagged(lag: int, served: list):
    """The experiment's staleness (no part of slime): `RayTrainGroup._reload_rollout_weights_from_disk`
    after the push of version v reloads the engine with the kept snapshot of version max(v - lag, 1)
    and reports that version, and drops the snapshots older than it; `served` gets (pushed, served)
    per push."""
    from slime.ray.actor_group import RayTrainGroup

    reload = RayTrainGroup._reload_rollout_weights_from_disk

    def reload_lagged(group, disk_weight_dir, weight_version):
        version = max(int(weight_version) - lag, 1)
        served.append((int(weight_version), version))
        folder = Path(disk_weight_dir).parent
        result = reload(group, folder / f"weight_v{version:06d}", str(version))
        for old in range(max(version - lag - 1, 1), version):  # never served again
            shutil.rmtree(folder / f"weight_v{old:06d}", ignore_errors=True)
        return result

    RayTrainGroup._reload_rollout_weights_from_disk = reload_lagged


def record_learner_reward(config: "LoopConfig", files: "Files", rewards: list) -> None:
    """At every push, before the engine is given its weights, the learner's reward of the weights
    just pushed (`learner_reward`: the trainer's after the rollout's steps, read from the HF
    checkpoint the push wrote); `rewards` gets (pushed version, reward) per push."""
    from slime.ray.actor_group import RayTrainGroup

    reload = RayTrainGroup._reload_rollout_weights_from_disk

    def reload_after_evaluation(group, disk_weight_dir, weight_version):
        reward = learner_reward.learner_reward(
            files.model, disk_weight_dir, float(group.args.rollout_temperature), config.seed, int(weight_version)
        )
        rewards.append((int(weight_version), reward))
        return reload(group, disk_weight_dir, weight_version)

    RayTrainGroup._reload_rollout_weights_from_disk = reload_after_evaluation


PPO_METRICS = ("pg_clipfrac", "tis", "tis_clipfrac", "ppo_kl")  # what slime's PPO loss reports, kept per step
M2PO_METRICS = ("m2po_masked_frac", "m2po_m2_before", "m2po_m2_after")  # what M2PO's trust region reports


def record_sampler_drift() -> None:
    """slime's policy loss reports `sampler_drift` beside its metrics: the mean over tokens (its
    reducer, as for ppo_kl) of the sampler's log-prob minus the trainer's at the step. Its own
    ppo_kl is against the old log-probs recomputed before the rollout's first step, so the drift
    from the sampler is (rollout - old) + ppo_kl, by the reducer's linearity."""
    import torch
    from slime.backends.megatron_utils import loss

    policy_loss_function = loss.policy_loss_function

    def with_sampler_drift(args, batch, logits, sum_of_sample_mean):
        result, metrics = policy_loss_function(args, batch, logits, sum_of_sample_mean)
        if batch.get("rollout_log_probs") and batch.get("log_probs"):
            gap = torch.cat(batch["rollout_log_probs"]) - torch.cat(batch["log_probs"])
            metrics["sampler_drift"] = (sum_of_sample_mean(gap) + metrics["ppo_kl"]).detach()
        return result, metrics

    loss.policy_loss_function = with_sampler_drift


class Observations:
    """What the run saw, recorded where slime hands it over (each recorder returns what it wraps
    returns, unchanged)."""

    def __init__(self, config: LoopConfig):
        self.config = config
        self.train_logs = []  # slime's per-step train log (train/pg_loss, train/ppo_kl, train/grad_norm, ...)
        self.step_rewards = []  # per step, the mean reward of its samples
        self.rollouts = []  # per rollout: versions that sampled it, its draws
        self.ages = {}  # step -> sorted SFC ages of its tokens
        self.forward_drift = []  # per rollout: max over tokens of |Megatron - SGLang| / max(1, |SGLang|) log-prob, before its first step
        self.pushes = []  # (pushed, served) per push, from `serve_lagged`
        self.learner_rewards = []  # (pushed, reward) per push, from `record_learner_reward` (when on)
        self.train_actors = 0  # train actors started (one, or one more per rollout under --release-train)
        self.push_steps = {}  # version -> steps completed, as SFC's age clock recorded each push
        self.started = time.perf_counter()

    def install(self) -> None:
        from fusedrl.slime_ext import age
        from slime.backends.megatron_utils import actor
        from slime.backends.megatron_utils.actor import MegatronTrainRayActor
        from slime.observability import logging_utils

        log = logging_utils.log

        def recording_log(args, metrics, step_key):
            if step_key == "train/step":
                self.train_logs.append(dict(metrics))
            return log(args, metrics, step_key)

        logging_utils.log = recording_log
        get_rollout_data = MegatronTrainRayActor._get_rollout_data

        def recording_rollout_data(actor_self, rollout_data_ref):
            rollout_data = get_rollout_data(actor_self, rollout_data_ref)
            self._rollout(rollout_data)
            return rollout_data

        MegatronTrainRayActor._get_rollout_data = recording_rollout_data
        init = MegatronTrainRayActor.init

        def counting_init(actor_self, *args, **kwargs):
            self.train_actors += 1
            return init(actor_self, *args, **kwargs)

        MegatronTrainRayActor.init = counting_init
        compute_advantages = actor.compute_advantages_and_returns

        def recording_drift(args, rollout_data):
            if "log_probs" in rollout_data and "rollout_log_probs" in rollout_data:
                pairs = zip(rollout_data["log_probs"], rollout_data["rollout_log_probs"])
                self.forward_drift.append(max(float(((a - b).abs() / b.abs().clamp(min=1)).max()) for a, b in pairs))
            return compute_advantages(args, rollout_data)

        actor.compute_advantages_and_returns = recording_drift
        record_sampler_drift()
        ages = age.CLOCK.ages

        def recording_ages(versions):
            result = ages(versions)
            step = age.CLOCK.current_step()
            self.ages[step] = sorted(set(self.ages.get(step, [])) | set(result.tolist()))
            return result

        age.CLOCK.ages = recording_ages
        record_push = age.CLOCK.record_push

        def recording_push(version):
            record_push(version)
            self.push_steps[int(version)] = age.CLOCK.steps_started

        age.CLOCK.record_push = recording_push

    def _rollout(self, rollout_data) -> None:
        from fusedrl.slime_ext.carry import SFC_DRAWS_KEY, SFC_VERSIONS_KEY

        rewards = [rollout_data["raw_reward"][i] for i in rollout_data["partition"]]
        first = 0
        for count in rollout_data["num_microbatches"]:
            step = [i for mb in rollout_data["micro_batch_indices"][first : first + count] for i in mb]
            self.step_rewards.append(sum(rewards[i] for i in step) / len(step))
            first += count
        carried = rollout_data.get("multimodal_train_inputs") or [None] * len(rewards)
        draws = [inputs[SFC_DRAWS_KEY] for inputs in carried if inputs and SFC_DRAWS_KEY in inputs]
        versions = [inputs[SFC_VERSIONS_KEY] for inputs in carried if inputs and SFC_VERSIONS_KEY in inputs]
        self.rollouts.append(
            {
                "samples": len(rewards),
                "response_lengths": sorted(set(rollout_data["response_lengths"])),
                "trained_tokens": int(sum(int(mask.sum()) for mask in rollout_data["loss_masks"])),
                "samples_with_draws": sum(
                    tuple(d.shape) == (n, self.config.num_draws) for d, n in zip(draws, rollout_data["response_lengths"])
                ),
                "draws_differ_from_sampled": sum(
                    int((d != t[len(t) - n :, None].to(d.device)).any())
                    for d, t, n in zip(draws, rollout_data["tokens"], rollout_data["response_lengths"])
                ),
                "versions": sorted({int(v) for tensor in versions for v in tensor.tolist()}),
                "seconds": time.perf_counter() - self.started,
            }
        )

    def result(self) -> dict:
        steps = []
        ppo = self.config.method in (*PPO_CORRECTIONS, "areal_m2")
        for step, log in enumerate(self.train_logs):
            steps.append(
                {
                    "step": step,
                    "rollout": step // self.config.steps_per_rollout,
                    "reward": self.step_rewards[step],
                    "drift": log.get("train/sampler_drift" if ppo else "train/ppo_kl"),
                    "grad_norm": log.get("train/grad_norm"),
                    "pg_loss": log.get("train/pg_loss"),
                    "ages": self.ages.get(step),
                    **({key: log.get(f"train/{key}") for key in PPO_METRICS} if ppo else {}),
                    **({key: log.get(f"train/{key}") for key in M2PO_METRICS} if self.config.method in TRUST_REGION_METHODS else {}),
                }
            )
        from fusedrl.kernels import _dispatch

        return {
            "config": dataclasses.asdict(self.config),
            "steps": steps,
            "rollouts": self.rollouts,
            "forward_drift": self.forward_drift,
            "pushes": [{"pushed": p, "served": s} for p, s in self.pushes],
            "learner_rewards": [{"pushed": p, "reward": r} for p, r in self.learner_rewards],
            "push_steps": {str(v): n for v, n in sorted(self.push_steps.items())},
            "train_actors": self.train_actors,
            "kernel_paths": sorted([op, path] for op, path in _dispatch._LOGGED_PATHS),
            "seconds": time.perf_counter() - self.started,
        }


def pinned(command: list, cpu: Optional[int]) -> list:
    """`command` run on core `cpu` alone with one compute thread (None: unchanged): a run that
    shares the machine with others keeps to its own core."""
    return command if cpu is None else ["taskset", "-c", str(cpu), *command]


def pinned_env(cpu: Optional[int]) -> dict:
    """The environment changes that go with `pinned`: one OpenMP thread on a pinned core."""
    return {} if cpu is None else {"OMP_NUM_THREADS": "1"}


def start_engine(files: Files, workdir: Path, seed: int = sglang_server.SEED, cpu: Optional[int] = None) -> sglang_server.Server:
    """SGLang's real CPU server with the package's plugin on the task's model (not waited for):
    bench/slime_loop/sglang_server.py's (which sleeps when idle, leaving the cores to the trainer
    between rollouts), without its warm-up request; on core `cpu` alone when given (`pinned`)."""
    stub = sglang_server.libcuda_stub(workdir / "libcuda")
    extra = ["--skip-server-warmup", "--random-seed", str(seed)]
    launcher = pinned([sys.executable, "-m", "sglang.launch_server"], cpu)
    env = {**sglang_server.PLUGIN_ENV, **pinned_env(cpu)}
    return sglang_server.Server(files.model, stub, workdir / "server.log", env=env, extra_args=extra, launcher=launcher)


def run(config: LoopConfig, workdir: Path, engine: Optional[tuple] = None, task_dir: Optional[Path] = None) -> dict:
    """Run slime's train.py on the task with `config` in `workdir`; the observations. `engine`:
    (host, port) of a running server on the model in `task_dir` (`task_files`), else one is
    started for the run and stopped after it; `task_dir` defaults to `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    files = task_files(task_dir or workdir, workdir, config.seed)
    server = None if engine is not None else start_engine(files, workdir, config.seed)
    try:
        root = upstream_slime.load()
        stand_ins.run_on_cpu()
        from fusedrl.slime_ext.train import load_script

        args = build_args(config, files)
        script = load_script(os.path.join(root, "train.py"))
        if server is not None:
            engine = (HOST, server.wait_ready(ENGINE_START_TIMEOUT_S).port)
        if config.weight_sync == "delta":
            serve_launch_weights(engine, files.model)
        script.create_placement_groups = stand_ins.create_placement_groups
        script.create_rollout_manager = stand_ins.rollout_manager(*engine)
        observations = Observations(config)
        observations.install()
        serve_lagged(config.lag, observations.pushes)
        if config.learner_reward:
            record_learner_reward(config, files, observations.learner_rewards)
        # slime's clear_memory() runs gc.collect() a few times per rollout; the start-up's objects
        # (SGLang's, megatron-core's and slime's modules) would make each take most of a second.
        gc.freeze()
        script.train(args)
        return observations.result()
    finally:
        if server is not None:
            server.stop()


def loop_environment(**overrides) -> dict:
    """The environment of a loop process: this one's, the repository on PYTHONPATH (for
    `bench.slime_loop` and the task's reward, which slime imports by name), `overrides` applied (a
    None value removes the variable)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_files(config: LoopConfig, workdir: Path) -> tuple:
    """(config, observations, log) paths of a run in its own process, the config written."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path, out_path, log_path = workdir / "config.json", workdir / "observations.json", workdir / "loop.log"
    config_path.write_text(json.dumps(dataclasses.asdict(config)))
    return config_path, out_path, log_path


def observations(returncode: int, out_path: Path, log_path: Path) -> dict:
    """A finished run's observations; a failed one raises with its log's tail."""
    if returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-60:])
        raise RuntimeError(f"the loop exited with {returncode}; log tail ({log_path}):\n{tail}")
    return json.loads(out_path.read_text())


def run_in_subprocess(
    config: LoopConfig, workdir: Path, engine: Optional[tuple] = None, task_dir: Optional[Path] = None,
    timeout: Optional[float] = None, cpu: Optional[int] = None, **env,
) -> dict:  # fmt: skip
    """`run` in a fresh process (its output in workdir/loop.log), on core `cpu` alone when given
    (`pinned`; a server it starts inherits the core); its observations. `env`: changes to the
    process's environment (`loop_environment`). Fails with the log's tail. Several runs in one
    environment: bench/slime_loop/fork_server.py imports once for all of them."""
    config_path, out_path, log_path = run_files(config, workdir)
    command = pinned([sys.executable, "-m", __spec__.name, str(config_path), str(out_path)], cpu)
    if engine is not None:
        command += ["--engine", f"{engine[0]}:{engine[1]}"]
    if task_dir is not None:
        command += ["--task-dir", str(task_dir)]
    with open(log_path, "wb") as log:
        environment = loop_environment(**pinned_env(cpu), **env)
        completed = subprocess.run(command, env=environment, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    return observations(completed.returncode, out_path, log_path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="JSON of a LoopConfig")
    parser.add_argument("out", type=Path, help="where the observations go (JSON)")
    parser.add_argument("--engine", help="HOST:PORT of a running SGLang server on the model in --task-dir")
    parser.add_argument("--task-dir", type=Path, help="where the task's model and prompts are (default: OUT's folder)")
    options = parser.parse_args(argv)
    config = LoopConfig(**json.loads(options.config.read_text()))
    engine = None
    if options.engine:
        host, port = options.engine.rsplit(":", 1)
        engine = (host, int(port))
    result = run(config, options.out.parent, engine, options.task_dir)
    options.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
