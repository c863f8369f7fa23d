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

slime's other modes (docs/slime.md, "SFC's ages in every way slime runs a job"):
- `--update-weight-mode delta`: the updater's first call captures the base the engines already
  serve (SGLang's `"default"` weights, --hf-checkpoint) and pushes nothing; it is recorded as
  version `ENGINE_DEFAULT_VERSION`, the number the rollout side gives `"default"` in that mode.
- `--release-train`: slime kills the train actors after every push and starts new processes;
  the clock is kept in --save (`CLOCK_FILE`, written by rank 0 at every push) and a new actor's
  init hook restores it, checking it against the version slime hands the actor
  (`update_weight_start_version`).
- a push that raises part way: slime's updater has taken the new version number, some engines
  may hold part of it; the version is recorded as failed and its tokens are refused by name.
- a rollout replayed from a dump (--load-debug-rollout-data, --load-forge-rollout-data) carries
  another job's versions: refused at startup (`flags/sfc.py`).
"""

import functools
import importlib
import json
import logging
import os
import pkgutil
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

from .callables import load_function

logger = logging.getLogger(__name__)
HOOK_PATH = "fusedrl.slime_ext.age.before_train_step"
USER_HOOK_ATTR = "fusedrl_user_before_train_step_hook_path"
UPDATER_PACKAGE = "slime.backends.megatron_utils.update_weight"
_WRAP_MARK = "_fusedrl_records_push"
# The weight version of SGLang's "default" weights (an engine no push has reached: --hf-checkpoint).
# slime's pushes number from 1 (`update_weight_start_version` 0, then +1 per push), so 0 is free.
ENGINE_DEFAULT_VERSION = 0
CLOCK_FILE = "fusedrl_sfc_age_clock.json"  # in --save, under --release-train


class AgeClock:
    """Optimizer steps started, and the number of completed steps at each weight version's push."""

    def __init__(self) -> None:
        self.steps_started = 0
        self.push_steps: Dict[int, int] = {}
        self.failed_pushes: Dict[int, int] = {}  # version -> steps started when its push raised
        self.store: Optional[Path] = None  # where the clock outlives the process (--release-train)

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
        self._save()

    def record_failed_push(self, version) -> None:
        """The push of `version` raised part way: slime's updater has counted it and engines may
        hold part of it, so its tokens have no age."""
        self.failed_pushes[int(version)] = self.steps_started
        self._save()

    def state(self) -> dict:
        """What `restore` takes: steps started and every push recorded (JSON-ready)."""
        return {
            "steps_started": self.steps_started,
            "push_steps": {str(v): s for v, s in self.push_steps.items()},
            "failed_pushes": {str(v): s for v, s in self.failed_pushes.items()},
        }

    def restore(self, state: dict) -> None:
        self.steps_started = int(state["steps_started"])
        self.push_steps = {int(v): int(s) for v, s in state["push_steps"].items()}
        self.failed_pushes = {int(v): int(s) for v, s in state.get("failed_pushes", {}).items()}

    def _save(self) -> None:
        """Write the state to `store` (rank 0 alone; atomically, so a killed process leaves the last one)."""
        if self.store is None or not _writes_shared_files():
            return
        self.store.parent.mkdir(parents=True, exist_ok=True)
        partial = self.store.with_name(self.store.name + ".partial")
        partial.write_text(json.dumps(self.state()))
        os.replace(partial, self.store)

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
            raise ValueError(self._unknown_versions(missing))
        pushed_at = torch.tensor([self.push_steps[int(v)] for v in unique], dtype=torch.int64)
        if bool((pushed_at > step).any()):
            raise ValueError(
                f"a token's weight version was pushed after {int(pushed_at.max())} steps, later than "
                f"the step in flight ({step})"
            )
        return (step - pushed_at)[inverse]

    def _unknown_versions(self, missing) -> str:
        """Why tokens of `missing` versions have no age, by the cause the clock can tell."""
        failed = [v for v in missing if v in self.failed_pushes]
        if failed:
            return (
                f"weight version {failed[0]}'s push raised part way (after {self.failed_pushes[failed[0]]} optimizer "
                "steps): the engines may hold part of it, so its tokens have no age; SFC refuses them"
            )
        if ENGINE_DEFAULT_VERSION in missing:
            return (
                "tokens carry SGLang's \"default\" weights (an engine no push of this trainer reached: started or "
                "restarted, e.g. by --use-fault-tolerance, on --hf-checkpoint), which this trainer never pushed, "
                "so they have no age; only under --update-weight-mode delta are they the pushes' base"
            )
        return (
            f"weight versions {missing} reached no push this trainer recorded (recorded: {sorted(self.push_steps)}): "
            "the tokens were sampled by weights this job did not push through slime's weight updaters (a "
            "sample kept from an earlier job, or an updater outside slime's update_weight package), so they "
            "have no age"
        )


def _writes_shared_files() -> bool:
    """Whether this process writes the files every train rank shares (global rank 0, or no process group)."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0


CLOCK = AgeClock()


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    """slime's before-train-step hook: count the step, then run the user's own hook if one was set."""
    CLOCK.start_step()
    user_hook = getattr(args, USER_HOOK_ATTR, None)
    if user_hook:
        load_function(user_hook)(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)


def records_pushes(update_weights):
    """An updater's `update_weights` that records the pushed version once the push succeeded, a
    failed one when it raised after taking a new version number, and delta's first call (a
    baseline capture, no push) as the engines' `"default"` weights; a call that pushes nothing
    records nothing."""
    if getattr(update_weights, _WRAP_MARK, False):
        return update_weights

    @functools.wraps(update_weights)
    def update_weights_recording_push(self, *args, **kwargs):
        version, captures_baseline = self.weight_version, _before_baseline(self)
        try:
            result = update_weights(self, *args, **kwargs)
        except BaseException:
            if self.weight_version != version:
                CLOCK.record_failed_push(self.weight_version)
            raise
        if self.weight_version != version:
            CLOCK.record_push(self.weight_version)
        elif captures_baseline and not _before_baseline(self):
            CLOCK.record_push(ENGINE_DEFAULT_VERSION)
        return result

    setattr(update_weights_recording_push, _WRAP_MARK, True)
    return update_weights_recording_push


def _before_baseline(updater) -> bool:
    """Whether `updater` is slime's delta updater before its first call (`UpdateWeightFromDiskDelta`
    captures the engines' base then, publishing nothing)."""
    return getattr(updater, "_baseline_captured", None) is False


def keep_across_actors(args) -> None:
    """Under --release-train, keep the clock in --save for the train actors slime starts after
    every push, and restore it in such an actor: slime hands it the version the engines hold
    (`update_weight_start_version`, 0 for the job's first actors), which must be the last push
    the kept clock recorded. ValueError naming the file otherwise."""
    if not getattr(args, "release_train", False):
        CLOCK.store = None
        return
    CLOCK.store = Path(args.save) / CLOCK_FILE
    start_version = int(getattr(args, "update_weight_start_version", 0) or 0)
    if start_version == 0:
        return  # the job's first train actors (a file an earlier job left is replaced at the first push)
    if not CLOCK.store.is_file():
        raise ValueError(
            f"--release-train started train actors for weight version {start_version}, but the SFC age clock "
            f"the released actors kept ({CLOCK.store}) is missing: --save must be one folder every train rank "
            "and every actor generation of the job reads"
        )
    state = json.loads(CLOCK.store.read_text())
    last = max((int(v) for v in state["push_steps"]), default=None)
    if last != start_version:
        raise ValueError(
            f"--release-train started train actors for weight version {start_version}, but the SFC age clock in "
            f"{CLOCK.store} last recorded version {last}: the file is another job's, or a push went unrecorded"
        )
    CLOCK.restore(state)


def install(args) -> None:
    """Init-hook step: route slime's before-train-step hook through `before_train_step` (chaining
    a hook the user gave), wrap `update_weights` of every weight updater class slime has, and
    keep the clock across the train actors --release-train recreates (`keep_across_actors`).

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
    keep_across_actors(args)
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
