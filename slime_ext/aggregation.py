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
            calculate_per_token_loss, as resolved at startup by `flags/aggregation.py`).
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

slime's hook. `get_pg_loss_reducer` is a factory for --custom-pg-loss-reducer-function-path, which
slime's own `policy_loss` calls with total_lengths, response_lengths, loss_masks and
calculate_per_token_loss: the flag checks install it for prompt_mean and constant with
`--loss-type policy_loss`, so those modes run on slime's own loss (GSPO, OPSM, TIS, its log-prob
reuse) while every metric stays on slime's sample-mean reducer. It reads the flags from megatron's
global args, which slime's train actor sets (`set_args`) before any loss runs, and prompt_mean's
carried group denominators from the micro-batch slime's policy loss is computing, which the init
hook publishes (`micro_batch`). sample_mean is slime's own reducer, so the hook refuses it. Its
first call runs the startup checks (`arguments.check_at_first_use`), whichever way slime was
started.

Flags and their startup checks: `flags/aggregation.py`; the prompt_mean rollout wrapper:
`rollout/prompt_groups.py`.
"""

from typing import NamedTuple

import torch

from ..kernels.segment_sum import segment_sum
from . import carry, megatron, micro_batch
from .arguments import check_at_first_use
from .context_parallel import chunked_loss_masks, sample_denominators
from .flags.aggregation import mode_of


class LocalTokens(NamedTuple):
    """This context-parallel rank's response tokens of a micro-batch: loss mask and sample index."""

    mask: torch.Tensor
    segment_ids: torch.Tensor

    @classmethod
    def of(cls, total_lengths, response_lengths, loss_masks, device) -> "LocalTokens":
        cp_rank, cp_size = megatron.cp_rank_and_size()
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
    mode = mode_of(args)
    num_samples = len(batch["loss_masks"])
    if mode == "prompt_mean":
        return carry.per_sample(batch, carry.PROMPT_DENOMINATOR_KEY).reshape(num_samples).to(torch.float64)
    if mode == "sample_mean":
        return _default_denominators(args, batch)
    return _fixed_denominators(args, mode, num_samples)


def _local_tokens(batch, device, loss_masks=None) -> LocalTokens:
    masks = batch["loss_masks"] if loss_masks is None else loss_masks
    return LocalTokens.of(batch["total_lengths"], batch["response_lengths"], masks, device)


def aggregate_pg_loss(args, batch, pg_loss: torch.Tensor, loss_masks=None) -> torch.Tensor:
    """The micro-batch's pg_loss under --loss-aggregation (contract in the module docstring).
    loss_masks: the masks a TIS function kept (default the batch's), over the batch's denominators."""
    tokens = _local_tokens(batch, pg_loss.device, loss_masks)
    return tokens.reduce(pg_loss, pg_loss_denominators(args, batch))


def reduce_diagnostics(args, batch, values: torch.Tensor, loss_masks=None) -> torch.Tensor:
    """slime's default reducer on [N] or [N, C] CP-local per-token values (one pass for C metrics);
    loss_masks as in `aggregate_pg_loss` (slime's reducer rebuilt on a TIS function's masks)."""
    return _local_tokens(batch, values.device, loss_masks).reduce(values, _default_denominators(args, batch))


def get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """Factory for slime's --custom-pg-loss-reducer-function-path (prompt_mean, token_mean, constant).

    Returns x -> sum over samples of the rank's masked sum of x / D_s, as slime's own reducer, over
    the masks slime hands in (its rejection-sampled ones under --use-tis). prompt_mean's D_s come
    from the micro-batch slime's policy loss is computing (`micro_batch.current()`).
    """
    args = megatron.train_args()
    check_at_first_use(args)
    mode = mode_of(args)
    if mode == "sample_mean":
        raise ValueError(
            "--loss-aggregation sample_mean is slime's own pg_loss reducer: leave --custom-pg-loss-reducer-function-path unset"
        )
    if bool(calculate_per_token_loss) != (mode == "token_mean"):
        raise ValueError(
            f"--loss-aggregation {mode} got calculate_per_token_loss={calculate_per_token_loss} from slime; "
            "start through python -m fusedrl.slime_ext.train, whose flag checks set it (token_mean sets it, the others forbid it)"
        )
    if mode == "prompt_mean":
        denominators = pg_loss_denominators(args, micro_batch.current())
    else:
        denominators = _fixed_denominators(args, mode, len(loss_masks))
    if len(denominators) != len(loss_masks):
        raise ValueError(f"{len(denominators)} pg_loss denominators for the {len(loss_masks)} samples slime reduces")
    tokens = LocalTokens.of(total_lengths, response_lengths, loss_masks, loss_masks[0].device)
    return lambda x: tokens.reduce(x, denominators)
