"""The sampled token plus K random draws from the distribution it was sampled from.

SGLang hands its logprob step `logprobs = log p` over the full vocabulary, where `p` is the
temperature-scaled distribution the batch's tokens were just sampled from. For every row that
asked for `K > 0` top-logprobs this module returns, instead of the top-K, the sampled token
followed by `K` independent draws from `p`, each paired with its log-probability.

Randomness, vectorised over the batch:
- Rows without a sampling seed (SGLang sets seeds only under deterministic inference) draw from
  the global generator, the one SGLang's own unseeded sampling uses.
- Seeded rows must be reproducible per request whatever else shares the batch, which one
  `torch.Generator` per call cannot give. They invert the CDF at counter-based uniforms: a
  murmur3 hash of (seed, position, stream) as in SGLang's `multinomial_with_seed`, with streams
  numbered from the vocabulary size up, so they never reuse the hash inputs SGLang spent on the
  sampled token. A row's draws depend only on its seed, its position and the distribution.

Two paths, the same draws for the same uniforms: on CUDA the fused kernel `fusedrl.kernels.token_draws` inverts the CDF reading each row once, with no `[B, V]`
buffer, at uniforms from the global generator or the hash; on CPU the torch path, one
`torch.multinomial` call for unseeded rows and the float64 reference inverse CDF
(`token_draws_reference`) for seeded ones.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from fusedrl.kernels import token_draws, token_draws_reference

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
    use_kernel: Optional[bool] = None,
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per row: [sampled token, K_i draws from the row's distribution] and their logprobs.

    logprobs: [B, V] log-probabilities of the sampling distribution (or, with
        `logprobs_are_probs`, the probabilities themselves, as some SGLang 0.5.1x versions pass).
    sampled_ids: [B] the tokens SGLang sampled.
    num_samples: B ints, K_i >= 0 draws for row i.
    seeds, positions: [B] integer tensors, SGLang's per-request sampling seeds and token
        positions; with seeds the draws are reproducible (see the module docstring).
    use_kernel: None picks the path by device (the kernel on CUDA, the torch path elsewhere);
        True or False forces one (the benchmark measures both; the kernel on CPU needs the Triton
        interpreter).
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
    max_k = max(num_samples)
    if use_kernel is None:
        use_kernel = _runs_the_kernel(logprobs)
    if use_kernel:
        draws = _kernel_draws(logprobs, row_index, max_k, seeds, positions, logprobs_are_probs)
        row_ids = torch.cat([sampled_ids.index_select(0, row_index).long().unsqueeze(1), draws], dim=1)
        row_values = logprobs[row_index.unsqueeze(1), row_ids]
    else:
        row_ids, row_values = _torch_path(logprobs, sampled_ids, row_index, max_k, seeds, positions, logprobs_are_probs)
    if logprobs_are_probs:
        row_values = row_values.log().clamp_(min=torch.finfo(row_values.dtype).min)
    for j, i in enumerate(rows):
        values[i] = row_values[j, : 1 + num_samples[i]]
        ids[i] = row_ids[j, : 1 + num_samples[i]]
    return values, ids


def _runs_the_kernel(logprobs: torch.Tensor) -> bool:
    """CUDA rows take the fused kernel; CPU rows the torch path (the kernel interpreted would
    cost a CPU server seconds per step; tests/test_sglang/test_sglang_draws.py runs it there)."""
    return logprobs.is_cuda


def _kernel_draws(logprobs, row_index, num_draws, seeds, positions, logprobs_are_probs) -> torch.Tensor:
    """[n, num_draws] ids from the fused kernel, at hashed uniforms for seeded rows and the global
    generator's otherwise; one host sync, to refuse a row without mass (NaN or all -inf)."""
    if seeds is None:
        uniforms = torch.rand((row_index.numel(), num_draws), dtype=torch.float64, device=logprobs.device)
    else:
        uniforms = seeded_uniforms(seeds[row_index], positions[row_index], first_stream=logprobs.shape[1], count=num_draws)
    draws = token_draws(logprobs, uniforms, rows=row_index, logprobs_are_probs=logprobs_are_probs, validate=False)
    if bool((draws < 0).any()):
        raise ValueError("a row's sampling distribution has no finite, positive mass (NaN or every entry -inf)")
    return draws


def _torch_path(logprobs, sampled_ids, row_index, num_draws, seeds, positions, logprobs_are_probs):
    """(ids, values) [n, 1 + num_draws] on CPU: torch.multinomial for unseeded rows, the float64
    reference inverse CDF at hashed uniforms for seeded ones."""
    selected = logprobs if row_index.numel() == logprobs.shape[0] else logprobs.index_select(0, row_index)
    if seeds is None:
        # fp32 weights: multinomial needs no more, and bf16 logprobs (RL on-policy mode) would
        # round the probabilities of the tail.
        weights = selected.float() if logprobs_are_probs else selected.float().exp()
        draws = torch.multinomial(weights, num_draws, replacement=True)
    else:
        uniforms = seeded_uniforms(seeds[row_index], positions[row_index], first_stream=logprobs.shape[1], count=num_draws)
        every_row = torch.arange(selected.shape[0], device=selected.device)
        draws = token_draws_reference(selected, uniforms, every_row, logprobs_are_probs)
    row_ids = torch.cat([sampled_ids.index_select(0, row_index).long().unsqueeze(1), draws], dim=1)
    return row_ids, selected.gather(1, row_ids)


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
