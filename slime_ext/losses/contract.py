"""What slime's custom-loss contract asks of every loss of the package, written once.

slime calls `loss_fn(args, batch, logits, sum_of_sample_mean)` per micro-batch (each loss first
runs `arguments.check_at_first_use(args)`: inside slime's trainer the loss is where a bad
configuration surfaces when training was not started through the package's entry point) and expects
`(loss, metrics)`: a 0-d loss whose backward reaches the logits on every rank (slime runs one
backward per rank, so a rank with no response token must still join it), and metrics it can log
and reduce (detached 0-d tensors, `loss` among them).
"""

import torch


def reaching_logits(loss: torch.Tensor, logits: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`loss`, joined to the logits' graph with a zero when the rank trains no token."""
    return loss + 0 * logits.sum() if num_tokens == 0 else loss


def detached(metrics: dict) -> dict:
    """The metrics as slime logs them: detached copies."""
    return {key: value.clone().detach() for key, value in metrics.items()}
