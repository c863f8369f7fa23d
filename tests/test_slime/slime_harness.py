"""Drive fusedrl's slime extensions the way slime does, without slime.

slime's real code (FUSEDRL_SLIME_SRC, `bench/slime_loop/upstream_slime.py`) runs in
`tests/test_slime/test_upstream_slime_*.py`: its rollout conversion, DP split, `get_batch`, `DataIterator`,
`loss_function` and reducer (with and without `rollout_mask_sums`), its parser and its own float32
log-prob path next to the float64 truth. What stays here is what those tests cannot serve, each
part for the reason given: the package's unit and kernel-parity tests (policy loss, SFC loss,
aggregation, log-prob layouts) run on every machine, also without a slime checkout, and at shapes
and inputs (top-p replay ids, -inf columns, hand-placed draws and weight versions) that slime's
rollout pipeline cannot be made to produce from plain samples.

Four parts, written from slime's documented behaviour (docs/slime.md; slime's
`megatron_utils/data.py: get_batch`, `cp_utils.py`, `loss.py: loss_function`), independently of the
package's own layout code:

- Layouts: which token positions of a sample a context-parallel rank holds (zigzag, or a piece of
  the global stream under allgather-CP), packing per-sample rows into a rank's logits, slicing
  per-token response tensors as slime's batch carries them.
- Batches: deterministic slime-like samples and the per-rank micro-batch dict with slime's keys
  (kept: the carried SFC draws and versions are placed by hand; slime's `get_batch` with carried
  data runs in test_upstream_slime_train.py).
- slime's loss wrapper: the `sum_of_sample_mean` reducer and the scaling of the returned loss
  (kept for the tests without a slime checkout; its real twin, fallback to each sample's own mask
  sum included, is checked in test_upstream_slime_train.py).
- Per-rank checks: a rank's logits and expected gradient, slime's loss wrapper run on a rank
  (the workers come from `distributed.get_pool`), and the comparison with a float64 reference.
"""

import sys
from argparse import Namespace
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from device import to_cpu, to_device
from distributed import RankInfo, get_pool
from numerics import assert_parity

# ----------------------------------------------------------------------------- layouts


def zigzag_token_positions(total_length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Token positions of a sample on a zigzag cp rank, in layout order; -1 marks padding."""
    pieces = 2 * cp_size
    chunk = -(-total_length // pieces)
    positions = F.pad(torch.arange(total_length), (0, pieces * chunk - total_length), value=-1)
    chunks = positions.view(pieces, chunk)
    return torch.cat([chunks[cp_rank], chunks[pieces - 1 - cp_rank]])


def rank_token_positions(total_length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Token positions a rank holds for one sample (all of them when cp = 1)."""
    if cp_size == 1:
        return torch.arange(total_length)
    return zigzag_token_positions(total_length, cp_rank, cp_size)


def rank_response_positions(total_length: int, response_length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Response positions (0-based) whose predicting logits row the rank holds, in layout order.

    Row p predicts token p + 1, so response position j is row prompt_length - 1 + j.
    """
    first_row = total_length - response_length - 1
    rows = rank_token_positions(total_length, cp_rank, cp_size)
    rows = rows[(rows >= first_row) & (rows < total_length - 1)]
    return rows - first_row


def slice_per_token(x: torch.Tensor, total_length: int, response_length: int, cp_rank: int, cp_size: int):
    """The rank's part of a full-response per-token tensor, as slime's batch carries it."""
    return x[rank_response_positions(total_length, response_length, cp_rank, cp_size)]


def _pad_rows(x: torch.Tensor, multiple: int, fill: float) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_full((pad,) + tuple(x.shape[1:]), fill)]) if pad else x


def pack_rows(
    per_sample: Sequence[torch.Tensor],
    cp_rank: int,
    cp_size: int,
    *,
    allgather_cp: bool = False,
    pad_multiple: int = 1,
    fill: float = 0.0,
) -> torch.Tensor:
    """A rank's packed rows (logits or gradients) from full per-sample rows `[total_i, ...]`.

    cp = 1 and zigzag: samples (zigzag-sliced, each padded to 2*cp chunks) concatenated, then the
    stream padded to `pad_multiple`; allgather: the global stream padded to cp * pad_multiple and cut
    into cp pieces. Padding rows hold `fill`.
    """
    if cp_size > 1 and allgather_cp:
        stream = _pad_rows(torch.cat(list(per_sample)), cp_size * pad_multiple, fill)
        return stream.chunk(cp_size)[cp_rank]
    parts = []
    for rows in per_sample:
        positions = rank_token_positions(rows.shape[0], cp_rank, cp_size)
        padded = torch.cat([rows, rows.new_full((1,) + tuple(rows.shape[1:]), fill)])
        parts.append(padded[positions])  # position -1 picks the fill row
    return _pad_rows(torch.cat(parts), pad_multiple, fill)


def fill_non_response_rows(rows: torch.Tensor, response_length: int, fill: float) -> torch.Tensor:
    """Copy of a sample's rows `[total, ...]` with every row that predicts no response token set to
    `fill` (prompt rows before the last prompt token, and the last row)."""
    total = rows.shape[0]
    keep = torch.zeros(total, dtype=torch.bool)
    keep[total - response_length - 1 : total - 1] = True
    out = rows.clone()
    out[~keep] = fill
    return out


def vocab_shard(x: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The tp rank's contiguous column block of the last dimension."""
    return x.chunk(tp_size, dim=-1)[tp_rank].contiguous()


# ----------------------------------------------------------------------------- batches


class Sample(NamedTuple):
    """One full (unsliced) sample: tokens [total], per-token response tensors [response]."""

    tokens: torch.Tensor
    response_length: int
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    rollout_log_probs: torch.Tensor


def make_samples(seed: int, total_lengths: Sequence[int], response_lengths: Sequence[int], vocab: int) -> List[Sample]:
    """Random samples with partly masked responses (a fully masked one when lengths allow) and
    log-probs near each other so ratios straddle the clip range."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, (total, response) in enumerate(zip(total_lengths, response_lengths, strict=True)):
        mask = (torch.rand(response, generator=gen) > 0.25).int()
        if i == 1:
            mask.zero_()  # a fully masked sample
        old = -torch.rand(response, generator=gen, dtype=torch.float64) * 3 - 0.05
        samples.append(
            Sample(
                tokens=torch.randint(0, vocab, (total,), generator=gen),
                response_length=response,
                loss_mask=mask,
                advantages=torch.randn(response, generator=gen, dtype=torch.float64).float(),
                log_probs=old.float(),
                ref_log_probs=(old + 0.3 * torch.randn(response, generator=gen, dtype=torch.float64)).float(),
                rollout_log_probs=(old + 0.1 * torch.randn(response, generator=gen, dtype=torch.float64)).float(),
            )
        )
    return samples


PER_TOKEN_KEYS = ("advantages", "log_probs", "ref_log_probs", "rollout_log_probs")


def micro_batch(samples: Sequence[Sample], cp_rank: int, cp_size: int, rollout_mask_sums=None) -> dict:
    """slime's micro-batch dict for one rank: per-token tensors CP-sliced, loss masks full."""
    totals = [len(s.tokens) for s in samples]
    responses = [s.response_length for s in samples]
    batch = {
        "unconcat_tokens": [s.tokens for s in samples],
        "total_lengths": totals,
        "response_lengths": responses,
        "loss_masks": [s.loss_mask for s in samples],
        "rollout_mask_sums": (
            [float(s.loss_mask.sum()) for s in samples] if rollout_mask_sums is None else list(rollout_mask_sums)
        ),
        "multimodal_train_inputs": None,
        "packed_seq_params": None,
        "returns": None,
    }
    for key in PER_TOKEN_KEYS:
        batch[key] = [
            slice_per_token(getattr(s, key), total, response, cp_rank, cp_size)
            for s, total, response in zip(samples, totals, responses)
        ]
    return batch


def make_logits(seed: int, total_lengths: Sequence[int], vocab: int, scale: float = 2.0) -> List[torch.Tensor]:
    """Full-vocabulary float64 logits `[total_i, vocab]` per sample."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(total, vocab, generator=gen, dtype=torch.float64) * scale for total in total_lengths]


def slime_args(**overrides) -> Namespace:
    """The slime flags the policy loss and the log-prob path read, at slime's defaults."""
    args = dict(
        loss_type="custom_loss",
        custom_loss_function_path="fusedrl.slime_ext.losses.policy_loss",
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        log_probs_chunk_size=-1,
        allgather_cp=False,
        advantage_estimator="grpo",
        eps_clip=0.2,
        eps_clip_high=None,  # slime's default: eps_clip (set below)
        eps_clip_c=None,
        entropy_coef=0.0,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="k1",
        use_unbiased_kl=False,
        use_rollout_logprobs=False,
        use_tis=False,
        tis_clip=2.0,
        tis_clip_low=0.0,
        custom_tis_function_path=None,
        get_mismatch_metrics=False,
        use_opsm=False,
        opsm_delta=1e-4,
        calculate_per_token_loss=False,
        custom_pg_loss_reducer_function_path=None,
        recompute_loss_function=False,
        loss_aggregation="sample_mean",
        pg_loss_type="ppo",
        # what the package's startup checks install or read, as they leave it (the losses re-check at first use)
        rollout_top_k=-1,
        rollout_batch_size=1,
        n_samples_per_prompt=1,
        global_batch_size=None,
        num_steps_per_rollout=None,
        load_debug_rollout_data=None,
        rollout_function_path="fusedrl.slime_ext.rollout.prompt_groups.generate_rollout",
        loss_aggregation_inner_rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
        custom_generate_function_path="fusedrl.slime_ext.rollout.sfc_draws.generate",
        custom_rollout_log_function_path="fusedrl.slime_ext.rollout.refusals.log_rollout_data",
    )
    args.update(overrides)
    if args["eps_clip_high"] is None:
        args["eps_clip_high"] = args["eps_clip"]
    return Namespace(**args)


def top_p_replay(seed, responses, vocab):
    """slime's replay data per sample: flat kept ids and offsets; sample 2 records only part of its
    response, one nucleus is empty, and nuclei may or may not contain the sampled token."""
    gen = torch.Generator().manual_seed(seed)
    ids, offsets = [], []
    for i, response in enumerate(responses):
        recorded = response - 2 if i == 2 else response
        sizes = torch.randint(1, 6, (recorded,), generator=gen)
        if recorded > 1:
            sizes[1] = 0
        flat = [torch.randperm(vocab, generator=gen)[: int(k)] for k in sizes]
        ids.append(torch.cat(flat).tolist())
        offsets.append([0] + torch.cumsum(sizes, 0).tolist())
    return ids, offsets


def reference_response_stats(full_logits, tokens, totals, responses, temperature, replay=None):
    """Per sample, float64 log-prob and entropy of every response position (documented semantics)."""
    log_probs, entropies = [], []
    for i, (logits, toks, total, response) in enumerate(zip(full_logits, tokens, totals, responses)):
        z = logits[total - response - 1 : total - 1] / temperature
        target = toks[total - response :]
        entropies.append(-(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1))
        if replay is not None:
            ids, offsets = replay
            keep = torch.ones_like(z, dtype=torch.bool)
            for j in range(len(offsets[i]) - 1):
                keep[j] = False
                keep[j, ids[i][offsets[i][j] : offsets[i][j + 1]]] = True
                keep[j, target[j]] = True
            z = z.masked_fill(~keep, float("-inf"))
        log_probs.append(torch.log_softmax(z, -1).gather(1, target.unsqueeze(1)).squeeze(1))
    return log_probs, entropies


def _cp_layout():
    """(cp rank, cp size, cp group) of megatron-core's parallel state ((0, 1, None) without one;
    only a process that imported it can have initialised it, so the heavy import is skipped)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    group = parallel_state.get_context_parallel_group()
    return parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size(), group


def reject_outside_tis_band(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kwargs):
    """A rejection-sampling TIS function with slime's signature (`--custom-tis-function-path`; the
    form of slime's MIS helpers): a token whose ratio exp(train - rollout) lies outside
    [--tis-clip-low, --tis-clip] leaves the loss mask (full-response masks, so the cp rank holding
    the token tells the others), every token's pg_loss is weighted by its ratio; its own metric
    `rs_reject_frac` (rejected tokens)."""
    cp_rank, cp_size, group = _cp_layout()
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    rejected = (ratio < args.tis_clip_low) | (ratio > args.tis_clip)
    kept_masks = []
    for part, mask, total, response in zip(rejected.split([len(x) for x in train_log_probs]), loss_masks, total_lengths, response_lengths):
        outside = torch.zeros(response, dtype=torch.float64, device=mask.device)
        outside[rank_response_positions(total, response, cp_rank, cp_size).to(mask.device)] = part.double()
        if cp_size > 1:
            torch.distributed.all_reduce(outside, group=group)
        kept_masks.append(mask * (outside == 0).to(mask.dtype))
    return pg_loss * ratio, kept_masks, {"rs_reject_frac": rejected.float()}


# ----------------------------------------------------------------------------- slime's loss wrapper


def sum_of_sample_mean(batch: dict, cp_rank: int, cp_size: int, per_token: bool = False) -> Callable:
    """slime's reducer: per sample, the masked sum over the rank's positions divided by the
    sample's rollout mask total (clamped at 1), summed; or the plain masked sum per token."""
    positions = [
        rank_response_positions(total, response, cp_rank, cp_size)
        for total, response in zip(batch["total_lengths"], batch["response_lengths"])
    ]
    masks = [mask[pos] for mask, pos in zip(batch["loss_masks"], positions)]
    denominators = [torch.clamp_min(torch.as_tensor(d), 1) for d in batch["rollout_mask_sums"]]

    def reduce(x: torch.Tensor) -> torch.Tensor:
        parts = x.split([len(m) for m in masks])
        if per_token:
            return sum((part * m).sum() for part, m in zip(parts, masks))
        return sum((part * m).sum() / d for part, m, d in zip(parts, masks, denominators))

    return reduce


class Scaling(NamedTuple):
    """The step context slime's loss wrapper scales by."""

    num_microbatches: int
    step_global_batch_size: int
    dp_cp_size: int
    cp_size: int


def slime_loss_function(args, batch, logits, loss_fn, cp_rank: int, scaling: Scaling):
    """slime's `loss_function` for one micro-batch: build the reducer, call the loss, scale it.

    Returns (scaled loss, metrics dict of the unscaled per-micro-batch sums).
    """
    reducer = sum_of_sample_mean(batch, cp_rank, scaling.cp_size, per_token=args.calculate_per_token_loss)
    loss, metrics = loss_fn(args, batch, logits, reducer)
    if args.allgather_cp and scaling.cp_size > 1:
        loss = loss + 0 * logits.sum()
    if args.calculate_per_token_loss:
        loss = loss * scaling.cp_size
    else:
        loss = loss * scaling.num_microbatches / scaling.step_global_batch_size * scaling.dp_cp_size
    return loss, metrics


# ----------------------------------------------------------------------------- per-rank checks


def gather_grad_reference(
    full_grads: Sequence[torch.Tensor], info: RankInfo, *, allgather_cp: bool = False, pad_multiple: int = 1
) -> torch.Tensor:
    """A rank's expected logits gradient: the full-vocabulary per-sample gradient packed into the
    rank's rows (zero on padding) and cut to its vocabulary columns."""
    packed = pack_rows(full_grads, info.cp_rank, info.cp_size, allgather_cp=allgather_cp, pad_multiple=pad_multiple)
    return vocab_shard(packed, info.tp_rank, info.tp_size)


def rank_logits(
    full_logits: Sequence[torch.Tensor],
    info: RankInfo,
    *,
    allgather_cp: bool = False,
    pad_multiple: int = 1,
    fill: float = float("nan"),
    dtype: Optional[torch.dtype] = torch.float32,
) -> torch.Tensor:
    """The rank's `[1, T, V/tp]` leaf logits as slime's model returns them (padding rows = fill)."""
    packed = pack_rows(full_logits, info.cp_rank, info.cp_size, allgather_cp=allgather_cp, pad_multiple=pad_multiple, fill=fill)
    return vocab_shard(packed, info.tp_rank, info.tp_size).to(dtype).unsqueeze(0).requires_grad_()


# The uneven packed micro-batch the loss tests share: five samples of different prompt and
# response lengths (one response of a single token), rows padded to a multiple of PAD.
VOCAB = 40
TOTALS = [10, 5, 14, 7, 9]
RESPONSES = [6, 3, 9, 1, 5]
PAD = 8
SCALING = dict(num_microbatches=2, step_global_batch_size=8)


def rank_loss_and_grad(info: RankInfo, full_logits, args, batch, loss_fn, device=None):
    """(info, loss, metrics, logits gradient) of slime's loss wrapper around `loss_fn` on this
    rank, with every prompt and padding row of the logits poisoned so that reading one shows.

    device: where the loss runs (logits and batch moved there, as slime's batch lives on the GPU);
    the results come back on CPU. None: on CPU."""
    # slime's wrapper adds 0 * logits.sum() under allgather-CP, which reads every row: there the
    # unread rows hold a huge finite value instead of NaN.
    fill = 1e4 if args.allgather_cp else float("nan")
    logits = rank_logits(
        [fill_non_response_rows(x, r, fill) for x, r in zip(full_logits, RESPONSES)],
        info,
        allgather_cp=args.allgather_cp,
        pad_multiple=PAD,
        fill=fill,
    )
    if device is not None:
        logits, batch = logits.detach().to(device).requires_grad_(), to_device(batch, device)
    scaling = Scaling(dp_cp_size=info.cp_size * info.dp_size, cp_size=info.cp_size, **SCALING)
    loss, metrics = slime_loss_function(args, batch, logits, loss_fn, info.cp_rank, scaling)
    loss.backward()
    return info, to_cpu(loss), to_cpu(metrics), logits.grad[0].cpu()


def run_loss_on_ranks(tp: int, cp: int, device, rank_fn, *args) -> list:
    """[rank_fn(info, *args, rank_device)] for every rank of a tp x cp layout.

    tp = cp = 1: one rank, in this process, on `device` (the test device: no process group, so the
    losses see one unsplit rank, as megatron-core at tp = cp = 1 gives them). Otherwise the
    session's gloo workers (`distributed.get_pool`), on CPU: gloo has no CUDA collectives.
    """
    if tp * cp == 1:
        return [rank_fn(RankInfo(0, 1, 0, 1, 0, 1, 0, 1), *args, device)]
    return get_pool(tp, cp).run(rank_fn, *args, torch.device("cpu"))


def reference_losses(args, cp_size: int, batch_for_rank, reference_for_rank):
    """Per cp rank, slime's wrapper around the float64 reference loss `reference_for_rank(cp_rank)`
    (a custom-loss function) on `batch_for_rank(cp_rank)`: [(loss, metrics)]."""
    scaling = Scaling(dp_cp_size=cp_size, cp_size=cp_size, **SCALING)
    return [
        slime_loss_function(args, batch_for_rank(rank), torch.zeros(()), reference_for_rank(rank), rank, scaling)
        for rank in range(cp_size)
    ]


def assert_ranks_match_reference(results, expected, ref_grads, args) -> None:
    """Every rank's loss, metrics (same names, 0-d, detached) and logits gradient match the
    reference to 1e-5 relative, element-wise and norm-wise; the gradient is finite (no poisoned
    row was read)."""
    for info, loss, metrics, grad in results:
        exp_loss, exp_metrics = expected[info.cp_rank]
        assert loss.dtype == torch.float32 and loss.dim() == 0
        assert_parity(loss, exp_loss, 1e-5, "loss")
        assert set(metrics) == set(exp_metrics)
        for key, value in metrics.items():
            assert value.dim() == 0 and not value.requires_grad
            assert_parity(value, exp_metrics[key], 1e-5, key)
        assert bool(torch.isfinite(grad).all())
        reference = gather_grad_reference(ref_grads, info, allgather_cp=args.allgather_cp, pad_multiple=PAD)
        assert_parity(grad, reference, 1e-5, "logits gradient")
