"""Benchmark cases: the shapes RL training uses on a GPU, scaled down for the CPU interpreter.

Token statistics: T tokens per micro-batch, V the vocabulary columns one tensor-parallel rank
holds (Qwen3's 151936 at tp 1, 2, 4), the logits dtype, J ids per row (1 = sampled token, 9 =
sampled + 8 centering draws) and whether the entropy is computed. Aggregation (segmented masked
sum): the same T, a few loss channels, samples of a few hundred tokens.
"""

import itertools
from dataclasses import dataclass

import torch

OPS = ("token_stats", "segment_sum", "linear_token_stats", "token_draws")
# The LM head and the rollout side's draws (bench/rollout_draws.py) are opt-in: --op NAME.
DEFAULT_OPS = ("token_stats", "segment_sum")
PHASES = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# How many times the logits cross memory at minimum: forward reads them once; backward reads them
# once and writes the gradient once.
FLOOR_PASSES = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}


@dataclass(frozen=True)
class Case:
    """One token-statistics problem."""

    op = "token_stats"
    tokens: int
    vocab: int
    dtype: str
    ids_per_row: int
    entropy: bool
    temperature: float = 1.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def input_bytes(self) -> int:
        """Bytes of the logits."""
        return self.tokens * self.vocab * self.torch_dtype.itemsize

    def floor_bytes(self, phase: str) -> int:
        """The bytes any implementation must move for `phase`: the logits (and gradient) once."""
        return FLOOR_PASSES[phase] * self.input_bytes

    @property
    def label(self) -> str:
        return f"T={self.tokens} V={self.vocab} {self.dtype} J={self.ids_per_row}" + (" +H" if self.entropy else "")

    def fields(self) -> dict:
        return dict(tokens=self.tokens, vocab=self.vocab, dtype=self.dtype, ids_per_row=self.ids_per_row,
                    entropy=self.entropy, temperature=self.temperature)  # fmt: skip


@dataclass(frozen=True)
class SegmentCase:
    """One aggregation problem: per-token values [T, C] (fp32, as slime's per-token losses), a
    float mask, int64 segment (sample) ids, S fp32 denominators."""

    op = "segment_sum"
    tokens: int
    channels: int = 4  # pg_loss, entropy, approximate KL, clip fraction
    sample_tokens: int = 256  # mean tokens per sample
    dtype = "fp32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def segments(self) -> int:
        return max(1, self.tokens // self.sample_tokens)

    @property
    def input_bytes(self) -> int:
        """Bytes of the values."""
        return self.tokens * self.channels * self.torch_dtype.itemsize

    def floor_bytes(self, phase: str) -> int:
        """Forward reads values, mask, segment ids and denominators once; backward reads mask, ids
        and denominators and writes the gradient once."""
        one_pass = self.input_bytes + self.tokens * (4 + 8) + self.segments * 4
        return 2 * one_pass if phase == "fwd+bwd" else one_pass

    @property
    def label(self) -> str:
        return f"segsum T={self.tokens} C={self.channels} S={self.segments}"

    def fields(self) -> dict:
        return dict(tokens=self.tokens, channels=self.channels, segments=self.segments, dtype=self.dtype)


@dataclass(frozen=True)
class Grid:
    """Axes of a case grid; `cases()` is their product."""

    tokens: tuple
    vocabs: tuple
    dtypes: tuple
    ids_per_row: tuple
    entropy: tuple

    def cases(self, temperature=1.0):
        axes = (self.tokens, self.vocabs, self.dtypes, self.ids_per_row, self.entropy)
        return [Case(*values, temperature=temperature) for values in itertools.product(*axes)]


GPU_GRID = Grid((4096, 16384), (151936, 75968, 37984), ("fp32", "bf16"), (1, 9), (False, True))
# The interpreter is ~10^5 times slower than a GPU: a 128x smaller T and an 8x smaller V keep the
# ratios between cases (and a V that is not a multiple of the block) at interpreter speed.
CPU_GRID = Grid((32, 128), (18992, 9496, 4748), ("fp32", "bf16"), (1, 9), (False, True))


# The aggregation is cheap enough for the interpreter at full size.
SEGMENT_TOKENS = (4096, 16384)


def default_cases(grid: Grid, temperature=1.0):
    """Every T x V x dtype for plain log-probs (J = 1, no entropy), and at the largest fp32 shape
    the J = 9 and entropy variants."""
    plain = Grid(grid.tokens, grid.vocabs, grid.dtypes, (1,), (False,)).cases(temperature)
    largest = Grid((max(grid.tokens),), (max(grid.vocabs),), ("fp32",), grid.ids_per_row, grid.entropy)
    extras = [case for case in largest.cases(temperature) if case not in plain]
    return plain + extras
