"""Fused per-token statistics over vocabulary-parallel logits: log-probs of J ids, entropy, scores.

Why two kernels and one collective. The forward streams each row once with an online softmax and
emits `3 + J` per-row partials (the raw row max `m`, the exp-sum `s` and exp-weighted centered sum
`u` around it in log2 units; then the J gathered raw logits). Under tensor parallelism those
partials are all-gathered once (`[tp, N, 3 + J]` floats, nothing of size V) and combined locally,
so tp = 1 is the same code without the collective. Every loss in scope depends on a row only
through `logp[:, j]` and `entropy`, so the backward is one more streaming pass that writes
`dz' = sum_j c_j e_{id_j} + p * (-G - g_H (z' - E_p[z']))` (see docs/math.md) from the saved
per-row softmax state: no collective, each gradient element rounded once from fp32 (a bf16
read-modify-write of an id column would lose its one-hot term), and the softmax term skipped for
rows whose coefficients vanish (a purely centered score on a fresh token).

Why everything is relative to the row max. Every exponent is formed from a raw difference to the
row max, `(x - m) log2(e) / T`, exact near the max, and the saved state is (m, log2 of the
exp-sum, E_p[x - m] / T): small numbers. A kernel that forms `x log2(e) / T - lse` instead loses
`|lse| 2^-24` in every probability, which at low temperature (|logits| / T in the hundreds) is 50x
eager PyTorch's fp32 error (tests/test_kernels/test_token_stats_scale.py).

Layers: the Triton kernels; their host launches (`row_partials`, `logits_grad`), which allocate
and launch; the torch.library ops `fusedrl::token_stats` and `fusedrl::token_stats_backward` over
them, with fake implementations and registered autograd (what torch.compile sees); and
`token_stats`, which checks the input, picks the path and resolves the tensor-parallel group.

Why the loops look as they do: the static cost model (`python -m bench --static`) showed the
first version bound by instruction issue, not memory, in bf16; the README has its figures before
and after.
"""

from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ._contract import KERNEL_DTYPES, TokenStats, as_2d_logits, check_no_self_overlap, check_token_stats_inputs
from ._dispatch import _INTERPRETED_AT_IMPORT, tl, triton, uses_triton
from ._tp import group_name, resolve_tp, tp_from_group_name
from .reference import token_stats_reference

LOG2E = 1.4426950408889634  # the kernels work in log2 units (ex2 is the hardware exp)
LN2 = 0.6931471805599453  # back to natural units, once per row on the host
# -inf logits are raised to FLOOR where they multiply their probability of 0, so the product is 0,
# not 0 * -inf = NaN; FLOOR is far enough from fp32's limit that coefficients up to 1e20 keep the
# factor finite, and far below any logit whose probability is not 0 anyway.
FLOOR = tl.constexpr(-1e18)
# Compiled kernels take the 2-byte row max two elements per instruction (`_pair_max`); the
# interpreter has no inline PTX.
PACKED_MAX = tl.constexpr(not _INTERPRETED_AT_IMPORT)
# Id pairs the backward's repeated-id sums compare at once: a [J_BLOCK, chunk] tile (`id_chunk`).
ID_PAIRS = 1024


class _Tile(NamedTuple):
    """How one program streams a row: [SLOTS, VEC] elements per trip, VEC contiguous columns per
    slot (one 128-bit access) and SLOTS = slots_per_thread * threads, so a thread owns
    slots_per_thread slots THREADS * VEC columns apart and every reduction over VEC stays in its
    registers. A 2-D tile whose only contiguous axis is the last leaves the compiler one layout
    (each thread a row of VEC, threads along the slots) on every Triton version."""

    slots_per_thread: int
    threads: int
    vec: int
    num_warps: int

    @property
    def slots(self) -> int:
        return self.slots_per_thread * self.threads

    @property
    def block(self) -> int:
        return self.slots * self.vec

    def full_trips_end(self, vocab_local: int) -> int:
        """Where the unmasked trips end: the kernels mask only the one partial trip after it
        (computed once on the host, not in every program)."""
        return vocab_local - vocab_local % self.block


def tile_for(vocab_local: int, element_size: int) -> _Tile:
    """The launch shape for a row of vocab_local columns of element_size bytes.

    16 elements per thread per trip and 8 warps at large V (`python -m bench --static` at
    V = 151936: 8 per thread costs more loop overhead per element, 32 per thread more registers
    and less occupancy). Small rows take fewer warps so a trip is not mostly mask.
    """
    vec = 16 // element_size
    slots_per_thread = max(1, 16 // vec)
    num_warps = 8
    while num_warps > 1 and slots_per_thread * 32 * num_warps * vec > 2 * triton.next_power_of_2(vocab_local):
        num_warps //= 2
    return _Tile(slots_per_thread, 32 * num_warps, vec, num_warps)


def id_chunk(id_block: int) -> int:
    """Slots each id of a row is compared with at once in the backward's repeated-id sums: a
    [id_block, chunk] tile of at most ID_PAIRS pairs (4 per thread at 8 warps). All of them up to
    J = 32; J = 129 (a top-128 head) in 33 chunks of 4, at the registers of J = 1, where one [256,
    256] tile took 255 registers and spilled (`python -m bench --static`)."""
    return max(1, min(id_block, ID_PAIRS // id_block))


def kernel_scale(temperature: float) -> float:
    """log2(e) / temperature: the one factor from raw logit differences to log2 units, shared by
    the kernels (as fp32) and the host combine, so both round it alike."""
    return LOG2E / temperature


@triton.jit
def _tile_offsets(SLOTS: tl.constexpr, VEC: tl.constexpr):
    """Column offsets of one trip's [SLOTS, VEC] tile."""
    return tl.arange(0, SLOTS)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _load_tile(row_ptr, cols, vocab_local, other, MASKED: tl.constexpr):
    """One trip's logits as fp32; only the row's last, partial trip is masked."""
    if MASKED:
        x = tl.load(row_ptr + cols, mask=cols < vocab_local, other=other, eviction_policy="evict_first")
    else:
        x = tl.load(row_ptr + cols, eviction_policy="evict_first")
    return x


@triton.jit
def _pair_max(a, b, PACKED: tl.constexpr):
    """Elementwise max of two 2-byte tiles, in their dtype. Compiled: one max.bf16x2 / max.f16x2
    per two elements, where tl.maximum widens each element to fp32 first (a PRMT or shift per
    element before its FMNMX); exact, as max commutes with widening. Interpreted (no inline PTX):
    tl.maximum of the widened pair, the same values (Triton 3.9's interpreter compares bf16 tiles
    wrongly: max(-0.72, 1.54) = -0.72)."""
    if not PACKED:
        result = tl.maximum(a.to(tl.float32), b.to(tl.float32)).to(a.dtype)
    elif a.dtype == tl.bfloat16:
        result = tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=a.dtype, is_pure=True, pack=2)
    else:
        result = tl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=a.dtype, is_pure=True, pack=2)
    return result


@triton.jit
def _halves_max(x, SLOTS: tl.constexpr, WIDTH: tl.constexpr, PACKED: tl.constexpr):
    """[SLOTS, WIDTH] -> [SLOTS, WIDTH / 2]: the max of each slot's first and second half, column
    by column (both halves in the same thread's registers: no data moves)."""
    low, high = tl.split(tl.permute(tl.reshape(x, [SLOTS, 2, WIDTH // 2]), (0, 2, 1)))
    return _pair_max(low, high, PACKED)


@triton.jit
def _slot_max(x):
    """Each slot's max over its raw logits x [SLOTS, VEC], as fp32. 2-byte logits (VEC = 8) are
    halved twice in their own dtype and only the last two widened."""
    SLOTS: tl.constexpr = x.shape[0]
    VEC: tl.constexpr = x.shape[1]
    if x.dtype.primitive_bitwidth == 16 and VEC == 8:
        x = _halves_max(_halves_max(x, SLOTS, VEC, PACKED_MAX), SLOTS, VEC // 2, PACKED_MAX)
    return tl.max(x.to(tl.float32), axis=1)


@triton.jit
def _rebase(running_max, reference, exp_sum, centered_sum, scale, WITH_ENTROPY: tl.constexpr):
    """Per-slot sums around `reference` instead of `running_max` (log2 units): the exp-sum scales
    by 2^((m - r) s) and every centered term moves by (m - r) s. An empty slot (sum 0, max -inf)
    moves by 0, not 0 * -inf."""
    rescale = tl.exp2((running_max - reference) * scale)
    if WITH_ENTROPY:
        moved = exp_sum * ((tl.where(exp_sum == 0.0, reference, running_max) - reference) * scale)
        centered_sum = rescale * (centered_sum + moved)
    return exp_sum * rescale, centered_sum


@triton.jit
def _online_softmax_step(x, running_max, exp_sum, centered_sum, scale, WITH_ENTROPY: tl.constexpr):
    """One trip of the per-slot online softmax: x [SLOTS, VEC] raw logits in.

    Exponents are formed from raw differences to the slot max, (x - m) * s, which are exact near
    the max, never from x * s minus a large reference, whose rounding would grow with |logits| / T.
    """
    new_max = tl.maximum(running_max, _slot_max(x))
    x = x.to(tl.float32)
    # A slot that has seen only -inf keeps sums of 0 around any finite reference; 0 keeps
    # -inf - -inf = NaN out of the rebase.
    reference = tl.where(new_max == float("-inf"), 0.0, new_max)
    exp_sum, centered_sum = _rebase(running_max, reference, exp_sum, centered_sum, scale, WITH_ENTROPY)
    shifted = (x - reference[:, None]) * scale
    e = tl.exp2(shifted)
    if WITH_ENTROPY:
        # -inf columns add e = 0 times FLOOR, not 0 * -inf.
        centered_sum += tl.sum(e * tl.maximum(shifted, FLOOR), axis=1)
    return new_max, exp_sum + tl.sum(e, axis=1), centered_sum


@triton.jit
def _token_stats_fwd_kernel(
    logits_ptr,
    stride_row,
    ids_ptr,
    rows_ptr,
    partials_ptr,
    vocab_local,
    full_end,
    vocab_start,
    scale,
    J: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    J_BLOCK: tl.constexpr,
):
    """One program per selected row: per-slot online max / exp-sum / centered sum, one combine
    over the slots after the loop, then the J gathers, as one vector load (a loop of J scalar
    loads issued 23 instructions and two dependent loads per id: 3k per thread at J = 129).

    Partials: the row max m of the raw logits; s = sum 2^((x - m) scale); u = sum 2^((x - m) scale)
    (x - m) scale (log2 units); then the J raw logits at the ids (0 where another rank owns the id).
    """
    pid = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + pid).to(tl.int64)
    else:
        row = pid
    row_ptr = logits_ptr + row * stride_row
    offs = _tile_offsets(SLOTS, VEC)

    running_max = tl.full([SLOTS], float("-inf"), tl.float32)
    exp_sum = tl.zeros([SLOTS], tl.float32)
    centered_sum = tl.zeros([SLOTS], tl.float32)
    for start in range(0, full_end, BLOCK):
        x = _load_tile(row_ptr, start + offs, vocab_local, float("-inf"), False)
        running_max, exp_sum, centered_sum = _online_softmax_step(
            x, running_max, exp_sum, centered_sum, scale, WITH_ENTROPY
        )
    if full_end < vocab_local:
        x = _load_tile(row_ptr, full_end + offs, vocab_local, float("-inf"), True)
        running_max, exp_sum, centered_sum = _online_softmax_step(
            x, running_max, exp_sum, centered_sum, scale, WITH_ENTROPY
        )

    row_max = tl.max(running_max, axis=0)
    reference = tl.where(row_max == float("-inf"), 0.0, row_max)
    exp_sum, centered_sum = _rebase(running_max, reference, exp_sum, centered_sum, scale, WITH_ENTROPY)
    out = partials_ptr + pid * (3 + J)
    tl.store(out, row_max)
    tl.store(out + 1, tl.sum(exp_sum, axis=0))
    if WITH_ENTROPY:
        tl.store(out + 2, tl.sum(centered_sum, axis=0))
    else:
        tl.store(out + 2, 0.0)
    id_slots = tl.arange(0, J_BLOCK)
    slot_ok = id_slots < J
    local_ids = tl.load(ids_ptr + pid * J + id_slots, mask=slot_ok, other=-1) - vocab_start
    owned = slot_ok & (local_ids >= 0) & (local_ids < vocab_local)
    tl.store(out + 3 + id_slots, tl.load(row_ptr + local_ids, mask=owned, other=0.0).to(tl.float32), mask=slot_ok)


@triton.jit
def _softmax_term(x, row_max, scale, log2_sum, k1, k2, WITH_ENTROPY: tl.constexpr):
    """p * (k1 + k2 * (x - m)): the softmax part of the gradient at raw logits x (fp32), with
    p = 2^((x - m) scale - log2_sum) from the raw difference to the row max (exact near the max).
    -inf logits give p = 0 and a finite factor, so exactly 0."""
    centered = x - row_max
    if WITH_ENTROPY:
        centered = tl.maximum(centered, FLOOR)
    p = tl.exp2(centered * scale - log2_sum)
    if WITH_ENTROPY:
        return p * (centered * k2 + k1)
    return p * k1


@triton.jit
def _write_softmax_term(grad_row_ptr, row_ptr, cols, vocab_local, row_max, scale, log2_sum, k1, k2,
                        WITH_ENTROPY: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One trip of the backward's streamed write."""
    x = _load_tile(row_ptr, cols, vocab_local, float("-inf"), MASKED).to(tl.float32)  # masked lanes: p = 0
    grad = _softmax_term(x, row_max, scale, log2_sum, k1, k2, WITH_ENTROPY).to(grad_row_ptr.dtype.element_ty)
    if MASKED:
        tl.store(grad_row_ptr + cols, grad, mask=cols < vocab_local, eviction_policy="evict_first")
    else:
        tl.store(grad_row_ptr + cols, grad, eviction_policy="evict_first")


@triton.jit
def _token_stats_bwd_kernel(
    grad_ptr,
    stride_grad_row,
    logits_ptr,
    stride_row,
    slots_ptr,
    ids_ptr,
    scatter_coef_ptr,
    logp_grad_sum_ptr,
    entropy_grad_ptr,
    softmax_state_ptr,
    vocab_local,
    full_end,
    vocab_start,
    inv_temperature,
    scale,
    J: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    J_BLOCK: tl.constexpr,
    ID_CHUNK: tl.constexpr,
):
    """One program per logits row: streams the softmax term over the whole row (zeros for
    unselected rows), then overwrites the <= J id columns with softmax term + one-hot
    coefficients, each rounded once. The ids stay out of the streamed loop; repeated ids are
    matched against ID_CHUNK slots at a time, so J = 129 (a top-128 head) costs ceil(J / ID_CHUNK)
    [J_BLOCK, ID_CHUNK] tiles, not one [J_BLOCK, J_BLOCK] tile."""
    row = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(slots_ptr + row).to(tl.int64)
    else:
        slot = row
    selected = slot >= 0
    safe_slot = tl.where(selected, slot, 0)

    # d logits = inv_t * (sum_j c_j e_id_j - G p - g_H p (z - E_p[z])), z = x * inv_t, and
    # z - E_p[z] = (x - m) inv_t - c with c = E_p[x - m] inv_t, so the softmax part is
    # p * (k1 + k2 (x - m)) with the constants below, none of them of the size of the logits.
    state = softmax_state_ptr + safe_slot * 3
    row_max = tl.load(state, mask=selected, other=0.0)
    log2_sum = tl.load(state + 1, mask=selected, other=0.0)
    logp_grad_sum = tl.load(logp_grad_sum_ptr + safe_slot, mask=selected, other=0.0)
    k1 = -logp_grad_sum * inv_temperature
    k2 = 0.0
    entropy_grad = 0.0
    if WITH_ENTROPY:
        entropy_grad = tl.load(entropy_grad_ptr + safe_slot, mask=selected, other=0.0)
        centered_mean = tl.load(state + 2, mask=selected, other=0.0)
        k1 += entropy_grad * centered_mean * inv_temperature
        k2 = -entropy_grad * inv_temperature * inv_temperature
    needs_softmax = (logp_grad_sum != 0.0) | (entropy_grad != 0.0)

    row_ptr = logits_ptr + row * stride_row
    grad_row_ptr = grad_ptr + row * stride_grad_row
    offs = _tile_offsets(SLOTS, VEC)
    # The id columns get softmax term + one-hot coefficients, rounded once, written after the
    # streamed loop. Computed before it: an in-place backward overwrites their logits, and
    # fewer values stay live through the loop. Repeated ids: every slot of an id adds its
    # coefficient to that column (each of its slots stores the same value).
    id_slots = tl.arange(0, J_BLOCK)
    slot_ok = id_slots < tl.where(selected, J, 0)
    global_ids = tl.load(ids_ptr + safe_slot * J + id_slots, mask=slot_ok, other=-1)
    local_ids = (global_ids - vocab_start).to(tl.int32)
    owned = slot_ok & (local_ids >= 0) & (local_ids < vocab_local)
    id_grad = tl.zeros([J_BLOCK], tl.float32)
    for first in range(0, J, ID_CHUNK):
        others = first + tl.arange(0, ID_CHUNK)
        other_ok = others < tl.where(selected, J, 0)
        other_ids = tl.load(ids_ptr + safe_slot * J + others, mask=other_ok, other=-1)
        coefs = tl.load(scatter_coef_ptr + safe_slot * J + others, mask=other_ok, other=0.0)
        same_id = global_ids[:, None] == other_ids[None, :]
        id_grad += tl.sum(tl.where(same_id, coefs[None, :], 0.0), axis=1)
    id_grad = id_grad * inv_temperature
    if needs_softmax:
        x_ids = tl.load(row_ptr + local_ids, mask=owned, other=float("-inf")).to(tl.float32)
        id_grad += _softmax_term(x_ids, row_max, scale, log2_sum, k1, k2, WITH_ENTROPY)

    # The needs_softmax test sits outside the loops: each streamed loop is one straight body.
    if needs_softmax:
        for start in range(0, full_end, BLOCK):
            _write_softmax_term(grad_row_ptr, row_ptr, start + offs, vocab_local, row_max, scale, log2_sum, k1, k2,
                                WITH_ENTROPY, False)  # fmt: skip
        if full_end < vocab_local:
            _write_softmax_term(grad_row_ptr, row_ptr, full_end + offs, vocab_local, row_max, scale, log2_sum, k1,
                                k2, WITH_ENTROPY, True)  # fmt: skip
    else:
        zeros = tl.zeros([SLOTS, VEC], dtype=grad_ptr.dtype.element_ty)
        for start in range(0, vocab_local, BLOCK):
            cols = start + offs
            tl.store(grad_row_ptr + cols, zeros, mask=cols < vocab_local, eviction_policy="evict_first")

    # Every thread's streamed stores land before the id columns are overwritten.
    tl.debug_barrier()
    tl.store(grad_row_ptr + local_ids, id_grad.to(grad_ptr.dtype.element_ty), mask=owned)


def row_partials(logits_2d, ids, rows, vocab_start, temperature, with_entropy) -> torch.Tensor:
    """This rank's per-row partials, [N, P] fp32: the forward kernel launch.

    Row i of the result belongs to logits row `rows[i]` (row i when `rows` is None) and ids[i];
    partials of all ranks go through `all_rank_partials` and `combine_partials`.
    """
    num_out, num_ids = ids.shape
    partials = torch.empty((num_out, 3 + num_ids), dtype=torch.float32, device=logits_2d.device)
    if num_out == 0:
        return partials
    vocab_local = logits_2d.shape[1]
    tile = tile_for(vocab_local, logits_2d.element_size())
    _token_stats_fwd_kernel[(num_out,)](
        logits_2d,
        logits_2d.stride(0),
        ids,
        rows if rows is not None else ids,  # any pointer: unread without HAS_ROWS
        partials,
        vocab_local,
        tile.full_trips_end(vocab_local),
        vocab_start,
        kernel_scale(temperature),
        J=num_ids,
        HAS_ROWS=rows is not None,
        WITH_ENTROPY=with_entropy,
        SLOTS=tile.slots,
        VEC=tile.vec,
        BLOCK=tile.block,
        J_BLOCK=triton.next_power_of_2(num_ids),
        num_warps=tile.num_warps,
    )
    return partials


def all_rank_partials(partials: torch.Tensor, tp) -> torch.Tensor:
    """[tp, N, P]: the one collective of the forward (skipped when the vocabulary is whole)."""
    if tp.group is None:
        return partials.unsqueeze(0)
    gathered = [torch.empty_like(partials) for _ in range(tp.size)]
    dist.all_gather(gathered, partials, group=tp.group)
    return torch.stack(gathered)


class RowStats(NamedTuple):
    """What the forward gives per row, from all ranks' partials (`combine_partials`).

    logp [N, J], entropy [N], scores [N, J]: as TokenStats (natural-log units).
    softmax_state [N, 3]: what the backward needs, none of it of the size of the logits: the row
        max m of the raw logits, log2 of sum 2^((x - m) log2(e) / T), and E_p[x - m] / T.
    """

    logp: torch.Tensor
    entropy: torch.Tensor
    scores: torch.Tensor
    softmax_state: torch.Tensor


def combine_partials(partials_all: torch.Tensor, temperature: float) -> RowStats:
    """The rows' statistics from all ranks' partials [tp, N, P], returned in fp32.

    `logp = (x_id - m) / T - log(sum exp((x - m) / T))` from raw differences to the row max, so
    its rounding stays with the log-probability's own size, not the logits'. The combine itself
    runs in float64 (a few floats per row), so each output is rounded to fp32 once. A row whose
    max is +inf or NaN has no distribution: NaN.
    """
    row_max, exp_sum, centered_sum, gathered = _merged(partials_all, temperature)
    log2_sum = torch.log2(exp_sum)
    centered_mean = centered_sum / exp_sum * LN2  # E_p[x - m] / T
    inv_temperature = 1.0 / temperature
    logp = (gathered - row_max.unsqueeze(1)) * inv_temperature - (log2_sum * LN2).unsqueeze(1)
    entropy = log2_sum * LN2 - centered_mean
    softmax_state = torch.stack([row_max, log2_sum, centered_mean], dim=1)
    return RowStats(*(value.float() for value in (logp, entropy, gathered * inv_temperature, softmax_state)))


def merge_partials(partials_parts: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N, P] fp32 partials of a row over all its parts from those of each part [S, N, P]: the
    vocabulary slices of `linear_token_stats` merged into this rank's partials before the
    collective (whose shape must not depend on a rank's slices). The same float64 merge as
    `combine_partials`, each merged partial rounded to fp32 once."""
    row_max, exp_sum, centered_sum, gathered = _merged(partials_parts, temperature)
    return torch.cat([torch.stack([row_max, exp_sum, centered_sum], dim=1), gathered], dim=1).float()


def _merged(partials_all: torch.Tensor, temperature: float):
    """(row max, exp-sum, centered sum around the row max, gathered logits) of all parts'
    partials [R, N, P], in float64: each part's sums moved to the common max (module docstring)."""
    scale = kernel_scale(temperature)
    partials_all = partials_all.double()
    rank_max, rank_sum, rank_centered = partials_all[..., 0], partials_all[..., 1], partials_all[..., 2]
    row_max = rank_max.max(dim=0).values
    row_max = torch.where(row_max == float("inf"), float("nan"), row_max)
    reference = torch.where(row_max == float("-inf"), 0.0, row_max)
    # A rank whose shard is all -inf has rank_sum = 0 and rank_max = -inf: its shift is 0, not NaN.
    shift = torch.where(rank_sum == 0, 0.0, (rank_max - reference) * scale)
    weight = torch.exp2(shift)
    exp_sum = (weight * rank_sum).sum(dim=0)
    centered_sum = (weight * (rank_centered + rank_sum * shift)).sum(dim=0)
    return row_max, exp_sum, centered_sum, partials_all[..., 3:].sum(dim=0)


def logits_grad(
    grad_out, logits_2d, ids, rows, softmax_state, logp_grad, entropy_grad, scores_grad, vocab_start, temperature
) -> torch.Tensor:
    """The backward kernel launch: writes every element of grad_out [T, V_local] and returns it.

    grad_out may be `logits_2d` itself (in-place). Rows not in `rows` get zeros. `softmax_state`
    is `combine_partials`' [N, 3]; `logp_grad` and `scores_grad` are [N, J] (None: zero);
    `entropy_grad` is [N] or None (no entropy term).
    """
    logp_grad = _zeros_if_none(logp_grad, ids)
    scores_grad = _zeros_if_none(scores_grad, ids)
    num_rows, vocab_local = logits_2d.shape
    if num_rows == 0:
        return grad_out
    slots = None
    if rows is not None:
        slots = torch.full((num_rows,), -1, dtype=torch.int64, device=rows.device)
        slots[rows] = torch.arange(rows.numel(), device=rows.device)
    with_entropy = entropy_grad is not None
    tile = tile_for(vocab_local, logits_2d.element_size())
    softmax_state = softmax_state.contiguous()
    _token_stats_bwd_kernel[(num_rows,)](
        grad_out,
        grad_out.stride(0),
        logits_2d,
        logits_2d.stride(0),
        slots if slots is not None else softmax_state,  # any pointer: unread without HAS_ROWS
        ids,
        (logp_grad + scores_grad).float().contiguous(),
        logp_grad.float().sum(dim=1).contiguous(),
        entropy_grad.float().contiguous() if with_entropy else softmax_state,
        softmax_state,
        vocab_local,
        tile.full_trips_end(vocab_local),
        vocab_start,
        1.0 / temperature,
        kernel_scale(temperature),
        J=ids.shape[1],
        HAS_ROWS=rows is not None,
        WITH_ENTROPY=with_entropy,
        SLOTS=tile.slots,
        VEC=tile.vec,
        BLOCK=tile.block,
        J_BLOCK=triton.next_power_of_2(ids.shape[1]),
        ID_CHUNK=id_chunk(triton.next_power_of_2(ids.shape[1])),
        num_warps=tile.num_warps,
    )
    return grad_out


def _zeros_if_none(grad, like):
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if grad is None else grad


def op_outputs(partials, tp_group_name, temperature):
    """(logp, entropy, scores, softmax_state) of this rank's partials: the collective and the combine."""
    return tuple(combine_partials(all_rank_partials(partials, tp_from_group_name(tp_group_name)), temperature))


def op_outputs_fake(ids):
    """What `op_outputs` returns, as metadata: [N, J], [N], [N, J] and [N, 3] float32 tensors."""
    per_id = ids.new_empty(ids.shape, dtype=torch.float32)
    per_row = ids.new_empty(ids.shape[:1], dtype=torch.float32)
    return per_id, per_row, torch.empty_like(per_id), ids.new_empty((ids.shape[0], 3), dtype=torch.float32)


def op_arguments(inputs, with_entropy, tp) -> tuple:
    """The arguments both forward ops take after their tensors: (ids, rows, temperature,
    with_entropy, vocab_start, tp_group_name), from the checked inputs."""
    rows = None if inputs.rows is None else inputs.rows.contiguous()
    return inputs.ids.contiguous(), rows, inputs.temperature, bool(with_entropy), inputs.vocab_start, group_name(tp)


def public_stats(outputs, with_entropy) -> TokenStats:
    """The caller's TokenStats from an op's outputs (entropy None when not asked for)."""
    logp, entropy, scores, _ = outputs
    return TokenStats(logp, entropy if with_entropy else None, scores)


# The torch.library layer: each host launch above as an op with a fake (meta) implementation, the
# forward op's autograd registered with it, so torch.compile traces through without a graph break.


@torch.library.custom_op("fusedrl::token_stats", mutates_args=())
def token_stats_op(
    logits: torch.Tensor,
    ids: torch.Tensor,
    rows: Optional[torch.Tensor],
    temperature: float,
    with_entropy: bool,
    vocab_start: int,
    tp_group_name: Optional[str],
    inplace_backward: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward as a torch op, opaque to torch.compile: (logp, entropy, scores, softmax_state).

    Inputs are checked and converted (int64 contiguous ids and rows). The tensor-parallel
    collective runs inside, on the group registered under `tp_group_name` (`ProcessGroup.group_name`,
    the way torch's functional collectives pass a group through an op schema; None: no split), so
    one op holds the whole forward and its backward needs no collective. entropy is meaningful only
    with `with_entropy`; softmax_state is saved for the backward. `inplace_backward` is read by the
    backward only.
    """
    partials = row_partials(as_2d_logits(logits), ids, rows, vocab_start, temperature, with_entropy)
    return op_outputs(partials, tp_group_name, temperature)


@token_stats_op.register_fake
def _token_stats_fake(logits, ids, rows, temperature, with_entropy, vocab_start, tp_group_name, inplace_backward):
    return op_outputs_fake(ids)


@torch.library.custom_op("fusedrl::token_stats_backward", mutates_args=("grad_out",))
def token_stats_backward_op(
    grad_out: torch.Tensor,
    logits: torch.Tensor,
    ids: torch.Tensor,
    rows: Optional[torch.Tensor],
    softmax_state: torch.Tensor,
    logp_grad: Optional[torch.Tensor],
    entropy_grad: Optional[torch.Tensor],
    scores_grad: Optional[torch.Tensor],
    vocab_start: int,
    temperature: float,
) -> None:
    """`logits_grad` as a torch op: writes every element of grad_out (shaped as logits; it may be
    the logits themselves, for the in-place backward). entropy_grad None: no entropy term."""
    logits_grad(
        as_2d_logits(grad_out), as_2d_logits(logits), ids, rows, softmax_state,
        logp_grad, entropy_grad, scores_grad, vocab_start, temperature,
    )  # fmt: skip


@token_stats_backward_op.register_fake
def _token_stats_backward_fake(grad_out, *args):
    return None


def _token_stats_setup_context(ctx, inputs, output):
    logits, ids, rows, temperature, with_entropy, vocab_start, _, inplace_backward = inputs
    ctx.save_for_backward(logits, ids, rows, output[3])
    ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a zeros fill
    ctx.temperature, ctx.with_entropy, ctx.vocab_start, ctx.inplace = temperature, with_entropy, vocab_start, inplace_backward


def _token_stats_backward(ctx, logp_grad, entropy_grad, scores_grad, state_grad):
    """Gradient for the logits as the caller passed them ([T, V] or [1, T, V]), so an in-place
    backward hands back the caller's own buffer with no view-backward copy; softmax_state is an
    internal output whose gradient is ignored."""
    del state_grad
    logits, ids, rows, softmax_state = ctx.saved_tensors
    grad = logits if ctx.inplace else torch.empty_like(logits)
    token_stats_backward_op(
        grad, logits, ids, rows, softmax_state, logp_grad, entropy_grad if ctx.with_entropy else None,
        scores_grad, ctx.vocab_start, ctx.temperature,
    )  # fmt: skip
    return grad, None, None, None, None, None, None, None


token_stats_op.register_autograd(_token_stats_backward, setup_context=_token_stats_setup_context)


def token_stats(
    logits,
    ids,
    *,
    temperature=1.0,
    with_entropy=False,
    tp_group=None,
    rows=None,
    inplace_backward=False,
    validate=True,
) -> TokenStats:
    """Log-probs and tempered logits of J ids per row, and optionally the entropy, in one pass.

    logits: [T, V_local] or [1, T, V_local] (fp32, bf16 or fp16; last dim contiguous, any row
        stride). With a tensor-parallel group of size tp (default: megatron-core's when
        initialised) this rank holds global columns [rank * V_local, (rank + 1) * V_local); every
        column, vocabulary padding included, takes part in the softmax.
    ids: [N, J] global vocabulary ids (N = T, or len(rows)); repeated ids are independent slots.
    temperature: the logits are divided by it (fused; no tempered copy is made); within
        TEMPERATURE_RANGE, 1e-6 to 1e6, the temperatures the fp32 kernels answer.
    rows: optional distinct row indices; only those rows are read, outputs follow `rows` order and
        the other rows get a zero gradient (slime's prompt and padding rows).
    inplace_backward: write the gradient into the logits buffer (the logits must not be used after;
        logits whose rows overlap in memory, such as an expanded row, are refused).
    validate: check ids and rows values (one host sync each); shapes and dtypes are always checked.

    Returns `TokenStats(logp [N, J], entropy [N] or None, scores [N, J])`, float32.
    Masked vocabularies: -inf logits are ordinary input (probability 0, gradient exactly 0), in
    any column and on any TP rank, a whole shard included. A row with a NaN logit, a +inf logit
    or no finite logit at all has no distribution: its logp and entropy are NaN (scores stay the
    tempered logits), as is its gradient wherever the softmax term enters; other rows are
    unaffected. The float64 reference gives the same.
    Differentiable with respect to logits. CPU tensors outside the Triton interpreter take the
    float64 eager reference.
    """
    tp = resolve_tp(tp_group)
    inputs = check_token_stats_inputs(
        logits, ids, temperature, rows, tp.size, tp.rank, validate, KERNEL_DTYPES
    )
    if inplace_backward:
        check_no_self_overlap("inplace_backward=True", inputs.logits, "the gradient is written over them")
    if not uses_triton(inputs.logits, "token_stats"):
        return token_stats_reference(
            logits,
            ids,
            temperature=temperature,
            with_entropy=with_entropy,
            tp_group=tp_group,
            rows=rows,
            validate=False,
        )
    outputs = token_stats_op(logits, *op_arguments(inputs, with_entropy, tp), bool(inplace_backward))
    return public_stats(outputs, with_entropy)


def token_logprobs(logits, ids, **kwargs):
    """(logp [N, J], entropy [N] or None): `token_stats` without the scores."""
    stats = token_stats(logits, ids, **kwargs)
    return stats.logp, stats.entropy
