"""The sampled token plus K random draws from the distribution it was sampled from.

SGLang hands its logprob step `logprobs = log p` over the full vocabulary, where `p` is the
temperature-scaled distribution the batch's tokens were just sampled from. For every row that
asked for `K > 0` top-logprobs this module returns, instead of the top-K, the sampled token
followed by `K` independent draws from `p`, each paired with its log-probability.

Randomness, vectorised over the batch:
- Rows without a sampling seed (SGLang sets seeds only under deterministic inference) draw with
  one `torch.multinomial(p_rows, K_max, replacement=True)` call on the global generator, the
  same generator SGLang's own unseeded sampling uses.
- Seeded rows must be reproducible per request whatever else shares the batch, which one
  `torch.Generator` per call cannot give. They invert the CDF at counter-based uniforms: a
  murmur3 hash of (seed, position, stream) as in SGLang's `multinomial_with_seed`, with streams
  numbered from the vocabulary size up, so they never reuse the hash inputs SGLang spent on the
  sampled token. A row's draws depend only on its seed, its position and the distribution.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

_MASK32 = 0xFFFFFFFF
_TWO_POW_53 = float(2**53)


def draw_token_samples(
    logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    num_samples: Sequence[int],
    *,
    seeds: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    logprobs_are_probs: bool = False,
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per row: [sampled token, K_i draws from the row's distribution] and their logprobs.

    logprobs: [B, V] log-probabilities of the sampling distribution (or, with
        `logprobs_are_probs`, the probabilities themselves, as some SGLang 0.5.1x versions pass).
    sampled_ids: [B] the tokens SGLang sampled.
    num_samples: B ints, K_i >= 0 draws for row i.
    seeds, positions: [B] integer tensors, SGLang's per-request sampling seeds and token
        positions; with seeds the draws are reproducible (see the module docstring).
    Returns (values, ids): two lists of B 1-D tensors; row i holds 1 + K_i entries when K_i > 0
    (its sampled token first) and none otherwise, the per-row layout SGLang's top-logprobs take.
    """
    batch = logprobs.shape[0]
    rows = [i for i, k in enumerate(num_samples) if k > 0]
    empty_values = logprobs.new_empty((0,))
    empty_ids = torch.empty((0,), dtype=torch.long, device=logprobs.device)
    values: List[torch.Tensor] = [empty_values] * batch
    ids: List[torch.Tensor] = [empty_ids] * batch
    if not rows:
        return values, ids

    row_index = torch.tensor(rows, dtype=torch.long, device=logprobs.device)
    selected = logprobs if len(rows) == batch else logprobs.index_select(0, row_index)
    # fp32 weights: multinomial and the CDF need no more, and bf16 logprobs (RL on-policy mode)
    # would round the probabilities of the tail.
    weights = selected.float() if logprobs_are_probs else selected.float().exp()
    max_k = max(num_samples)
    if seeds is None:
        draws = torch.multinomial(weights, max_k, replacement=True)
    else:
        draws = _seeded_draws(weights, seeds[row_index], positions[row_index], max_k)

    chosen = sampled_ids.index_select(0, row_index).long().unsqueeze(1)
    row_ids = torch.cat([chosen, draws], dim=1)
    row_values = selected.gather(1, row_ids)
    if logprobs_are_probs:
        row_values = row_values.log().clamp_(min=torch.finfo(row_values.dtype).min)
    for j, i in enumerate(rows):
        values[i] = row_values[j, : 1 + num_samples[i]]
        ids[i] = row_ids[j, : 1 + num_samples[i]]
    return values, ids


def _seeded_draws(
    weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, num_draws: int
) -> torch.Tensor:
    """[n, num_draws] indices drawn from rows of `weights` by inverse CDF at hashed uniforms."""
    vocab = weights.shape[1]
    cdf = torch.cumsum(weights.double(), dim=1)
    total = cdf[:, -1:]
    uniforms = seeded_uniforms(seeds, positions, first_stream=vocab, count=num_draws)
    # Stay strictly below the total so the search never runs past the last token with mass.
    targets = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).clamp_(max=vocab - 1)


def seeded_uniforms(
    seeds: torch.Tensor, positions: torch.Tensor, *, first_stream: int, count: int
) -> torch.Tensor:
    """[n, count] float64 uniforms in (0, 1), a pure function of (seed, position, stream).

    Each uniform takes 53 bits from two 32-bit murmur3 hashes (streams first_stream + 2j and
    first_stream + 2j + 1), so no probability is coarser than 2**-53.
    """
    streams = torch.arange(count, dtype=torch.long, device=seeds.device) * 2 + first_stream
    high = _murmur3(seeds, positions, streams)
    low = _murmur3(seeds, positions, streams + 1)
    bits = high.double() * float(2**21) + (low >> 11).double()
    return (bits + 0.5) / _TWO_POW_53


def _murmur3(seeds: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """[n, m] murmur3 hashes of the 16-byte keys (seed low, seed high, position, stream).

    Works on int64 tensors holding 32-bit values so that it runs on any device; products are
    split into 16-bit halves so no intermediate leaves the int64 range.
    """
    seeds = seeds.long()
    seed_low = (seeds & _MASK32).unsqueeze(1)
    seed_high = ((seeds >> 32) & _MASK32).unsqueeze(1)
    position = (positions.long() & _MASK32).unsqueeze(1)
    stream = (streams.long() & _MASK32).unsqueeze(0)
    state = torch.zeros_like(seed_low)
    for word in (seed_low, seed_high, position, stream):
        state = _mix_word(state, word)
    state = state ^ 16
    return _finalize(state)


def _mix_word(state: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    word = _mul32(word, 0xCC9E2D51)
    word = _rotl32(word, 15)
    word = _mul32(word, 0x1B873593)
    state = _rotl32(state ^ word, 13)
    return (_mul32(state, 5) + 0xE6546B64) & _MASK32


def _finalize(state: torch.Tensor) -> torch.Tensor:
    state = state ^ (state >> 16)
    state = _mul32(state, 0x85EBCA6B)
    state = state ^ (state >> 13)
    state = _mul32(state, 0xC2B2AE35)
    return state ^ (state >> 16)


def _mul32(value: torch.Tensor, constant: int) -> torch.Tensor:
    """(value * constant) mod 2**32 for 32-bit values, without int64 overflow."""
    low = value * (constant & 0xFFFF)
    high = ((value * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _rotl32(value: torch.Tensor, shift: int) -> torch.Tensor:
    return ((value << shift) | (value >> (32 - shift))) & _MASK32
