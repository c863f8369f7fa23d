"""SGLang plugin entry point (`sglang.srt.plugins` group): `register()`.

SGLang's `load_plugins()` calls `register()` early in each of its processes and then applies the
hooks registered here. With AGENTCORE_SGLANG_TOKEN_SAMPLES unset, `register()` registers nothing
and SGLang runs untouched. With it set to 1, it picks the hook target for the installed SGLang,
logs which one it patched (or why it could not), and registers the door hooks of
`admission.py` (with the K bound of AGENTCORE_SGLANG_TOKEN_SAMPLES_MAX_K), the sampler hooks of
`hooks.py` and the start-up checks of `startup.py`.

The "enabled" line is a warning, one per process that loads the plugin and naming it: SGLang
calls `load_plugins()` before `configure_logger` (in `launch_server` and first thing in its
scheduler and detokenizer processes), so at that moment only Python's last-resort handler,
which prints warnings and errors, is there to write it; and the mode does change what every
request's top_logprobs_num means.

`load_plugins()` only logs exceptions raised here and carries on, so a configuration the mode
cannot serve, or a hook that did not land, is refused through the start-up checks, which run
from hooks SGLang does not swallow.
"""

from __future__ import annotations

import functools
import logging
import os
from importlib import metadata
from typing import Callable, NamedTuple, Optional

from .admission import scheduler_admission_hook, tokenizer_admission_hook
from .constraints import ENV_VAR, MAX_SAMPLES_ENV_VAR, max_samples_from_env
from .hooks import attach_logprobs_hook, compute_logprobs_hook, sampler_forward_hook
from .startup import original_logprob_problem, refuse_missing_hooks, refuse_server_config

logger = logging.getLogger(__name__)

COMPUTE_LOGPROBS_TARGET = (
    "sglang.srt.layers.logprob_processor.OutputLogprobProcessor.compute_logprobs"
)
ATTACH_LOGPROBS_TARGET = "sglang.srt.layers.sampler.Sampler._attach_logprobs_to_output"
SAMPLER_FORWARD_TARGET = "sglang.srt.layers.sampler.Sampler.forward"
ADMISSION_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
SCHEDULER_ADMISSION_TARGET = "sglang.srt.managers.utils.validate_input_length"
SCHEDULER_INIT_TARGET = "sglang.srt.managers.scheduler.Scheduler.__init__"
SERVER_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.check_server_args"


class DrawTarget(NamedTuple):
    """Where the top-logprobs are produced in one range of SGLang versions."""

    path: str
    hook: Callable
    versions: str


def _already_registered(registry) -> bool:
    """True when this process's hook registry already holds the sampler hook: the package ships two
    entry-point names (`fusedrl_token_samples`, and the `sglang_token_samples` an allow-list written
    for the original plugin names), and SGLang loads both when `SGLANG_PLUGINS` is unset. Reads
    the registry's hook table (SGLang has no public query)."""
    hooks = getattr(registry, "_hooks", {}).get(SAMPLER_FORWARD_TARGET, ())
    return any(entry[1] is sampler_forward_hook for entry in hooks)


def register() -> None:
    """Enable the token-sample mode when AGENTCORE_SGLANG_TOKEN_SAMPLES=1; otherwise do nothing."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    value = os.environ.get(ENV_VAR, "")
    if value != "1":
        if value not in ("", "0"):
            logger.warning(
                "fusedrl token samples: %s=%r is not '1'; plugin stays off.", ENV_VAR, value
            )
        else:
            logger.info("fusedrl token samples: %s is not 1; SGLang left untouched.", ENV_VAR)
        return

    if _already_registered(HookRegistry):
        logger.info("fusedrl token samples: already registered in this process (under its other entry-point name).")
        return

    version = _sglang_version()
    target = find_draw_target()
    max_samples, bound_problem = max_samples_from_env()
    problems = []
    if target is None:
        problems.append(
            f"sglang {version} has neither {COMPUTE_LOGPROBS_TARGET} (>= 0.5.16) nor "
            f"{ATTACH_LOGPROBS_TARGET} (0.5.12 - 0.5.15) to hook"
        )
    for problem in (original_logprob_problem(), bound_problem):
        if problem is not None:
            problems.append(problem)

    if problems:
        refusal = functools.partial(refuse_server_config, tuple(problems), ())
        HookRegistry.register(SERVER_ARGS_TARGET, refusal, HookType.AFTER)
        logger.error(
            "fusedrl token samples NOT enabled (sglang %s): %s. SGLang's sampler is left "
            "untouched and server start-up will be refused.",
            version,
            "; ".join(problems),
        )
        return

    # Every scheduler process needs these; the main process needs all of them.
    scheduler_targets = (SCHEDULER_ADMISSION_TARGET, SAMPLER_FORWARD_TARGET, target.path)
    all_targets = scheduler_targets + (ADMISSION_TARGET, SCHEDULER_INIT_TARGET)
    HookRegistry.register(
        SERVER_ARGS_TARGET,
        functools.partial(refuse_server_config, (), all_targets),
        HookType.AFTER,
    )
    HookRegistry.register(
        SCHEDULER_INIT_TARGET,
        functools.partial(refuse_missing_hooks, scheduler_targets),
        HookType.BEFORE,
    )
    HookRegistry.register(
        ADMISSION_TARGET, functools.partial(tokenizer_admission_hook, max_samples), HookType.AFTER
    )
    HookRegistry.register(
        SCHEDULER_ADMISSION_TARGET,
        functools.partial(scheduler_admission_hook, max_samples),
        HookType.AFTER,
    )
    HookRegistry.register(SAMPLER_FORWARD_TARGET, sampler_forward_hook, HookType.AROUND)
    HookRegistry.register(target.path, target.hook, HookType.AROUND)
    logger.warning(
        "fusedrl token samples enabled in process %d (sglang %s): patching %s (target for "
        "sglang %s); top_logprobs_num=K now returns the sampled token plus K draws for every "
        "request; refused with HTTP 400: K > %d (%s), truncated or greedy sampling with K > 0, "
        "and input ids outside the model's vocabulary; speculative decoding and watermarking "
        "are refused at start-up.",
        os.getpid(),
        version,
        target.path,
        target.versions,
        max_samples,
        MAX_SAMPLES_ENV_VAR,
    )


def find_draw_target() -> Optional[DrawTarget]:
    """The hook target that exists in the installed SGLang, newest first; None if neither."""
    try:
        from sglang.srt.layers.logprob_processor import OutputLogprobProcessor
    except ImportError:
        OutputLogprobProcessor = None
    if hasattr(OutputLogprobProcessor, "compute_logprobs"):
        return DrawTarget(COMPUTE_LOGPROBS_TARGET, compute_logprobs_hook, ">= 0.5.16")
    try:
        from sglang.srt.layers.sampler import Sampler
    except ImportError:
        return None
    if hasattr(Sampler, "_attach_logprobs_to_output"):
        return DrawTarget(ATTACH_LOGPROBS_TARGET, attach_logprobs_hook, "0.5.12 - 0.5.15")
    return None


def _sglang_version() -> str:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "unknown"
