"""slime's own features the package meets, checked at startup against the package's.

Newer slime defines these flags itself; each is read with slime's default, so a slime without the
flag passes untouched. A refusal is a ValueError naming slime's flag, the package's flag or hook
it cannot run with, and the way out:

- `--log-probs-backend triton`: slime's output layer then returns `[1, T, 2]` (log-prob,
  entropy) per packed row in place of logits, which the package's log-prob path (the init hook's
  patch, on unless --fusedrl-keep-slime-log-probs) and its fused LM head cannot read.
- `--use-score-centering`: slime's policy loss reads the response logits a second time
  (`get_score_centering_terms`, which the package does not patch), so under
  --fusedrl-fused-lm-head it would read hidden states as logits; the package's losses do not
  implement it; the package's pg_loss reducer (--loss-aggregation prompt_mean or constant on
  slime's policy loss) is a custom reducer, which slime's score centering refuses; and its
  `top_logprobs_num = k` requests would be answered by the package's SGLang plugin with random
  draws instead of the sampler's top-k head when AGENTCORE_SGLANG_TOKEN_SAMPLES=1 is in the
  job's environment (a Ray job's `--runtime-env-json` reaches the driver, the train actors and
  the SGLang engines alike), so that is refused before the first request is sent.
- `--rollout-temperature` outside the temperatures the kernels answer
  (`fusedrl.kernels.TEMPERATURE_RANGE`, 1e-6 to 1e6), whenever the package computes log-probs
  (its log-prob patch, losses or fused LM head): every micro-batch would be refused.
- `--flush-cache-interval` other than 1: weights are pushed while requests are in flight, so one
  /generate answer can span two weight versions yet reports one, and the SFC loss's token ages
  would be wrong.
"""

import os

from . import check_rollout_temperature, custom_loss_is
from .aggregation import REDUCER_PATH
from .lm_head import CUSTOM_LOSS_PATHS, FLAG as LM_HEAD_FLAG, enabled as lm_head_enabled
from .log_probs import FLAG as KEEP_FLAG, enabled as keeps_slime_log_probs
from .sfc import LOSS_PATHS as SFC_LOSS_PATHS

INIT_HOOK = "--custom-megatron-init-path fusedrl.slime_ext.install"


def validate_args(args, environ=os.environ) -> None:
    """Startup checks of slime's own features against the package's; ValueError naming both."""
    _check_log_probs_backend(args)
    _check_rollout_temperature(args)
    _check_score_centering(args, environ)
    _check_flush_cache_interval(args)


def _check_log_probs_backend(args) -> None:
    backend = getattr(args, "log_probs_backend", "torch")
    if backend != "triton":
        return
    if lm_head_enabled(args):
        raise ValueError(
            f"--log-probs-backend triton and {LM_HEAD_FLAG} both replace the output layer's step: give one of them "
            f"(--log-probs-backend torch keeps {LM_HEAD_FLAG})"
        )
    if not keeps_slime_log_probs(args):
        raise ValueError(
            "--log-probs-backend triton hands slime's log-prob path [1, T, 2] (log-prob, entropy) pairs instead of "
            f"logits, which the package's fused log-prob path ({INIT_HOOK}) cannot read: use --log-probs-backend "
            f"torch (the package's path keeps no [T, V] buffer either), or keep slime's path with {KEEP_FLAG} "
            "(through python -m fusedrl.slime_ext.train)"
        )


def _check_rollout_temperature(args) -> None:
    if not keeps_slime_log_probs(args) or lm_head_enabled(args) or custom_loss_is(args, CUSTOM_LOSS_PATHS):
        check_rollout_temperature(args, f"on the package's log-prob path ({KEEP_FLAG} keeps slime's own)")


def _check_score_centering(args, environ) -> None:
    if not getattr(args, "use_score_centering", False):
        return
    if lm_head_enabled(args):
        raise ValueError(
            f"--use-score-centering reads the response logits a second time (slime's get_score_centering_terms), "
            f"which under {LM_HEAD_FLAG} are the output layer's hidden states: drop {LM_HEAD_FLAG} (the init "
            "hook still puts slime's log-prob path on the fused kernel) or --use-score-centering"
        )
    if custom_loss_is(args, CUSTOM_LOSS_PATHS):
        raise ValueError(
            f"--use-score-centering is slime's policy-loss feature; --custom-loss-function-path "
            f"{args.custom_loss_function_path} does not implement it: use --loss-type policy_loss, or drop "
            "--use-score-centering"
        )
    if getattr(args, "custom_pg_loss_reducer_function_path", None) == REDUCER_PATH:
        mode = getattr(args, "loss_aggregation", None)
        given = f"--loss-aggregation {mode}" if mode else f"--custom-pg-loss-reducer-function-path {REDUCER_PATH}"
        raise ValueError(
            f"{given} on slime's policy loss runs through the package's pg_loss reducer, a custom reducer, which "
            "slime's --use-score-centering does not support: use --loss-aggregation sample_mean or token_mean, or "
            "drop --use-score-centering"
        )
    from ...sglang_plugin.constraints import ENV_VAR

    if environ.get(ENV_VAR) == "1":
        raise ValueError(
            f"--use-score-centering asks the SGLang engines for top_logprobs_num = "
            f"{getattr(args, 'score_centering_top_k', '--score-centering-top-k')} top tokens, but {ENV_VAR}=1 is "
            "in this job's environment, so the package's SGLang plugin answers with random draws from the "
            f"sampling distribution instead of the top-k head: unset {ENV_VAR} for this job (only "
            f"{SFC_LOSS_PATHS[0]} needs the draws), or drop --use-score-centering"
        )


def _check_flush_cache_interval(args) -> None:
    interval = getattr(args, "flush_cache_interval", 1)
    if interval != 1 and custom_loss_is(args, SFC_LOSS_PATHS):
        raise ValueError(
            f"--flush-cache-interval {interval} pushes weights while requests are in flight, so one /generate "
            "answer can span two weight versions but reports one, and --custom-loss-function-path "
            f"{args.custom_loss_function_path} would train on wrong token ages: use --flush-cache-interval 1 "
            "(slime's default) with the SFC loss"
        )
