"""Progress of a long run on stderr: what finished, how long it took, and an estimate of the time left.

Steps are of kinds (a benchmark's ops, a study's methods): a step still to come is expected to take
as long as the steps of its kind took on average so far, or, before any of its kind finished, as
the steps of every kind did. Measured, not modelled: sizes predict poorly how long a step takes
(on CPU the interpreter's per-launch overhead dominates, and a first step pays one-off start-up
costs that the average soon dilutes).
"""

import statistics
import sys
import time


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Progress:
    """Report steps of the given `kinds`, one line per finished step."""

    def __init__(self, kinds, stream=None):
        self.kinds = list(kinds)
        self.stream = stream or sys.stderr
        self.took = {}  # kind -> seconds of each finished step of that kind
        self.done = 0
        self.started = time.perf_counter()
        self.step_started = self.started

    def expect_next(self, kinds) -> None:
        """Steps of these `kinds`, unknown at the start, come next, before the known ones to come."""
        self.kinds[self.done : self.done] = kinds

    def plan(self, kinds) -> None:
        """The steps still to come are exactly these `kinds`: the start's list was an estimate."""
        self.kinds[self.done :] = kinds

    def time_left(self) -> float:
        """Seconds the steps still to come should take, at the average of the finished ones."""
        every = statistics.fmean(seconds for times in self.took.values() for seconds in times)
        return sum(statistics.fmean(self.took[kind]) if kind in self.took else every for kind in self.kinds[self.done :])

    def finished(self, what: str) -> None:
        """Step number `done + 1` is over; print it with the elapsed time and the estimate."""
        now = time.perf_counter()
        self.took.setdefault(self.kinds[self.done], []).append(now - self.step_started)
        self.done += 1
        line = f"[{self.done}/{len(self.kinds)}] {what}: {now - self.step_started:.1f} s; elapsed {_clock(now - self.started)}"
        if self.done < len(self.kinds):
            line += f", about {_clock(self.time_left())} left"
        print(line, file=self.stream, flush=True)
        self.step_started = now
