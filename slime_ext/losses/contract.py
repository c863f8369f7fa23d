"""What slime's custom-loss contract asks of every loss of the package, written once.

slime calls `loss_fn(args, batch, logits, sum_of_sample_mean)` per micro-batch and expects
`(loss, metrics)`: a 0-d loss whose backward reaches the logits on every rank (slime runs one
backward per rank, so a rank with no response token must still join it), and metrics it can log
and reduce (detached 0-d tensors, `loss` among them).
"""

import torch

from .. import aggregation


def aggregate_pg_term(args, batch, per_token: torch.Tensor, sum_of_sample_mean) -> torch.Tensor:
    """The policy-gradient term of the micro-batch under --loss-aggregation; slime's own reducer
    when the package's flags were not registered (the mode then is the default, sample_mean,
    which is that reducer)."""
    if getattr(args, "loss_aggregation", None) is None:
        return sum_of_sample_mean(per_token)
    return aggregation.aggregate_pg_loss(args, batch, per_token)


def reaching_logits(loss: torch.Tensor, logits: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`loss`, joined to the logits' graph with a zero when the rank trains no token."""
    return loss + 0 * logits.sum() if num_tokens == 0 else loss


def detached(metrics: dict) -> dict:
    """The metrics as slime logs them: detached copies."""
    return {key: value.clone().detach() for key, value in metrics.items()}
