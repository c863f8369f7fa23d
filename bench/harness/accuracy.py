"""Relative L2 error of outputs and gradients against a float64 truth, accumulated over chunks."""


class RelativeError:
    """Accumulates |value - truth|^2 and |truth|^2 per named quantity."""

    def __init__(self):
        self._squares = {}

    def add(self, name, value, truth):
        diff, ref = self._squares.get(name, (0.0, 0.0))
        value, truth = value.detach().double(), truth.detach().double()
        self._squares[name] = (diff + (value - truth).square().sum().item(), ref + truth.square().sum().item())

    def __getitem__(self, name) -> float:
        diff, ref = self._squares[name]
        return (diff / ref) ** 0.5 if ref > 0 else diff**0.5

    def worst(self, *names) -> float:
        return max(self[name] for name in names if name in self._squares)
