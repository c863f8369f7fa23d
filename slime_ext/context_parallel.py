"""slime's context-parallel layouts of a packed micro-batch, as small pure functions.

slime (`slime/backends/megatron_utils/cp_utils.py`, `data.py: get_batch`) packs the samples of a
micro-batch (prompt + response tokens each) into one stream of logits rows, and under context
parallelism of size cp splits it in one of two ways:

- zigzag (default): each sample of `total_length` tokens is padded to a multiple of 2*cp and cut
  into 2*cp chunks of `ceil(total_length / (2*cp))`; rank r keeps chunks r and 2*cp-1-r, and the
  rank's logits are the concatenation, sample after sample, of its two chunks of each sample.
- allgather (`--allgather-cp`): all samples are concatenated into one global stream, which is
  padded and cut into cp equal contiguous pieces; rank r keeps piece r.

Logits row p predicts token p+1, so the response of a sample (tokens [P, total) with P the prompt
length) is predicted by rows [P-1, total-1); response position j is row P-1+j. Per-token response
tensors in slime's batch (advantages, old log-probs, ...) hold, per sample, the response positions
of the rank's zigzag chunks in chunk order; `loss_masks` hold the full response.

Every function takes the cp rank and size explicitly (`megatron.cp_rank_and_size()` reads
megatron-core's) so the layouts can be checked without any process group; `responses.ResponseTokens`
binds them to a micro-batch.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

Range = Tuple[int, int]


class ZigzagOffsets(NamedTuple):
    """Where one sample's pieces sit on one cp rank (all offsets from the sample's first token).

    chunk_size: tokens per chunk; chunks: the rank's two token chunks; logits: the response logits
    rows inside each chunk ((0, 0) when none); tokens: the target tokens of those rows (row + 1).
    """

    chunk_size: int
    chunks: Tuple[Range, Range]
    logits: Tuple[Range, Range]
    tokens: Tuple[Range, Range]


class SampleRows(NamedTuple):
    """One sample's response rows in this rank's packed logits.

    rows: indices into the rank's logits rows; positions: the response position (0-based) each row
    predicts. Both int64, same length, in slime's per-sample order (chunk 0 then chunk 1).
    """

    rows: torch.Tensor
    positions: torch.Tensor


def check_lengths(total_length: int, response_length: int) -> None:
    """A sample has at least one prompt token and a response no longer than itself."""
    if response_length < 0 or response_length > total_length - 1:
        raise ValueError(
            f"response_length must lie in [0, total_length - 1], got response_length={response_length} "
            f"with total_length={total_length}"
        )


def _check_cp(cp_rank: int, cp_size: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must lie in [0, cp_size) with cp_size >= 1, got cp_rank={cp_rank}, cp_size={cp_size}")


def zigzag_chunk_size(total_length: int, cp_size: int) -> int:
    """Tokens per zigzag chunk of a sample: ceil(total_length / (2 * cp))."""
    return -(-total_length // (2 * cp_size))


def zigzag_offsets(total_length: int, response_length: int, cp_rank: int, cp_size: int) -> ZigzagOffsets:
    """The rank's two chunks of a sample and the response logits rows and target tokens inside them."""
    check_lengths(total_length, response_length)
    _check_cp(cp_rank, cp_size)
    prompt_length = total_length - response_length
    size = zigzag_chunk_size(total_length, cp_size)
    chunks = (
        (cp_rank * size, (cp_rank + 1) * size),
        ((2 * cp_size - cp_rank - 1) * size, (2 * cp_size - cp_rank) * size),
    )
    logits, tokens = [], []
    for start, end in chunks:
        lo, hi = max(start, prompt_length - 1), min(end, total_length - 1)
        if lo < hi:
            logits.append((lo, hi))
            tokens.append((lo + 1, hi + 1))
        else:
            logits.append((0, 0))
            tokens.append((0, 0))
    return ZigzagOffsets(size, chunks, tuple(logits), tuple(tokens))


def response_ranges(total_length: int, response_length: int, cp_rank: int, cp_size: int) -> List[Range]:
    """Response positions [start, end) the rank holds, in layout order (empty ranges left out)."""
    if cp_size == 1:
        check_lengths(total_length, response_length)
        return [(0, response_length)] if response_length > 0 else []
    first_row = total_length - response_length - 1
    offsets = zigzag_offsets(total_length, response_length, cp_rank, cp_size)
    return [(lo - first_row, hi - first_row) for lo, hi in offsets.logits if hi > lo]


def slice_response(x, total_length: int, response_length: int, cp_rank: int, cp_size: int):
    """The rank's zigzag slice (dim 0) of a full-response-length tensor or list, as slime slices
    old log-probs and advantages; unchanged when cp = 1."""
    if len(x) != response_length:
        raise ValueError(f"x must have response_length = {response_length} entries, got {len(x)}")
    if cp_size == 1:
        return x
    parts = [x[start:end] for start, end in response_ranges(total_length, response_length, cp_rank, cp_size)]
    if isinstance(x, list):
        return [value for part in parts for value in part]
    return torch.cat(parts, dim=0) if parts else x[:0]


def local_response_rows(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    cp_rank: int,
    cp_size: int,
    *,
    allgather_cp: bool = False,
    local_length: Optional[int] = None,
    device=None,
) -> List[SampleRows]:
    """Per sample, the rank's logits rows that predict response tokens and which positions they
    predict, for the packed layout slime builds (cp = 1, zigzag, or allgather with `local_length`
    logits rows per rank)."""
    _check_cp(cp_rank, cp_size)
    if cp_size > 1 and allgather_cp:
        if local_length is None:
            raise ValueError("local_length (logits rows per rank) is required with allgather_cp")
        return _allgather_rows(total_lengths, response_lengths, cp_rank, local_length, device)
    samples, base = [], 0
    for total, response in zip(total_lengths, response_lengths, strict=True):
        first_row = total - response - 1
        rows, positions = [], []
        if cp_size == 1:
            check_lengths(total, response)
            rows.append(torch.arange(base + first_row, base + total - 1, device=device))
            positions.append(torch.arange(response, device=device))
            base += total
        else:
            offsets = zigzag_offsets(total, response, cp_rank, cp_size)
            for half, ((chunk_start, _), (lo, hi)) in enumerate(zip(offsets.chunks, offsets.logits)):
                local_start = base + half * offsets.chunk_size - chunk_start
                rows.append(torch.arange(local_start + lo, local_start + hi, device=device))
                positions.append(torch.arange(lo - first_row, hi - first_row, device=device))
            base += 2 * offsets.chunk_size
        samples.append(SampleRows(torch.cat(rows), torch.cat(positions)))
    return samples


def _allgather_rows(total_lengths, response_lengths, cp_rank, local_length, device) -> List[SampleRows]:
    """Response rows of each sample inside the rank's contiguous piece of the global stream."""
    piece_start, piece_end = cp_rank * local_length, (cp_rank + 1) * local_length
    samples, sample_start = [], 0
    for total, response in zip(total_lengths, response_lengths, strict=True):
        check_lengths(total, response)
        first_row = sample_start + total - response - 1
        lo, hi = max(first_row, piece_start), min(sample_start + total - 1, piece_end)
        hi = max(lo, hi)
        samples.append(
            SampleRows(
                torch.arange(lo - piece_start, hi - piece_start, device=device),
                torch.arange(lo - first_row, hi - first_row, device=device),
            )
        )
        sample_start += total
    return samples


def allgather_to_zigzag(
    values: Sequence[torch.Tensor],
    samples: Sequence[SampleRows],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    cp_rank: int,
    cp_size: int,
    group,
) -> List[torch.Tensor]:
    """Move per-sample values computed on allgather-CP rows into slime's zigzag layout.

    Each rank scatters its values into full-response zeros, one differentiable all-reduce (sum)
    over the cp group assembles every full response, and each rank keeps its zigzag slice; this is
    what slime does after its allgather-CP log-prob pass, gradients included.
    """
    from torch.distributed.nn.functional import all_reduce

    full = []
    for value, sample, response in zip(values, samples, response_lengths, strict=True):
        padded = value.new_zeros((response,) + tuple(value.shape[1:]))
        full.append(padded.index_copy(0, sample.positions.to(value.device), value))
    if not full:
        return []
    gathered = all_reduce(torch.cat(full, dim=0), group=group)
    return [
        slice_response(part, total, response, cp_rank, cp_size)
        for part, total, response in zip(gathered.split(list(response_lengths)), total_lengths, response_lengths)
    ]


def chunked_loss_masks(
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[torch.Tensor],
    cp_rank: int,
    cp_size: int,
) -> List[torch.Tensor]:
    """Each sample's loss mask restricted to the rank's zigzag response positions."""
    return [
        slice_response(mask, total, response, cp_rank, cp_size)
        for total, response, mask in zip(total_lengths, response_lengths, loss_masks, strict=True)
    ]


def sample_denominators(loss_masks: Sequence[torch.Tensor], rollout_mask_sums=None) -> List[torch.Tensor]:
    """slime's per-sample denominators: the rollout's mask total when given (`rollout_mask_sums`),
    else the sample's own mask total; clamped at 1."""
    if rollout_mask_sums is None:
        totals = [mask.sum() for mask in loss_masks]
    else:
        if len(rollout_mask_sums) != len(loss_masks):
            raise ValueError(
                f"rollout_mask_sums must have one entry per sample ({len(loss_masks)}), got {len(rollout_mask_sums)}"
            )
        totals = [torch.as_tensor(total, device=mask.device) for total, mask in zip(rollout_mask_sums, loss_masks)]
    return [torch.clamp_min(total, 1) for total in totals]
