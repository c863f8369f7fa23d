"""Token age for SFC: optimizer steps since the weights that sampled a token were pushed to the engine.

Each train actor process keeps one `AgeClock`:

- steps: slime calls `before_train_step` (its --custom-megatron-before-train-step-hook-path,
  `train_one_step` in slime/backends/megatron_utils/model.py) right before every optimizer step;
  the clock counts those calls. While step number n (0-based) is in flight, n steps are complete.
- pushes: every weight push goes through a weight updater's `update_weights()` (slime's
  `UpdateWeightFromDistributed`, `UpdateWeightFromTensor`, ... in
  slime/backends/megatron_utils/update_weight/), which increments the updater's `weight_version`
  and sends it to the engines, which report it back in every /generate `meta_info.weight_version`.
  `install` wraps those methods, in every updater module of slime's, so that each push records
  (version, steps completed). Pushes
  happen between train calls, so every started step is complete when one is recorded.
- age of a token sampled by version v while step n is in flight = n - (steps completed at v's push).

This holds for slime's synchronous loop (train.py: push, rollout, train, push, ...; ages 0 on the
first step after a push, 1 on the next with --num-steps-per-rollout 2) and the asynchronous one
(train_async.py: the next rollout is generated while the current one trains, so its tokens come
from a push one or more steps older), and per token: a multi-turn or resumed sample whose turns
came from different versions gets each turn's own age.

Every train rank records the same pushes and steps (all ranks run `update_weights` and every
train step), so the ages agree across tp, cp and dp ranks.
"""

import functools
import importlib
import logging
import pkgutil
import sys
from typing import Dict

import torch

from .callables import load_function

logger = logging.getLogger(__name__)
HOOK_PATH = "fusedrl.slime_ext.age.before_train_step"
USER_HOOK_ATTR = "fusedrl_user_before_train_step_hook_path"
UPDATER_PACKAGE = "slime.backends.megatron_utils.update_weight"
_WRAP_MARK = "_fusedrl_records_push"


class AgeClock:
    """Optimizer steps started, and the number of completed steps at each weight version's push."""

    def __init__(self) -> None:
        self.steps_started = 0
        self.push_steps: Dict[int, int] = {}

    def start_step(self) -> None:
        """An optimizer step begins (all earlier ones are complete)."""
        self.steps_started += 1

    def record_push(self, version) -> None:
        """Weight version `version` reached the engines now. Recording the same push twice (a
        subclass calling its parent's update_weights) is harmless; a version pushed again after
        more steps is an error, since its tokens would have two ages."""
        version = int(version)
        known = self.push_steps.get(version)
        if known is not None and known != self.steps_started:
            raise ValueError(
                f"weight version {version} was pushed after {known} optimizer steps and again after "
                f"{self.steps_started}: versions must be unique per push"
            )
        self.push_steps[version] = self.steps_started

    def current_step(self) -> int:
        """0-based number of the step in flight (the one whose loss is being computed)."""
        if self.steps_started == 0:
            raise ValueError(
                "no optimizer step has started: SFC ages need fusedrl's before-train-step hook "
                f"({HOOK_PATH}), installed by --custom-megatron-init-path fusedrl.slime_ext.install"
            )
        return self.steps_started - 1

    def ages(self, versions: torch.Tensor) -> torch.Tensor:
        """Per token, steps since its weight version was pushed (int64, same shape as versions).
        A negative version marks a token no engine generated (loss-masked filler): age 0."""
        step = self.current_step()
        versions = versions.to(torch.int64)
        generated = versions >= 0
        ages = torch.zeros_like(versions)
        ages[generated] = self._generated_ages(versions[generated].cpu(), step).to(versions.device)
        return ages

    def _generated_ages(self, versions: torch.Tensor, step: int) -> torch.Tensor:
        unique, inverse = torch.unique(versions, return_inverse=True)
        missing = [int(v) for v in unique if int(v) not in self.push_steps]
        if missing:
            raise ValueError(
                f"weight versions {missing} were never pushed by this trainer (pushed: "
                f"{sorted(self.push_steps)}); is the weight-updater hook installed "
                "(--custom-megatron-init-path fusedrl.slime_ext.install)?"
            )
        pushed_at = torch.tensor([self.push_steps[int(v)] for v in unique], dtype=torch.int64)
        if bool((pushed_at > step).any()):
            raise ValueError(
                f"a token's weight version was pushed after {int(pushed_at.max())} steps, later than "
                f"the step in flight ({step})"
            )
        return (step - pushed_at)[inverse]


CLOCK = AgeClock()


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    """slime's before-train-step hook: count the step, then run the user's own hook if one was set."""
    CLOCK.start_step()
    user_hook = getattr(args, USER_HOOK_ATTR, None)
    if user_hook:
        load_function(user_hook)(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)


def records_pushes(update_weights):
    """An updater's `update_weights` that records the pushed version once the push succeeded."""
    if getattr(update_weights, _WRAP_MARK, False):
        return update_weights

    @functools.wraps(update_weights)
    def update_weights_recording_push(self, *args, **kwargs):
        result = update_weights(self, *args, **kwargs)
        CLOCK.record_push(self.weight_version)
        return result

    setattr(update_weights_recording_push, _WRAP_MARK, True)
    return update_weights_recording_push


def install(args) -> None:
    """Init-hook step: route slime's before-train-step hook through `before_train_step` (chaining
    a hook the user gave) and wrap `update_weights` of every weight updater class slime has.

    slime's `train_one_step` reads the hook path from megatron's global args, the object slime's
    init passes to the init hook, so setting it here takes effect. The init hook runs before the
    train actor picks its updater by --update-weight-mode / --update-weight-transport, and the
    actor imports some updaters only then (`UpdateWeightFromDiskDelta` under delta), so every
    module of slime's updater package is imported and wrapped here, not only those loaded so far.
    A module whose own dependencies are missing is skipped: slime cannot build that updater
    either. Installing twice is harmless.
    """
    current = getattr(args, "custom_megatron_before_train_step_hook_path", None)
    if current and current != HOOK_PATH:
        setattr(args, USER_HOOK_ATTR, current)
    args.custom_megatron_before_train_step_hook_path = HOOK_PATH
    package = importlib.import_module(UPDATER_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__, UPDATER_PACKAGE + "."):
        try:
            importlib.import_module(info.name)
        except ImportError as error:
            logger.info("fusedrl SFC ages: slime's %s does not import here (%s); not wrapped", info.name, error)
    for name, module in list(sys.modules.items()):
        if name.startswith(UPDATER_PACKAGE + ".") and module is not None:
            _wrap_updaters(module)


def _wrap_updaters(module) -> None:
    """Wrap `update_weights` of every class defined in `module` that defines one."""
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__ and "update_weights" in vars(value):
            value.update_weights = records_pushes(vars(value)["update_weights"])
