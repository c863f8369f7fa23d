"""The SFC recipe (slime_ext/recipes/sfc_qwen3_0.6b_gsm8k.sh) as it launches: run by bash with a
stand-in `ray` command that records the job's command line, whose flags then go through slime's
real argument parser with the package's flags (bench/slime_loop/upstream_slime.py) and the entry point's
startup checks. The recipe is the run the score-function-centering description reports, so the
test pins that run's settings: it cannot drift from them unnoticed."""

import json
import os
import stat
import subprocess

import pytest
from bench_package import import_bench
from distributed import run_on_ranks

import_bench()
from bench.slime_loop import upstream_slime  # noqa: E402

ROOT = upstream_slime.require()
RECIPE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "slime_ext", "recipes", "sfc_qwen3_0.6b_gsm8k.sh")
# Megatron-LM flags of a model script (scripts/models/*.sh in a slime checkout); not slime's parser's.
MODEL_ARGS = "--num-layers 28 --hidden-size 1024"
FAKE_RAY = """#!/usr/bin/env bash
# Stand-in for the ray CLI: `ray start` does nothing; `ray job submit ... -- CMD` records the
# runtime env and CMD (one argument per line) in $RECIPE_OUT.
if [ "$1" = start ]; then exit 0; fi
runtime_env=""
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in --runtime-env-json=*) runtime_env="${1#--runtime-env-json=}";; esac
  shift
done
shift
{ echo "$runtime_env"; printf '%s\\n' "$@"; } > "$RECIPE_OUT"
"""


def launch(tmp_path, **env):
    """(runtime env, job command line) the recipe submits, with a stand-in slime checkout and ray."""
    slime_dir = tmp_path / "slime"
    (slime_dir / "scripts" / "models").mkdir(parents=True)
    (slime_dir / "scripts" / "models" / "qwen3-0.6B.sh").write_text(f"MODEL_ARGS=({MODEL_ARGS})\n")
    os.symlink(os.path.join(ROOT, "train_async.py"), slime_dir / "train_async.py")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(FAKE_RAY)
    (bin_dir / "ray").chmod(stat.S_IRWXU)
    out = tmp_path / "job.txt"
    environment = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLIME_DIR=str(slime_dir), RECIPE_OUT=str(out), **env)
    subprocess.run(["bash", RECIPE], env=environment, check=True)
    runtime_env, *command = out.read_text().splitlines()
    return json.loads(runtime_env), command


def parse_job(rank, world_size, flags):
    """The job's flags through slime's parser with the package's flags, then the entry point's
    checks: (the values the test pins, what slime's parser left to Megatron and SGLang)."""
    upstream_slime.load()
    from fusedrl.slime_ext import train as entry
    from fusedrl.slime_ext.arguments import add_fusedrl_arguments

    args, unknown = upstream_slime.parse_known_args(flags, add_fusedrl_arguments)
    entry.validate(args)
    names = (
        "rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout", "global_batch_size", "loss_type",
        "custom_loss_function_path", "custom_megatron_init_path", "custom_generate_function_path",
        "custom_rollout_log_function_path", "sfc_num_auxiliary_token_samples", "sfc_kl_beta", "loss_aggregation", "loss_aggregation_divisor",
        "calculate_per_token_loss", "rollout_temperature", "rollout_top_p", "rollout_top_k", "entropy_coef",
        "actor_num_gpus_per_node", "rollout_num_gpus", "use_dynamic_batch_size",
    )  # fmt: skip
    return {name: getattr(args, name) for name in names}, unknown


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    runtime_env, command = launch(tmp_path_factory.mktemp("recipe"), TRAINER_GPUS="2", ROLLOUT_GPUS="2")
    values, unknown = run_on_ranks(1, parse_job, command[4:])[0]
    return runtime_env, command, values, unknown


def test_recipe_runs_train_async_through_the_entry_point(job):
    _, command, _, _ = job
    assert command[:3] == ["python3", "-m", "fusedrl.slime_ext.train"]
    assert command[3].endswith("/train_async.py")


def test_recipe_is_the_described_run(job):
    """64 prompts x 4 samples, 16 optimizer steps per rollout, token-sum, beta_0 = 0.3, K = 8, lr
    1e-6, trainer and rollout GPUs apart (TRAINER_GPUS, ROLLOUT_GPUS), untruncated sampling."""
    runtime_env, command, values, _ = job
    assert values == {
        "rollout_batch_size": 64, "n_samples_per_prompt": 4, "num_steps_per_rollout": 16, "global_batch_size": 16,
        "loss_type": "custom_loss", "custom_loss_function_path": "fusedrl.slime_ext.losses.sfc_loss",
        "custom_megatron_init_path": "fusedrl.slime_ext.install",
        "custom_generate_function_path": "fusedrl.slime_ext.rollout.sfc_draws.generate",
        "custom_rollout_log_function_path": "fusedrl.slime_ext.rollout.refusals.log_rollout_data",
        "sfc_num_auxiliary_token_samples": 8, "sfc_kl_beta": 0.3, "loss_aggregation": "constant",
        "loss_aggregation_divisor": 1.0, "calculate_per_token_loss": False, "rollout_temperature": 1.0,
        "rollout_top_p": 1.0, "rollout_top_k": -1, "entropy_coef": 0.0, "actor_num_gpus_per_node": 2,
        "rollout_num_gpus": 2, "use_dynamic_batch_size": True,
    }  # fmt: skip
    assert command[command.index("--lr") + 1] == "1e-6"  # Megatron's flag
    assert runtime_env["env_vars"]["AGENTCORE_SGLANG_TOKEN_SAMPLES"] == "1"


def test_only_megatron_and_sglang_flags_are_left_to_their_parsers(job):
    """Every flag slime's parser (with the package's) does not take is Megatron-LM's or SGLang's
    server flag: none of the package's is dropped."""
    _, _, _, unknown = job
    flags = {token for token in unknown if token.startswith("--")}
    megatron = {
        "--num-layers", "--hidden-size", "--ref-load", "--save", "--save-interval", "--optimizer", "--lr",
        "--lr-decay-style", "--weight-decay", "--adam-beta1", "--adam-beta2", "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size", "--context-parallel-size", "--attention-dropout", "--hidden-dropout",
        "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend",
    }  # fmt: skip
    assert flags <= megatron | {"--sglang-mem-fraction-static"}, flags - megatron
