"""fusedrl inside slime's real training data path, on 4 spawned gloo workers with megatron-core's
parallel_state at tp = 1, 2 x cp = 1, 2 (dp = 4 / (tp * cp)), slime from FUSEDRL_SLIME_SRC.

Every step is slime's code: the rollout manager's rollout call, sample-to-train-data conversion
and DP split (`RolloutManager`), the train actor's fetch (`MegatronTrainRayActor._get_rollout_data`:
fp32 `rollout_mask_sums`, CP-sliced rollout log-probs), `compute_advantages_and_returns`,
`DataIterator`, `get_batch` and `loss_function` with its dispatch. Only the model is the test's: a
bigram model, logits = rows of a weight matrix E picked by the input tokens (tensor-parallel: each
rank holds a column block of E), so its gradient sums every micro-batch's logits gradient.

Truth: the same path through slime's own policy loss, its vocab-parallel log-prob function
replaced by a float64 one (fusedrl's float64 eager reference: slime's own computes in float32
whatever its input). Next to it, slime's eager float32 path, the yardstick; then fusedrl: slime's
policy loss after `fusedrl.slime_ext.install` (the fused log-prob path) and the configured fusedrl
loss. Losses, metrics and E's gradient must match the truth to 1e-5 relative."""

import copy
import tempfile
from typing import List, NamedTuple, Optional

import pytest
import torch
from bench_package import import_bench
from distributed import run_on_ranks
from numerics import FLOOR, rel_err
from slime_float64 import Float64LogProbs

import_bench()
from bench.slime_loop import upstream_slime  # noqa: E402

upstream_slime.require()

VOCAB = 74  # 37 columns per rank at tp 2: odd, and no multiple of a kernel block
GROUP_SIZE = 2  # samples per prompt
NUM_PROMPTS = 4
TOLERANCE = 1e-5
# Metrics that are means of differences of near-equal log-probs (old minus new, rollout minus new):
# their rounding is that of the log-probs, about 1 in size here, not of their small difference, so
# their relative error takes the log-probs' size as its floor. Every other value is truly relative.
LOG_PROB_DIFFERENCES = {"ppo_kl": 1.0, "train_rollout_logprob_abs_diff": 1.0}
# slime's forward_step (backends/megatron_utils/model.py) asks get_batch for these keys.
FORWARD_KEYS = [
    "tokens", "multimodal_train_inputs", "packed_seq_params", "total_lengths", "response_lengths", "loss_masks",
    "log_probs", "ref_log_probs", "values", "advantages", "returns", "rollout_log_probs", "teacher_log_probs",
    "rollout_mask_sums",
]  # fmt: skip
BASE_ARGV = [
    "--rollout-batch-size", str(NUM_PROMPTS), "--n-samples-per-prompt", str(GROUP_SIZE), "--num-rollout", "1",
    "--global-batch-size", str(NUM_PROMPTS * GROUP_SIZE), "--micro-batch-size", "2",
    "--rollout-function-path", "test_upstream_slime_train.rollout", "--rollout-temperature", "0.8",
    "--data-pad-size-multiplier", "4",
]  # fmt: skip
# PPO with asymmetric and dual clip, the entropy bonus and a KL loss to the reference.
PPO_ARGV = [
    "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--eps-clip-c", "3", "--entropy-coef", "0.01",
    "--use-kl-loss", "--kl-loss-type", "low_var_kl", "--kl-loss-coef", "0.1", "--ref-load", tempfile.gettempdir(),
]  # fmt: skip
CUSTOM_LOSS = ["--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.policy_loss"]


def bigram_weights(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def make_samples(seed: int):
    """slime Samples, GROUP_SIZE per prompt (sharing the prompt tokens): uneven prompt and response
    lengths (one single-token response), partly masked responses, one fully masked sample, one
    removed sample, each sample its own rollout."""
    from slime.utils.types import Sample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for prompt in range(NUM_PROMPTS):
        prompt_tokens = torch.randint(1, VOCAB, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen)
        for member in range(GROUP_SIZE):
            i = len(samples)
            response = 1 if i == 3 else int(torch.randint(2, 10, (1,), generator=gen))
            mask = (torch.rand(response, generator=gen) > 0.25).int()
            if i == 2:
                mask.zero_()
            tokens = torch.cat([prompt_tokens, torch.randint(0, VOCAB, (response,), generator=gen)])
            samples.append(
                Sample(
                    group_index=prompt,
                    index=i,
                    rollout_id=i,
                    tokens=tokens.tolist(),
                    response_length=response,
                    loss_mask=mask.tolist(),
                    reward=float(torch.rand(1, generator=gen)),
                    rollout_log_probs=(-torch.rand(response, generator=gen) * 3).tolist(),
                    remove_sample=i == 5,
                    status=Sample.Status.TRUNCATED if i == 6 else Sample.Status.COMPLETED,
                )
            )
    return samples


def rollout(args, rollout_id, data_source, evaluation=False):
    """slime rollout function (--rollout-function-path): the samples grouped per prompt."""
    samples = make_samples(args.seed + rollout_id)
    return [samples[i : i + GROUP_SIZE] for i in range(0, len(samples), GROUP_SIZE)]


def group_mask_totals(args):
    """Per sample (rollout order), the loss-mask total of its prompt group: prompt_mean's D_g."""
    samples = make_samples(args.seed)
    totals = {}
    for s in samples:
        totals[s.group_index] = totals.get(s.group_index, 0) + (0 if s.remove_sample else sum(s.loss_mask))
    return [float(totals[s.group_index]) for s in samples]


# ----------------------------------------------------------------------------- one rank


def train_data(args, dp_size: int, cp_size: int):
    """This rank's rollout_data, through slime's rollout manager and train actor."""
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.ray.rollout import RolloutManager
    from slime.utils.misc import load_function

    manager = object.__new__(RolloutManager)  # the Ray actor's state, without its servers
    manager.args, manager.data_source = args, None
    manager.generate_rollout = load_function(args.rollout_function_path)
    manager.custom_reward_post_process_func = manager.custom_convert_samples_to_train_data_func = None
    manager.set_train_parallel_config(
        {"dp_size": dp_size, "cp_size": cp_size, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    )
    samples, _ = manager._get_rollout_data(rollout_id=0)
    refs = manager._split_train_data_by_dp(manager._convert_samples_to_train_data(samples))
    actor = object.__new__(MegatronTrainRayActor)
    actor.args = args
    return actor._get_rollout_data(refs)


def add_policy_log_probs(args, rollout_data, weights):
    """The old and reference log-probs slime's forward-only passes would add: the model's own
    log-probs (float64, full response) plus noise, so ratios straddle the clip range; CP-sliced by
    slime; then slime's advantages."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    gen = torch.Generator().manual_seed(args.seed + 7)
    old, ref = [], []
    for tokens, total, response in zip(
        rollout_data["tokens"], rollout_data["total_lengths"], rollout_data["response_lengths"], strict=True
    ):
        rows = weights.double()[tokens[total - response - 1 : total - 1]] / args.rollout_temperature
        current = torch.log_softmax(rows, -1).gather(1, tokens[total - response :, None]).squeeze(1)
        for out, scale in ((old, 0.5), (ref, 0.3)):
            noisy = (current + scale * torch.randn(response, generator=gen, dtype=torch.float64)).float()
            out.append(slice_log_prob_with_cp(noisy, total, response))
    rollout_data["log_probs"], rollout_data["ref_log_probs"] = old, ref
    compute_advantages_and_returns(args, rollout_data)


def train_micro_batches(args, rollout_data, weight_shard):
    """slime's DataIterator -> get_batch -> bigram model -> loss_function -> backward over every
    micro-batch of every step: ([(loss, metrics)], gradient of the weight shard)."""
    from slime.backends.megatron_utils import data, loss
    from slime.backends.megatron_utils.model import _with_rollout_top_p_token_keys

    weight_shard = weight_shard.detach().clone().requires_grad_()
    iterator = data.get_data_iterator(rollout_data)[0]
    keys = _with_rollout_top_p_token_keys(args, FORWARD_KEYS)
    results = []
    for step, num_microbatches in enumerate(rollout_data["num_microbatches"]):
        for _ in range(num_microbatches):
            batch = data.get_batch(iterator, keys, args.data_pad_size_multiplier, args.allgather_cp)
            logits = weight_shard[batch["tokens"][0]].unsqueeze(0)
            value, _, log = loss.loss_function(
                args, batch, num_microbatches, rollout_data["global_batch_sizes"][step], logits
            )
            value.backward()
            results.append((value.detach(), dict(zip(log["keys"], log["values"][1:].tolist(), strict=True))))
    return results, weight_shard.grad


class Case(NamedTuple):
    """One configuration: parallel sizes (dp = world / (tp * cp)), slime + fusedrl flags, seed,
    the denominators the truth's sample-mean reducer uses to weigh pg_loss as the case's mode
    (None: slime's; "group": prompt-group mask totals, prompt_mean; "divisor": the
    --loss-aggregation-divisor, constant), whether the train data lacks `rollout_mask_sums`
    (as from a --custom-convert-samples-to-train-data-path that does not set them: slime then
    divides by each sample's own mask total), and --num-steps-per-rollout (the global batch is
    the rollout over that)."""

    name: str
    tp: int
    cp: int
    argv: List[str]
    seed: int
    truth_denominators: Optional[str] = None
    without_mask_sums: bool = False
    steps: int = 1

    def full_argv(self) -> List[str]:
        """BASE_ARGV, the case's flags, its steps per rollout (the later --global-batch-size wins) and seed."""
        steps = ["--num-steps-per-rollout", str(self.steps), "--global-batch-size", str(NUM_PROMPTS * GROUP_SIZE // self.steps)]
        return BASE_ARGV + self.argv + steps + ["--seed", str(self.seed)]


WORLD_SIZE = 4
# Dynamic batching where dp < 4 (fewer, larger micro-batches; the static path runs at dp = 4).
DYNAMIC_BATCHING = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "48"]
PPO_CASES = [
    Case(f"tp{tp}-cp{cp}-dp{WORLD_SIZE // (tp * cp)}", tp, cp,
         PPO_ARGV + CUSTOM_LOSS + (DYNAMIC_BATCHING if tp * cp > 1 else []), 11 + tp + 2 * cp)
    for tp in (1, 2) for cp in (1, 2)
]  # fmt: skip
# prompt_mean with dynamic batching at dp = 2 (and cp = 2); no entropy or KL term, so the loss is pg_loss.
PROMPT_MEAN_CASE = Case(
    "prompt_mean-tp1-cp2-dp2", 1, 2,
    CUSTOM_LOSS + ["--loss-aggregation", "prompt_mean", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"],
    5, truth_denominators="group",
)  # fmt: skip
# constant with slime's own policy loss: fusedrl's pg_loss reducer through slime's reducer hook.
CONSTANT_CASE = Case("constant-reducer-tp2-cp1-dp2", 2, 1,
                     ["--loss-aggregation", "constant", "--loss-aggregation-divisor", "16"] + DYNAMIC_BATCHING, 3,
                     truth_denominators="divisor")  # fmt: skip
NO_MASK_SUMS_CASE = Case("no-rollout-mask-sums-tp1-cp2-dp2", 1, 2, PPO_ARGV + CUSTOM_LOSS + DYNAMIC_BATCHING, 9,
                         without_mask_sums=True)  # fmt: skip
# prompt_mean with 2 and 4 steps per rollout (4 and 2 rollouts a step: two groups, one group), on
# fusedrl's policy loss and on slime's own (through fusedrl's pg_loss reducer), static and dynamic
# batching, tp and cp. 4 steps of 2 samples need dynamic batching at dp = 2 (static bins of 2 make
# one micro-batch, not one per rank).
PROMPT_MEAN = ["--loss-aggregation", "prompt_mean"]
MULTI_STEP_CASES = [
    Case("prompt_mean-2steps-tp2-cp1-dp2", 2, 1, CUSTOM_LOSS + PROMPT_MEAN, 21, truth_denominators="group", steps=2),
    Case("prompt_mean-4steps-tp1-cp2-dp2", 1, 2, CUSTOM_LOSS + PROMPT_MEAN + DYNAMIC_BATCHING, 22,
         truth_denominators="group", steps=4),
    Case("prompt_mean-policy_loss-2steps-tp1-cp2-dp2", 1, 2, PROMPT_MEAN + DYNAMIC_BATCHING, 23,
         truth_denominators="group", steps=2),
    Case("prompt_mean-policy_loss-4steps-tp2-cp1-dp2", 2, 1, PROMPT_MEAN + DYNAMIC_BATCHING, 24,
         truth_denominators="group", steps=4),
]  # fmt: skip
# token_mean on slime's own policy loss: slime's per-token path, which the flag turns on.
TOKEN_MEAN_CASE = Case("token_mean-policy_loss-tp2-cp2-dp1", 2, 2, ["--loss-aggregation", "token_mean"] + DYNAMIC_BATCHING, 25)
ALL_CASES = PPO_CASES + [PROMPT_MEAN_CASE, CONSTANT_CASE, NO_MASK_SUMS_CASE, TOKEN_MEAN_CASE] + MULTI_STEP_CASES
# The bitwise A/B: slime's own policy loss, plain slime against the package's entry point with the
# default sample_mean and --fusedrl-keep-slime-log-probs (and, without the switch, the fused log-prob path).
AB_ARGV = PPO_ARGV + DYNAMIC_BATCHING
AB_CASE = Case("ab-sample_mean-tp2-cp2-dp1", 2, 2, AB_ARGV, 26)

# Options fusedrl's policy loss does not implement, configured the README's first way: slime's own
# train.py (its parser, no fusedrl flags) and --custom-loss-function-path (or its module alias).
ALIAS_LOSS = ["--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.policy.policy_loss"]
UNSUPPORTED = {
    "custom-pg-loss-reducer-function-path": CUSTOM_LOSS
    + ["--custom-pg-loss-reducer-function-path", "fusedrl.slime_ext.aggregation.get_pg_loss_reducer"],
    # slime's parser drops the package's flags: the loss refuses rather than run as sample_mean / PPO
    "loss-aggregation": CUSTOM_LOSS + ["--loss-aggregation", "prompt_mean"],
    "pg-loss-type": ALIAS_LOSS + ["--pg-loss-type", "reinforce"],
}


def truth_denominators(case: Case, args, rollout_data) -> torch.Tensor:
    """Per local sample, what slime's sample-mean reducer divides by to weigh pg_loss as the case's
    aggregation mode does."""
    if case.truth_denominators == "group":
        return torch.tensor(group_mask_totals(args))[rollout_data["partition"]]
    return torch.full((len(rollout_data["partition"]),), float(args.loss_aggregation_divisor))


def case_runs(case: Case):
    """On this rank: {run name: ([(loss, metrics)], weight-shard gradient)} on the same
    micro-batches for the truth, slime's eager float32 path, slime's policy loss on the fused
    log-prob path ("fused log-probs", where slime's reducer is the case's), and the configured
    fusedrl loss ("fused loss": fusedrl's policy loss, or slime's with fusedrl's pg_loss reducer);
    where the truth weighs pg_loss by the mode, also "metric truth", slime's sample mean (the
    metrics' weights in every mode)."""
    import fusedrl.slime_ext as fusedrl_slime
    from fusedrl.slime_ext import train as entry
    from fusedrl.slime_ext.arguments import add_fusedrl_arguments
    from megatron.core import parallel_state
    from megatron.training.global_vars import set_args

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.tp, context_parallel_size=case.cp, create_gloo_process_groups=False
    )
    try:
        args, unknown = upstream_slime.parse_known_args(case.full_argv(), add_fusedrl_arguments)
        assert unknown == [], unknown
        entry.validate(args)
        set_args(args)  # as slime's train actor does (initialize.init); the pg_loss reducer hook reads them
        slime_args = copy.copy(args)
        slime_args.loss_type, slime_args.custom_pg_loss_reducer_function_path = "policy_loss", None
        rollout_data = train_data(args, parallel_state.get_data_parallel_world_size(), case.cp)
        if case.without_mask_sums:
            del rollout_data["rollout_mask_sums"]
        weights = bigram_weights(case.seed)
        add_policy_log_probs(args, rollout_data, weights)
        shard = weights.chunk(case.tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]

        truth_data = rollout_data
        if case.truth_denominators:
            truth_data = dict(rollout_data, rollout_mask_sums=truth_denominators(case, args, rollout_data))
        with Float64LogProbs():
            runs = {"truth": train_micro_batches(slime_args, truth_data, shard)}
            if case.truth_denominators:  # the metrics' truth: slime's sample mean, whatever the mode
                runs["metric truth"] = train_micro_batches(slime_args, rollout_data, shard)
        runs["slime fp32"] = train_micro_batches(slime_args, truth_data, shard)
        fusedrl_slime.install(args)
        try:
            if not case.truth_denominators:
                runs["fused log-probs"] = train_micro_batches(slime_args, rollout_data, shard)
            runs["fused loss"] = train_micro_batches(args, rollout_data, shard)
        finally:
            fusedrl_slime.uninstall()
        return runs
    finally:
        parallel_state.destroy_model_parallel()


def first_loss_error(argv):
    """slime's loss_function on the first micro-batch under slime's plain parse of `argv` (tp = cp
    = 1): the error it raises as "Type: message", or None when the loss runs."""
    from megatron.core import parallel_state
    from slime.backends.megatron_utils import data, loss

    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        args, _ = upstream_slime.parse_known_args(BASE_ARGV + argv)
        rollout_data = train_data(args, parallel_state.get_data_parallel_world_size(), 1)
        weights = bigram_weights(0)
        add_policy_log_probs(args, rollout_data, weights)
        batch = data.get_batch(data.get_data_iterator(rollout_data)[0], FORWARD_KEYS, args.data_pad_size_multiplier)
        logits = weights[batch["tokens"][0]].unsqueeze(0)
        try:
            loss.loss_function(args, batch, 1, rollout_data["global_batch_sizes"][0], logits)
        except Exception as error:  # the observation under test
            return f"{type(error).__name__}: {error}"
        return None
    finally:
        parallel_state.destroy_model_parallel()


SFC_ARGV = [
    "--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.sfc_loss",
    "--sfc-num-auxiliary-token-samples", "4", "--sfc-kl-beta", "0.1", "--entropy-coef", "0",
    "--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-disk-dir",
    tempfile.gettempdir(), "--update-weight-local-checkpoint-dir", tempfile.gettempdir(),
]  # fmt: skip


def delta_push_ages():
    """SFC ages under --update-weight-mode delta, as slime's train actor runs it: the init hook
    (`fusedrl.slime_ext.install`) first, then the actor imports the delta updater and pushes
    version 1 through its real `update_weights` (its disk and engine I/O replaced by no-ops), then
    the before-train-step hook starts step 0. Returns the ages of version-1 tokens, or the error
    the SFC clock raises, as "Type: message"."""
    import fusedrl.slime_ext as fusedrl_slime
    from fusedrl.slime_ext import age
    from fusedrl.slime_ext import train as entry
    from fusedrl.slime_ext.arguments import add_fusedrl_arguments
    from slime.utils.misc import load_function

    args, _ = upstream_slime.parse_known_args(BASE_ARGV + SFC_ARGV, add_fusedrl_arguments)
    entry.validate(args)
    fusedrl_slime.install(args)
    try:
        from slime.backends.megatron_utils.update_weight.update_weight_from_disk_delta import UpdateWeightFromDiskDelta

        updater = object.__new__(UpdateWeightFromDiskDelta)
        updater.weight_version, updater._baseline_captured = 0, True
        updater._publish = updater._reload_engines = updater._record_metrics = lambda: None
        UpdateWeightFromDiskDelta.update_weights(updater)
        load_function(args.custom_megatron_before_train_step_hook_path)(args, 0, 0, None, None, None)
        try:
            return age.CLOCK.ages(torch.tensor([updater.weight_version])).tolist()
        except ValueError as error:  # the observation under test
            return f"{type(error).__name__}: {error}"
    finally:
        fusedrl_slime.uninstall()


class ReducerRecorder:
    """Records, in slime's loss module, every reducer `get_sum_of_sample_mean` builds (returned
    unchanged), the reducer slime's `loss_function` hands `policy_loss_function`, and every hook
    path slime's loss loads: what decides which object reduces pg_loss."""

    def __enter__(self):
        from slime.backends.megatron_utils import loss

        self.built, self.handed, self.loaded = [], [], []
        self.saved = {name: getattr(loss, name) for name in ("get_sum_of_sample_mean", "policy_loss_function", "load_function")}
        build, policy_loss, load = self.saved.values()

        def get_sum_of_sample_mean(*args, **kwargs):
            reducer = build(*args, **kwargs)
            self.built.append(reducer)
            return reducer

        def policy_loss_function(args, batch, logits, sum_of_sample_mean):
            self.handed.append(sum_of_sample_mean)
            return policy_loss(args, batch, logits, sum_of_sample_mean)

        def load_function(path):
            self.loaded.append(path)
            return load(path)

        loss.get_sum_of_sample_mean, loss.policy_loss_function, loss.load_function = (
            get_sum_of_sample_mean, policy_loss_function, load_function)  # fmt: skip
        return self

    def __exit__(self, *exc):
        from slime.backends.megatron_utils import loss

        for name, original in self.saved.items():
            setattr(loss, name, original)

    def same_objects(self) -> bool:
        """Whether policy_loss_function got, in every micro-batch, the very reducer slime built."""
        return len(self.handed) == len(self.built) > 0 and all(a is b for a, b in zip(self.handed, self.built))


def ab_runs(case: Case):
    """The bitwise A/B on this rank: {run: (results, gradient, recorder observations)} for plain
    slime (its parser, no package code), the package's entry point (its flags, startup checks and
    init hook) with --fusedrl-keep-slime-log-probs, and the same without the switch."""
    import fusedrl.slime_ext as fusedrl_slime
    from fusedrl.slime_ext import train as entry
    from fusedrl.slime_ext.arguments import add_fusedrl_arguments
    from megatron.core import parallel_state
    from megatron.training.global_vars import set_args

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.tp, context_parallel_size=case.cp, create_gloo_process_groups=False
    )
    try:
        weights = bigram_weights(case.seed)
        shard = weights.chunk(case.tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
        runs = {}
        for run, extra in (("plain slime", None), ("keep slime log-probs", ["--fusedrl-keep-slime-log-probs"]), ("fused log-probs", [])):
            argv = case.full_argv() + (extra or [])
            args, _ = upstream_slime.parse_known_args(argv, None if extra is None else add_fusedrl_arguments)
            if extra is not None:
                entry.validate(args)
                set_args(args)
                fusedrl_slime.install(args)
            try:
                rollout_data = train_data(args, parallel_state.get_data_parallel_world_size(), case.cp)
                add_policy_log_probs(args, rollout_data, weights)
                with ReducerRecorder() as recorder:
                    results, grad = train_micro_batches(args, rollout_data, shard)
            finally:
                fusedrl_slime.uninstall()
            runs[run] = (results, grad, recorder.same_objects(), recorder.loaded, args.custom_pg_loss_reducer_function_path)
        return runs
    finally:
        parallel_state.destroy_model_parallel()


def slime_step_split(args, samples, dp_size: int, cp_size: int):
    """Per sample (rollout order), the training step slime's real conversion and DP schedule
    (`RolloutManager._split_train_data_by_dp`, i.e. `build_dp_schedule`) trains it in; None when
    no rank trains it."""
    from slime.ray.rollout import RolloutManager

    manager = object.__new__(RolloutManager)
    manager.args = args
    manager.custom_reward_post_process_func = manager.custom_convert_samples_to_train_data_func = None
    manager.set_train_parallel_config(
        {"dp_size": dp_size, "cp_size": cp_size, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    )
    steps = [None] * len(samples)
    for box in manager._split_train_data_by_dp(manager._convert_samples_to_train_data(samples)):
        data = box.inner
        first_mb = 0
        for step, count in enumerate(data["num_microbatches"]):
            for mb in data["micro_batch_indices"][first_mb : first_mb + count]:
                for local in mb:
                    steps[data["partition"][local]] = step
            first_mb += count
    return steps


# Rollout ids of the step-split samples: own (None), compact rollouts of 2 and 3 samples.
STEP_SPLIT_ROLLOUT_IDS = [None, 11, 11, None, 4, 4, 4, None]
STEP_SPLIT_CONFIGS = [  # (global batch size in rollouts, dp, dynamic batching)
    (1, 1, False), (2, 1, False), (3, 1, True), (4, 2, True), (2, 2, True), (5, 1, False),
]


def step_split_agreement():
    """[(config, slime's step per sample, fusedrl's)] for every STEP_SPLIT_CONFIGS entry."""
    from fusedrl.slime_ext.rollout import prompt_groups

    observed = []
    for global_batch_size, dp_size, dynamic in STEP_SPLIT_CONFIGS:
        argv = BASE_ARGV + ["--global-batch-size", str(global_batch_size)] + (DYNAMIC_BATCHING if dynamic else ["--micro-batch-size", "1"])
        args, _ = upstream_slime.parse_known_args(argv)
        samples = make_samples(3)
        for sample, rollout_id in zip(samples, STEP_SPLIT_ROLLOUT_IDS, strict=True):
            sample.rollout_id = rollout_id
        ours = prompt_groups.training_steps(samples, global_batch_size)
        observed.append(((global_batch_size, dp_size, dynamic), slime_step_split(args, samples, dp_size, 1), ours))
    return observed


def rank_main(rank, world_size, cases, unsupported, ab_case):
    """Every case and observation on this rank (one spawn for all: importing slime and megatron is
    the slow part)."""
    upstream_slime.load()
    torch.set_num_threads(1)
    return {
        "runs": {case.name: case_runs(case) for case in cases},
        "refusals": {option: first_loss_error(argv) for option, argv in unsupported.items()},
        "ages": delta_push_ages(),
        "ab": ab_runs(ab_case),
        "step split": step_split_agreement() if rank == 0 else None,
    }


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def observed():
    """rank 0's observations, and "runs" / "ab" as [rank 0, ..., rank WORLD_SIZE - 1]."""
    by_rank = run_on_ranks(WORLD_SIZE, rank_main, ALL_CASES, UNSUPPORTED, AB_CASE)
    out = dict(by_rank[0])
    out["runs"] = {case.name: [ranks["runs"][case.name] for ranks in by_rank] for case in ALL_CASES}
    out["ab"] = [ranks["ab"] for ranks in by_rank]
    return out


@pytest.fixture
def results(observed):
    return observed["runs"]


def compare(runs, run: str, metrics=None, truth="truth"):
    """Largest relative error of a run against the truth: per micro-batch loss and metrics (those
    named, else all the truth reports), and the gradient."""
    truth, got = runs[truth], runs[run]
    assert len(got[0]) == len(truth[0]) > 0
    errors = {"grad": rel_err(got[1], truth[1])}
    for (loss, logged), (ref_loss, ref_logged) in zip(got[0], truth[0], strict=True):
        errors["loss"] = max(errors.get("loss", 0.0), rel_err(loss, ref_loss))
        for key in metrics or ref_logged:
            error = rel_err(torch.tensor(logged[key]), torch.tensor(ref_logged[key]), LOG_PROB_DIFFERENCES.get(key, FLOOR))
            errors[key] = max(errors.get(key, 0.0), error)
    return errors


def assert_matches_truth(rank_results, fused_runs, metrics=None, truth="truth"):
    for rank, runs in enumerate(rank_results):
        assert all(loss.dtype == torch.float64 for loss, _ in runs[truth][0])  # the float64 path ran
        eager = compare(runs, "slime fp32", metrics, truth)
        for run in fused_runs:
            errors = compare(runs, run, metrics, truth)
            bad = {key: err for key, err in errors.items() if not err < TOLERANCE}
            assert not bad, f"rank {rank} {run}: {bad} (slime fp32: {eager})"


@pytest.mark.parametrize("case", PPO_CASES, ids=lambda case: case.name)
def test_ppo_through_slimes_training_path(results, case):
    """slime's policy loss on the fused log-prob path (install) and fusedrl's policy loss
    (custom_loss), PPO with dual clip, entropy and KL loss, against the float64 truth."""
    for runs in results[case.name]:
        assert set(runs["fused loss"][0][0][1]) <= set(runs["truth"][0][0][1])
    assert_matches_truth(results[case.name], ["fused log-probs", "fused loss"])


def test_prompt_mean_with_dynamic_batching(results):
    """prompt_mean's group denominators travel through slime's conversion, DP split and get_batch
    (dynamic batching, dp = 2, cp = 2) and weigh pg_loss as slime's reducer would with group totals."""
    assert_matches_truth(results[PROMPT_MEAN_CASE.name], ["fused loss"], metrics=["pg_loss"])


def test_constant_through_slimes_policy_loss_and_reducer_hook(results):
    """--loss-aggregation constant with slime's own policy loss: fusedrl's pg_loss reducer through
    slime's --custom-pg-loss-reducer-function-path, reading megatron's global args as in slime."""
    assert_matches_truth(results[CONSTANT_CASE.name], ["fused loss"], metrics=["pg_loss"])


def test_without_rollout_mask_sums_each_sample_is_its_own_denominator(results):
    """slime's fallback when the train data carries no rollout_mask_sums (issue 12 item 7)."""
    assert_matches_truth(results[NO_MASK_SUMS_CASE.name], ["fused log-probs", "fused loss"])


@pytest.mark.parametrize("option", list(UNSUPPORTED))
def test_policy_loss_refuses_unsupported_options_at_first_use(observed, option):
    error = observed["refusals"][option]
    assert error is not None and error.startswith("ValueError") and f"--{option}" in error, error


def test_sfc_ages_follow_pushes_of_the_delta_weight_updater(observed):
    assert observed["ages"] == [0]


@pytest.mark.parametrize("case", MULTI_STEP_CASES, ids=lambda case: case.name)
def test_prompt_mean_with_several_steps_per_rollout(results, case):
    """prompt_mean at 2 and 4 optimizer steps per rollout, on fusedrl's policy loss and on slime's
    own (fusedrl's pg_loss reducer; slime's log-prob reuse needs --loss-type policy_loss, which the
    checks keep): pg_loss (= the loss: no entropy or KL term) and the gradient weigh each step's
    samples by their prompt group's mask total, as slime's reducer does given the group totals;
    every other metric stays slime's sample mean."""
    assert_matches_truth(results[case.name], ["fused loss"], metrics=["pg_loss"])
    for runs in results[case.name]:
        assert len({len(runs["truth"][0])}) == 1 and len(runs["fused loss"][0]) >= case.steps  # one or more mbs per step
    others = [key for key in results[case.name][0]["metric truth"][0][0][1] if key not in ("loss", "pg_loss")]
    assert others, "the metric truth reports metrics"
    for rank, runs in enumerate(results[case.name]):
        errors = compare(runs, "fused loss", others, truth="metric truth")
        bad = {key: err for key, err in errors.items() if key in others and not err < TOLERANCE}
        assert not bad, f"rank {rank}: {bad}"


def test_token_mean_through_slimes_policy_loss(results):
    """token_mean on slime's own policy loss is slime's per-token path (--calculate-per-token-loss,
    set while parsing), on the fused log-prob path, against the float64 truth."""
    assert_matches_truth(results[TOKEN_MEAN_CASE.name], ["fused log-probs", "fused loss"])


def test_prompt_group_step_split_is_slimes(observed):
    """fusedrl's rollout-time step of each sample (`prompt_groups.training_steps`) is the step
    slime's real conversion and DP schedule train it in, dropped remainder included."""
    for config, slime_steps, ours in observed["step split"]:
        assert ours == slime_steps, config


def test_default_sample_mean_keeps_the_reducer_object_slime_builds(observed):
    """Through the package's entry point with the default --loss-aggregation sample_mean, slime's
    policy loss gets the very reducer slime's loss_function built, and no reducer hook is loaded."""
    for rank_runs in observed["ab"]:
        for run in ("plain slime", "keep slime log-probs", "fused log-probs"):
            _, _, same_objects, loaded, reducer_path = rank_runs[run]
            assert same_objects and loaded == [] and reducer_path is None, run


def test_bitwise_ab_against_plain_slime(observed):
    """--fusedrl-keep-slime-log-probs: losses, every metric (pg_loss among them) and the gradient
    are byte-identical to plain slime's; without it the fused log-prob path rounds differently."""
    fused_differs = False
    for rank_runs in observed["ab"]:
        plain, kept, fused = (rank_runs[run] for run in ("plain slime", "keep slime log-probs", "fused log-probs"))
        assert len(plain[0]) == len(kept[0]) > 0
        for (loss, logged), (ref_loss, ref_logged) in zip(kept[0], plain[0], strict=True):
            assert loss.dtype == ref_loss.dtype and torch.equal(loss, ref_loss)
            assert logged == ref_logged  # Python floats of float32 values: equal means the same bits
        assert torch.equal(kept[1], plain[1])
        fused_differs |= not torch.equal(fused[1], plain[1]) or any(
            a[1] != b[1] for a, b in zip(fused[0], plain[0], strict=True))  # fmt: skip
    assert fused_differs, "the fused path matched plain slime bit for bit: the A/B would not tell the switch is needed"
