"""Progress of a long run on stderr: what finished, how long it took, and an estimate of the time left.

Steps can weigh differently (a case with 4x the logits takes about 4x as long): the estimate scales
the time spent so far by the weight still to come.
"""

import sys
import time


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Progress:
    """Report `steps` steps of known relative weights, one line per finished step."""

    def __init__(self, weights, stream=None):
        self.weights = list(weights)
        self.stream = stream or sys.stderr
        self.done = 0
        self.done_weight = 0.0
        self.started = time.perf_counter()
        self.step_started = self.started

    def finished(self, what: str) -> None:
        """Step number `done + 1` is over; print it with the elapsed time and the estimate."""
        now = time.perf_counter()
        self.done_weight += self.weights[self.done]
        self.done += 1
        elapsed = now - self.started
        left_weight = sum(self.weights[self.done :])
        line = f"[{self.done}/{len(self.weights)}] {what}: {now - self.step_started:.1f} s; elapsed {_clock(elapsed)}"
        if left_weight and self.done_weight:
            line += f", about {_clock(elapsed * left_weight / self.done_weight)} left"
        print(line, file=self.stream, flush=True)
        self.step_started = now
