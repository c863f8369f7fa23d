"""--loss-aggregation: how the per-token pg_loss of a step becomes one number (ScaleRL, section 3.2).

Every mode gives token i of sample s the weight `m_i / D_s` (loss mask over a per-sample
denominator) with D_s fixed at step level, so micro-batches, data-parallel ranks and
context-parallel chunks each add their part and the parts sum to the whole step
(docs/math.md, "Aggregation"):

    sample_mean  D_s = mask total of s's rollout (slime's `rollout_mask_sums`), clamped at 1 (default)
    prompt_mean  D_s = mask total of all samples sharing s's `group_index`, clamped at 1; with
                 --loss-aggregation-strict-prompt-scale, times P / N (strict DAPO / ScaleRL scale)
    token_mean   D_s = 1 on slime's per-token path (--calculate-per-token-loss; slime divides by
                 the step's token count)
    constant     D_s = L = --loss-aggregation-divisor (Dr.GRPO)

Train side. The package's losses (slime_ext/losses/policy.py, sfc.py) call

    aggregate_pg_loss(args, batch, pg_loss) -> 0-d tensor
        args: slime's parsed args (reads loss_aggregation, loss_aggregation_divisor and
            calculate_per_token_loss, as set by `validate_args`).
        batch: slime's micro-batch dict (total_lengths, response_lengths, loss_masks,
            rollout_mask_sums; under prompt_mean the carried denominators, see slime_ext/carry.py).
        pg_loss: 1-D per-token pg_loss over this rank's context-parallel response tokens of the
            micro-batch, samples concatenated in batch order, each in slime's zigzag order (the
            layout of batch["advantages"]); not masked (the loss mask is applied here).
        Returns sum_s sum_i pg_loss_i * m_i / D_s over the rank's tokens: slime's reducer contract
        (a sum of per-sample means), which slime's loss wrapper then scales as usual.

    reduce_diagnostics(args, batch, values) -> values.shape[1:]
        slime's own reducer (`sum_of_sample_mean`: rollout mask totals, or the token sum on the
        per-token path) for [N] or [N, C] values in the same layout, C metrics in one pass.

Aggregation applies to pg_loss only. Diagnostics (clip fraction, approximate KL, entropy, KL to
the reference) and the entropy and KL terms keep slime's default weights, as slime does for its
own --custom-pg-loss-reducer-function-path: metrics then read the same whatever mode the loss
uses (runs with different modes stay comparable), and the regularisers keep the strength their
coefficients were tuned for; the ScaleRL knob is the weighting of the policy-gradient term.

slime's hook. `get_pg_loss_reducer` is a factory for --custom-pg-loss-reducer-function-path (slime
calls it with total_lengths, response_lengths, loss_masks, calculate_per_token_loss and no args),
for the modes that need no per-sample data beyond the masks: token_mean and constant. It reads
the flags from megatron's global args, which slime's train actor sets (`set_args`) before any
loss runs. sample_mean needs slime's `rollout_mask_sums` and prompt_mean the carried group
denominators, neither of which the hook receives, so it refuses them.

Rollout side (prompt_mean only). The group denominators need every sample of the step, which only
the rollout side sees. slime's default conversion (`RolloutManager._convert_samples_to_train_data`)
is a method of the rollout actor, and --custom-convert-samples-to-train-data-path replaces it
wholesale, so a converter cannot add to it without re-implementing it; the rollout function, in
contrast, is a plain dotted path whose output (every sample of the step, after dynamic filtering)
is converted as is. So `generate_rollout` wraps the configured rollout function: it calls it,
then attaches each sample's denominator to `Sample.multimodal_train_inputs`; `validate_args`
installs it in place of --rollout-function-path under prompt_mean only. Other modes never read
`group_index` and add nothing.

N and P are counted over the samples one rollout call returns (N = distinct rollouts, P =
distinct prompt groups): one optimizer step when --num-steps-per-rollout is 1; with several
steps, the rollout's average group size stands in for each step's.
"""

import math
from typing import List, NamedTuple

import torch

from ..kernels.segment_sum import segment_sum
from . import carry
from .context_parallel import chunked_loss_masks, cp_rank_and_size, sample_denominators
from .hooks import load_function

MODES = ("sample_mean", "prompt_mean", "token_mean", "constant")
REDUCER_PATH = "fusedrl.slime_ext.aggregation.get_pg_loss_reducer"
ROLLOUT_FUNCTION_PATH = "fusedrl.slime_ext.aggregation.generate_rollout"
PROMPT_DENOMINATOR_KEY = "fusedrl_prompt_denominator"
SAMPLE_MODES = ("sample_mean", "prompt_mean")  # need per-sample data the reducer hook lacks


def add_arguments(parser):
    """Register the aggregation flags on slime's parser."""
    parser.add_argument(
        "--loss-aggregation",
        choices=MODES,
        default=None,
        help="How pg_loss is aggregated (ScaleRL): sample_mean (slime's default), prompt_mean "
        "(DAPO), token_mean (sets --calculate-per-token-loss) or constant (Dr.GRPO). Default: "
        "sample_mean, or token_mean when --calculate-per-token-loss is given.",
    )
    parser.add_argument(
        "--loss-aggregation-divisor",
        type=float,
        default=None,
        help="L for --loss-aggregation constant: each sample contributes sum(loss * mask) / L "
        "(e.g. the maximum response length). Finite and > 0; ignored by the other modes.",
    )
    parser.add_argument(
        "--loss-aggregation-strict-prompt-scale",
        action="store_true",
        help="prompt_mean only: multiply the weights by N / P (rollouts / prompt groups of the "
        "step) so the loss is the strict DAPO / ScaleRL (1 / P) sum over groups of the group "
        "token mean, instead of P / N times it. Ignored by the other modes.",
    )
    parser.add_argument(
        "--loss-aggregation-inner-rollout-function-path",
        default=None,
        help="prompt_mean only: the rollout function the package's rollout wrapper calls. "
        "Default: the --rollout-function-path given (the wrapper takes its place).",
    )
    return parser


def validate_args(args) -> None:
    """Resolve the mode and check its flags at startup; ValueError naming the flag otherwise.

    token_mean sets --calculate-per-token-loss; constant with slime's own policy loss installs
    `get_pg_loss_reducer` as slime's pg_loss reducer; prompt_mean installs the rollout wrapper.
    Calling it again on the resulting args changes nothing.
    """
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    if args.loss_aggregation is None:
        args.loss_aggregation = "token_mean" if per_token else "sample_mean"
    mode = _mode(args)
    if mode == "constant":
        _check_divisor(args.loss_aggregation_divisor)
        if per_token:
            raise ValueError(
                "--loss-aggregation constant divides each sample by --loss-aggregation-divisor and is "
                "incompatible with --calculate-per-token-loss (which divides by the token count)"
            )
    if mode in SAMPLE_MODES and per_token:
        raise ValueError(
            f"--loss-aggregation {mode} weighs samples, but --calculate-per-token-loss selects slime's "
            "per-token mean: use --loss-aggregation token_mean for that"
        )
    if mode == "token_mean":
        args.calculate_per_token_loss = True
    _check_pg_loss_path(args, mode)
    if mode == "prompt_mean":
        _install_rollout_wrapper(args)


def _check_divisor(divisor) -> None:
    if divisor is None or not math.isfinite(float(divisor)) or float(divisor) <= 0.0:
        raise ValueError(
            f"--loss-aggregation-divisor must be finite and > 0 under --loss-aggregation constant, got {divisor!r}"
        )


def _check_pg_loss_path(args, mode: str) -> None:
    """Make sure the configured loss actually applies the mode."""
    reducer = getattr(args, "custom_pg_loss_reducer_function_path", None)
    loss_type = getattr(args, "loss_type", None)
    if reducer == REDUCER_PATH and mode in SAMPLE_MODES:
        raise ValueError(
            f"--custom-pg-loss-reducer-function-path {REDUCER_PATH} cannot apply --loss-aggregation {mode} "
            "(slime's reducer hook receives no per-sample denominators)"
        )
    if mode == "prompt_mean" and loss_type != "custom_loss":
        raise ValueError(
            "--loss-aggregation prompt_mean is applied by the package's losses (--loss-type custom_loss "
            "--custom-loss-function-path fusedrl.slime_ext.losses.policy_loss or sfc_loss), got "
            f"--loss-type {loss_type}"
        )
    if mode == "constant" and loss_type == "policy_loss":
        if reducer is None:
            args.custom_pg_loss_reducer_function_path = REDUCER_PATH
        elif reducer != REDUCER_PATH:
            raise ValueError(
                "--loss-aggregation constant with --loss-type policy_loss needs --custom-pg-loss-reducer-"
                f"function-path {REDUCER_PATH}, got {reducer}"
            )


def _install_rollout_wrapper(args) -> None:
    inner = args.loss_aggregation_inner_rollout_function_path
    if args.rollout_function_path != ROLLOUT_FUNCTION_PATH:
        if inner is not None and inner != args.rollout_function_path:
            raise ValueError(
                f"--loss-aggregation-inner-rollout-function-path {inner} conflicts with --rollout-function-path "
                f"{args.rollout_function_path}: give the rollout function once"
            )
        args.loss_aggregation_inner_rollout_function_path = args.rollout_function_path
        args.rollout_function_path = ROLLOUT_FUNCTION_PATH
    elif inner is None:
        raise ValueError(
            f"--rollout-function-path {ROLLOUT_FUNCTION_PATH} needs --loss-aggregation-inner-rollout-"
            "function-path (the rollout function it wraps)"
        )


# ----------------------------------------------------------------------------- rollout side


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime rollout function: the inner rollout function's output, with every training sample
    carrying its prompt_mean denominator (evaluation output and other modes pass through)."""
    inner = load_function(args.loss_aggregation_inner_rollout_function_path)
    output = inner(args, rollout_id, data_source, evaluation=evaluation)
    if not evaluation and args.loss_aggregation == "prompt_mean":
        samples = _leaf_samples(getattr(output, "samples", output))
        denominators = prompt_denominators(samples, strict_scale=args.loss_aggregation_strict_prompt_scale)
        for sample, denominator in zip(samples, denominators, strict=True):
            carry.attach(sample, PROMPT_DENOMINATOR_KEY, torch.tensor([denominator], dtype=torch.float64))
    return output


def _leaf_samples(node) -> list:
    """The samples of slime's nested rollout output (groups of samples, possibly nested deeper)."""
    if isinstance(node, (list, tuple)):
        return [sample for child in node for sample in _leaf_samples(child)]
    return [node]


def prompt_denominators(samples, strict_scale: bool = False) -> List[float]:
    """Per sample, the mask total of its prompt group (`group_index`) over the step, clamped at 1;
    times P / N (prompt groups / rollouts) when `strict_scale`.

    Mask totals follow slime's conversion: a missing loss mask counts every response token and a
    removed sample (`remove_sample`) counts none. A sample without a group raises ValueError:
    treating it as a group of its own would quietly turn prompt_mean into another mode.
    """
    groups = []
    for position, sample in enumerate(samples):
        if sample.group_index is None:
            raise ValueError(
                f"--loss-aggregation prompt_mean needs Sample.group_index on every sample, got "
                f"group_index=None for sample {position} of the step (index={sample.index})"
            )
        groups.append(sample.group_index)
    group_totals = {}
    for group, sample in zip(groups, samples):
        group_totals[group] = group_totals.get(group, 0.0) + _mask_total(sample)
    scale = len(group_totals) / _num_rollouts(samples) if strict_scale else 1.0
    return [max(group_totals[group], 1.0) * scale for group in groups]


def _mask_total(sample) -> float:
    if getattr(sample, "remove_sample", False):
        return 0.0
    if sample.loss_mask is None:
        return float(sample.response_length)
    return float(torch.as_tensor(sample.loss_mask, dtype=torch.float64).sum())


def _num_rollouts(samples) -> int:
    """slime's rollout count: samples sharing a `rollout_id` are one rollout, None is its own."""
    ids = [sample.rollout_id for sample in samples]
    return len({rid for rid in ids if rid is not None}) + sum(rid is None for rid in ids)


# ----------------------------------------------------------------------------- train side


class LocalTokens(NamedTuple):
    """This context-parallel rank's response tokens of a micro-batch: loss mask and sample index."""

    mask: torch.Tensor
    segment_ids: torch.Tensor

    @classmethod
    def of(cls, total_lengths, response_lengths, loss_masks, device) -> "LocalTokens":
        cp_rank, cp_size = cp_rank_and_size()
        masks = chunked_loss_masks(total_lengths, response_lengths, loss_masks, cp_rank, cp_size)
        lengths = torch.tensor([len(mask) for mask in masks], device=device)
        segment_ids = torch.repeat_interleave(torch.arange(len(masks), device=device), lengths)
        return cls(torch.cat(masks).to(device), segment_ids)

    def reduce(self, values: torch.Tensor, denominators: torch.Tensor) -> torch.Tensor:
        """sum_s sum_{i in s} values_i * m_i / D_s, per channel."""
        if values.shape[0] != self.mask.numel():
            raise ValueError(
                f"values must have one row per CP-local response token ({self.mask.numel()}), "
                f"got shape {tuple(values.shape)}"
            )
        # segment_ids are built here and the denominators are clamped at 1 or checked at startup:
        # the kernel's value checks (host syncs over the mask) would only re-prove that.
        return segment_sum(
            values, self.mask, self.segment_ids, denominators.to(values.device), validate=False
        )


def _mode(args) -> str:
    mode = args.loss_aggregation
    if mode not in MODES:
        raise ValueError(f"--loss-aggregation must be one of {MODES}, got {mode!r}")
    return mode


def _default_denominators(args, batch) -> torch.Tensor:
    """slime's reducer denominators: rollout mask totals clamped at 1, or 1 on the per-token path."""
    masks = batch["loss_masks"]
    if args.calculate_per_token_loss:
        return torch.ones(len(masks), dtype=torch.float64)
    totals = sample_denominators(masks, batch.get("rollout_mask_sums"))
    return torch.stack(totals).to(torch.float64)


def _fixed_denominators(args, mode: str, num_samples: int) -> torch.Tensor:
    """D_s of the modes that need no per-sample data: L under constant, 1 under token_mean."""
    value = float(args.loss_aggregation_divisor) if mode == "constant" else 1.0
    return torch.full((num_samples,), value, dtype=torch.float64)


def pg_loss_denominators(args, batch) -> torch.Tensor:
    """[S] float64: each sample's pg_loss denominator D_s under --loss-aggregation."""
    mode = _mode(args)
    num_samples = len(batch["loss_masks"])
    if mode == "prompt_mean":
        return carry.per_sample(batch, PROMPT_DENOMINATOR_KEY).reshape(num_samples).to(torch.float64)
    if mode == "sample_mean":
        return _default_denominators(args, batch)
    return _fixed_denominators(args, mode, num_samples)


def _local_tokens(batch, device) -> LocalTokens:
    return LocalTokens.of(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], device)


def aggregate_pg_loss(args, batch, pg_loss: torch.Tensor) -> torch.Tensor:
    """The micro-batch's pg_loss under --loss-aggregation (contract in the module docstring)."""
    return _local_tokens(batch, pg_loss.device).reduce(pg_loss, pg_loss_denominators(args, batch))


def reduce_diagnostics(args, batch, values: torch.Tensor) -> torch.Tensor:
    """slime's default reducer on [N] or [N, C] CP-local per-token values (one pass for C metrics)."""
    return _local_tokens(batch, values.device).reduce(values, _default_denominators(args, batch))


def get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """Factory for slime's --custom-pg-loss-reducer-function-path (token_mean and constant).

    Returns x -> sum over samples of the rank's masked sum of x / D_s, as slime's own reducer.
    """
    args = _slime_train_args()
    mode = _mode(args)
    if mode in SAMPLE_MODES:
        raise ValueError(
            f"--loss-aggregation {mode} cannot run through --custom-pg-loss-reducer-function-path (it "
            "receives no per-sample denominators); use the package's policy loss"
        )
    if bool(calculate_per_token_loss) != (mode == "token_mean"):
        raise ValueError(
            f"--loss-aggregation {mode} got calculate_per_token_loss={calculate_per_token_loss} from slime; "
            "run fusedrl's validate_args at startup (token_mean sets it, constant forbids it)"
        )
    denominators = _fixed_denominators(args, mode, len(loss_masks))
    tokens = LocalTokens.of(total_lengths, response_lengths, loss_masks, loss_masks[0].device)
    return lambda x: tokens.reduce(x, denominators)


def _slime_train_args():
    """The args slime's train actor registered with megatron (initialize.init -> set_args)."""
    from megatron.training.global_vars import get_args

    return get_args()
