"""Start-up checks: a server the token-sample mode cannot serve faithfully does not start.

SGLang's `load_plugins()` only logs a plugin that raises and `HookRegistry.apply_hooks()` only
logs a hook it could not apply, so neither can stop a server. These checks run from hooks whose
exceptions SGLang does not swallow:
- `refuse_server_config` (AFTER `ServerArgs.check_server_args`, main process, before any
  subprocess starts): settings the mode cannot serve, and any hook of this plugin that did not
  land in that process.
- `refuse_missing_hooks` (BEFORE `Scheduler.__init__`, every scheduler process, which loads
  plugins on its own): the hooks that process needs; a raise there fails the server's start-up.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

from .constraints import server_refusal


def refuse_server_config(
    load_problems: Sequence[str], targets: Sequence[str], result, server_args, *args, **kwargs
) -> None:
    """Raise ValueError listing every reason this server cannot serve true draws."""
    problems = list(load_problems) + server_problems(server_args) + landing_problems(targets)
    problems = list(dict.fromkeys(problems))  # a load-time problem can also be a server one
    if problems:
        raise ValueError(server_refusal("; ".join(problems)))
    return None


def refuse_missing_hooks(targets: Sequence[str], *args, **kwargs) -> None:
    """Raise ValueError naming the hooks of `targets` that are not applied in this process."""
    problems = landing_problems(targets)
    if problems:
        raise ValueError(server_refusal("; ".join(problems)))
    return None


def landing_problems(targets: Sequence[str]) -> List[str]:
    """One sentence for the targets SGLang's HookRegistry has not patched in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [target for target in targets if target not in HookRegistry._patched]
    if not missing:
        return []
    return [
        f"SGLang did not apply the plugin's hooks on {', '.join(missing)} in process "
        f"{os.getpid()} (its log says why)"
    ]


def server_problems(server_args) -> List[str]:
    """Server settings under which the draws would not match the sampled tokens."""
    problems = []
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm is not None and str(algorithm).upper() != "NONE":
        problems.append(
            f"speculative decoding (speculative_algorithm={algorithm}) samples tokens outside "
            "the hooked sampler"
        )
    if getattr(server_args, "enable_watermark", False):
        problems.append(
            "watermarking (enable_watermark) samples from watermarked logits while the "
            "logprobs describe the pre-watermark ones"
        )
    problem = original_logprob_problem()
    if problem is not None:
        problems.append(problem)
    return problems


def original_logprob_problem() -> Optional[str]:
    """SGLANG_RETURN_ORIGINAL_LOGPROB hands the logprob step pre-temperature values."""
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").strip().lower() in ("1", "true"):
        return "SGLANG_RETURN_ORIGINAL_LOGPROB=1 makes the logprobs untempered"
    return None
