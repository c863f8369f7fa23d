"""The init hook: `--custom-megatron-init-path fusedrl.slime_ext.install`.

slime calls `install(args)` once per train actor, after distributed and model-parallel init. It
replaces, in every loaded module that holds them (the defining module and every module that did
`from ... import name`), slime's

- `slime.backends.megatron_utils.loss.get_log_probs_and_entropy` and
  `slime.utils.ppo_utils.calculate_log_probs_and_entropy` by the fused versions of
  `fusedrl.slime_ext.logprobs` (same signatures and results), so slime's own policy, SFT, KL and
  log-prob recompute paths run on the kernel with no other flag (not with
  --fusedrl-keep-slime-log-probs, the bitwise A/B switch); an optional keyword that a newer slime
  adds to either is accepted: at its default the call runs fused, set otherwise it runs slime's
  own function (refused with the fused LM head, whose hidden states it cannot read);
- `slime.backends.megatron_utils.data.get_batch` by `carry.without_carried_inputs(get_batch)`,
  which keeps the package's carried tensors out of the model's forward kwargs (a no-op for batches
  that carry none);
- when slime's policy loss calls the package's pg_loss reducer
  (--custom-pg-loss-reducer-function-path fusedrl.slime_ext.aggregation.get_pg_loss_reducer),
  `slime.backends.megatron_utils.loss.policy_loss_function` by `micro_batch.publishing(original)`,
  so the reducer can read prompt_mean's carried denominators from the micro-batch;
- with --fusedrl-fused-lm-head only, `slime.backends.megatron_utils.model_provider.
  get_model_provider_func` by `handing_off_provider_func(original)`: the actor's output
  layer hands its hidden states to the log-prob path instead of logits (`lm_head`), and
  `slime.backends.megatron_utils.loss.loss_function` by `main_grad.publishing(original)`, which
  publishes the step sizes it scales the loss by, so the one-pass op can put the output weight's
  gradient into megatron's `main_grad` at the right scale (`main_grad`).

Before patching, `install` refuses (ValueError naming them and the entry point) the package's
flags that are on its process's command line but not on slime's args: slime's own entry script
dropped them; and slime's own features its patches cannot run with (`flags/slime_features.py`:
`--log-probs-backend triton`, ...), also for args that carry none of the package's flags. When
the run was started through `fusedrl.slime_ext.train` and another init hook was given, the entry
point moved it to `args.fusedrl_user_init_path`; `install` calls it after patching.

Modules imported later pick up the replacement from the (already patched) defining module.
Installing again is harmless and also patches modules loaded since; `uninstall()` puts every
original back. References captured before install in other forms (a `functools.partial`, a
default argument) are not reachable this way.
"""

import functools
import importlib
import sys
from typing import Callable, Dict, List, NamedTuple, Tuple

from . import age, carry, lm_head, logprobs, main_grad, micro_batch
from .arguments import check_at_first_use, configures_package, refuse_dropped_flags
from .callables import accept_newer_keywords, check_signature, load_function
from .flags import lm_head as lm_head_flags
from .flags import log_probs as log_probs_flags
from .flags import slime_features
from .flags.aggregation import REDUCER_PATH
from .flags.sfc import uses_sfc


class Target(NamedTuple):
    """A slime function and how to build its replacement from the original. `stands_in`: the
    replacement computes what slime's function computes (not a wrapper calling it), so a call
    that sets a keyword a newer slime added can run slime's own function instead
    (`callables.accept_newer_keywords`)."""

    module: str
    name: str
    replacement: Callable[[Callable], Callable]
    stands_in: bool = False


def _fused_get_log_probs(original):
    return logprobs.get_log_probs_and_entropy


def _fused_calculate_log_probs(original):
    return logprobs.calculate_log_probs_and_entropy


def handing_off_provider_func(original):
    """Replacement of slime's `get_model_provider_func(args, role)`: actor models hand off their
    output layer (the last pipeline stage's) and the first chunk's config is recorded
    (`lm_head.record_schedule_config`); other roles are built unchanged."""

    def get_model_provider_func(args, role="actor"):
        provider = original(args, role)
        if role != "actor":
            return provider

        @functools.wraps(provider)
        def handing_off_provider(pre_process=True, post_process=True, **kwargs):
            model = provider(pre_process=pre_process, post_process=post_process, **kwargs)
            if kwargs.get("vp_stage") in (None, 0):  # model[0], whose config the schedule scales by
                lm_head.record_schedule_config(getattr(model, "config", None))
            if post_process:
                layer = getattr(model, "output_layer", None)
                if layer is None:
                    raise ValueError(f"{lm_head_flags.FLAG}: the last pipeline stage's model has no output_layer to hand off")
                lm_head.hand_off(layer)
            return model

        return handing_off_provider

    return get_model_provider_func


LOG_PROB_TARGETS = (
    Target("slime.backends.megatron_utils.loss", "get_log_probs_and_entropy", _fused_get_log_probs, stands_in=True),
    Target("slime.utils.ppo_utils", "calculate_log_probs_and_entropy", _fused_calculate_log_probs, stands_in=True),
)
BATCH_TARGETS = (Target("slime.backends.megatron_utils.data", "get_batch", carry.without_carried_inputs),)
TARGETS = LOG_PROB_TARGETS + BATCH_TARGETS
REDUCER_TARGETS = (
    Target("slime.backends.megatron_utils.loss", "policy_loss_function", micro_batch.publishing),
)
FUSED_LM_HEAD_TARGETS = (
    Target("slime.backends.megatron_utils.model_provider", "get_model_provider_func", handing_off_provider_func),
    Target("slime.backends.megatron_utils.loss", "loss_function", main_grad.publishing),
)

_REPLACEMENTS: Dict[Tuple[str, str], Tuple[Callable, Callable]] = {}  # (module, name) -> (original, new)
_PATCHED: List[Tuple[object, str, Callable]] = []  # (module object, attribute, original)


def _replacement_for(target: Target) -> Tuple[Callable, Callable]:
    key = (target.module, target.name)
    if key not in _REPLACEMENTS:
        original = getattr(importlib.import_module(target.module), target.name)
        where = f"{target.module}.{target.name}"
        new = target.replacement(original)
        if target.stands_in:
            new = accept_newer_keywords(original, new, where, _slime_original_can_run)
        check_signature(original, new, where)
        _REPLACEMENTS[key] = (original, new)
    return _REPLACEMENTS[key]


def _slime_original_can_run() -> bool:
    """slime's own functions read logits; with the output layer handed off the model returns hidden
    states, which only the package's path reads."""
    return lm_head.output_weight() is None


def _rebind_everywhere(original: Callable, new: Callable) -> None:
    """Point every module attribute that is `original` at `new`, remembering each for uninstall."""
    for module in list(sys.modules.values()):
        try:
            names = [name for name, value in vars(module).items() if value is original]
        except TypeError:  # objects in sys.modules without a __dict__
            continue
        for name in names:
            setattr(module, name, new)
            _PATCHED.append((module, name, original))


def _targets(args) -> Tuple[Target, ...]:
    """What `install(args)` patches: the log-prob path unless --fusedrl-keep-slime-log-probs, the
    batch filter always, slime's policy loss when it calls the package's pg_loss reducer, and the
    output-layer hand-off with --fusedrl-fused-lm-head."""
    if args is None:
        return TARGETS
    targets = () if log_probs_flags.enabled(args) else LOG_PROB_TARGETS
    targets += BATCH_TARGETS
    if getattr(args, "custom_pg_loss_reducer_function_path", None) == REDUCER_PATH:
        targets += REDUCER_TARGETS
    return targets + (FUSED_LM_HEAD_TARGETS if lm_head_flags.enabled(args) else ())


def install(args=None) -> None:
    """slime's init hook: refuse the package's flags that slime's parser dropped from the command
    line (`arguments.refuse_dropped_flags`: slime's own entry script was run with them), run the
    package's flag checks when its flags, losses or hooks are configured
    (`arguments.check_at_first_use`), else those of slime's own features against its patches
    (`flags/slime_features.py`), patch the targets in every loaded module (idempotent; see
    `_targets`), start the weight-version age bookkeeping when the SFC loss is configured, then run
    the user's own init hook when the entry point moved it to --fusedrl-user-init-path."""
    if args is not None:
        refuse_dropped_flags(args, sys.argv[1:])
        if configures_package(args):
            check_at_first_use(args)  # slime's own features among its checks
        else:
            slime_features.validate_args(args)
    for target in _targets(args):
        _rebind_everywhere(*_replacement_for(target))
    if args is not None and uses_sfc(args):
        age.install(args)
    user_hook = getattr(args, "fusedrl_user_init_path", None)
    if user_hook:
        load_function(user_hook)(args)


def uninstall() -> None:
    """Restore every patched attribute to slime's original and every handed-off output layer."""
    lm_head.restore()
    while _PATCHED:
        module, name, original = _PATCHED.pop()
        setattr(module, name, original)
    _REPLACEMENTS.clear()


def installed() -> Dict[str, Callable]:
    """`"module.name" -> replacement` for the targets installed so far."""
    return {f"{module}.{name}": new for (module, name), (_, new) in _REPLACEMENTS.items()}
