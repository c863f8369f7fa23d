"""SFC's refused training samples: counted where slime's rollout runs, logged with slime's rollout
metrics, and an error past --sfc-max-refused-frac.

SFC's generate (`sfc_draws.generate`) refuses a sample it cannot give draws and ages (an engine
that no push has reached, a malformed /generate answer): it raises, which stops slime's default
rollout at once, while slime's fully asynchronous worker (`slime/rollout/fully_async_rollout.py`)
only logs the exception and drops the group. So every refusal is also counted here, and
`log_rollout_data`, slime's --custom-rollout-log-function-path (installed by the SFC flag checks,
`flags/sfc.py`, which move a user's own log function behind it), adds each rollout's counts to the
metrics slime logs (`sfc/refused_samples`, `sfc/refused_frac`, `sfc/refused_<cause>`) and raises
once the refused fraction of the rollout's samples exceeds --sfc-max-refused-frac (default 0).
"""

import copy
import threading
from collections import Counter
from typing import Dict, Tuple

from ..callables import load_function

LOG_PATH = "fusedrl.slime_ext.rollout.refusals.log_rollout_data"
USER_LOG_ATTR = "fusedrl_user_rollout_log_function_path"


class RefusedSample(ValueError):
    """A training sample SFC's rollout side refuses; `cause` names it in the metrics."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


class Tally:
    """Training samples SFC's generate accepted and refused (by cause) since the last rollout log;
    generate may run on several threads (slime's fully asynchronous worker)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accepted = 0
        self._refused: Counter = Counter()
        self._first: Dict[str, str] = {}  # cause -> the first refusal's message

    def accept(self) -> None:
        with self._lock:
            self._accepted += 1

    def refuse(self, refusal: RefusedSample) -> None:
        with self._lock:
            self._refused[refusal.cause] += 1
            self._first.setdefault(refusal.cause, str(refusal))

    def take(self) -> Tuple[int, Counter, Dict[str, str]]:
        """(accepted, refused by cause, each cause's first message) since the last call; the
        counts start again from zero."""
        with self._lock:
            counts = self._accepted, self._refused, self._first
            self._accepted, self._refused, self._first = 0, Counter(), {}
        return counts


TALLY = Tally()


def refusal_metrics(accepted: int, refused: Counter) -> Dict[str, float]:
    """The rollout's refusal metrics, named as slime's logger shows them."""
    total_refused = sum(refused.values())
    seen = accepted + total_refused
    metrics = {"sfc/refused_samples": float(total_refused), "sfc/refused_frac": total_refused / seen if seen else 0.0}
    metrics.update({f"sfc/refused_{cause}": float(count) for cause, count in sorted(refused.items())})
    return metrics


def max_refused_frac(args) -> float:
    value = getattr(args, "sfc_max_refused_frac", None)
    return 0.0 if value is None else float(value)


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    """slime's --custom-rollout-log-function-path: slime's own logging of the rollout (the user's
    log function included, as slime runs it), with the rollout's refusal counts among its extra
    metrics; then ValueError once the refused fraction exceeds --sfc-max-refused-frac."""
    # slime's own rollout logging, as the rollout manager that called this hook imports it (slime
    # 624b824 defines it in slime/observability/rollout_metrics.py)
    from slime.ray.rollout import log_rollout_data as slime_log_rollout_data

    accepted, refused, first = TALLY.take()
    metrics = refusal_metrics(accepted, refused)
    logged_args = copy.copy(args)
    logged_args.custom_rollout_log_function_path = getattr(args, USER_LOG_ATTR, None)
    slime_log_rollout_data(rollout_id, logged_args, samples, {**(rollout_extra_metrics or {}), **metrics}, rollout_time)
    if metrics["sfc/refused_frac"] > max_refused_frac(args):
        causes = "; ".join(f"{count} {cause}, the first: {first[cause]}" for cause, count in sorted(refused.items()))
        raise ValueError(
            f"SFC refused {int(metrics['sfc/refused_samples'])} of the {accepted + sum(refused.values())} training "
            f"samples generated for rollout {rollout_id}, a fraction over --sfc-max-refused-frac "
            f"{max_refused_frac(args)}: {causes}"
        )
    return True  # logged above
