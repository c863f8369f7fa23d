"""The micro-batch slime's `policy_loss_function` is computing, for the package's pg_loss reducer.

slime calls the --custom-pg-loss-reducer-function-path factory from inside its policy loss with
lengths and loss masks only (slime/backends/megatron_utils/loss.py), while prompt_mean's
denominators travel in the micro-batch (`carry.PROMPT_DENOMINATOR_KEY`). The init hook therefore
replaces slime's `policy_loss_function` by `publishing(policy_loss_function)`, which makes its
`batch` argument visible to `current()` for the duration of the call (a context variable, so
concurrent calls never see each other's batch). slime's `loss_function` looks the policy loss up
by name at every call, so the wrapper is what it calls, and what `--recompute-loss-function`'s
checkpoint calls again in the backward. Nothing else changes: same arguments, same results.
"""

import contextvars
import functools

_CURRENT = contextvars.ContextVar("fusedrl_policy_loss_batch", default=None)
_MARK = "_fusedrl_publishes_micro_batch"


def publishing(policy_loss_function):
    """slime's `policy_loss_function(args, batch, logits, sum_of_sample_mean)`, publishing `batch`
    while it runs. Wrapping a wrapped function returns it unchanged."""
    if getattr(policy_loss_function, _MARK, False):
        return policy_loss_function

    @functools.wraps(policy_loss_function)
    def policy_loss_function_publishing_batch(args, batch, logits, sum_of_sample_mean):
        token = _CURRENT.set(batch)
        try:
            return policy_loss_function(args, batch, logits, sum_of_sample_mean)
        finally:
            _CURRENT.reset(token)

    setattr(policy_loss_function_publishing_batch, _MARK, True)
    return policy_loss_function_publishing_batch


def current() -> dict:
    """The micro-batch of the policy loss running now; ValueError outside one."""
    batch = _CURRENT.get()
    if batch is None:
        raise ValueError(
            "the package's pg_loss reducer needs the micro-batch slime's policy_loss_function is computing; it is "
            "published by the init hook (--custom-megatron-init-path fusedrl.slime_ext.install), which was not run"
        )
    return batch
