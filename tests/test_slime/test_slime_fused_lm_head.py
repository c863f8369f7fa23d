"""--fusedrl-fused-lm-head against the unfused path, on gloo workers with megatron-core's
parallel_state and a real megatron-core `ColumnParallelLinear` output layer.

Per rank, the same packed hidden states go through the layer twice: as megatron-core computes it
(logits `[1, T, V/tp]`, then the package's policy loss inside slime's loss wrapper) and handed
off (hidden states `[1, T, H]`, the same loss on `linear_token_stats`). Loss, every metric, the
forward-only log-probs and entropies, and the gradients of the layer's input and of the output
weight agree within 1e-5 (fp32), at tp = 1, 2 x cp = 1, 2 (zigzag and allgather), sequence
parallel on and off, with the layer's own weight (untied) and with a weight passed in as GPTModel
passes the shared embedding (tied).
"""

import pytest
import torch

from distributed import get_pool
from numerics import assert_parity
from slime_harness import (
    PAD,
    RESPONSES,
    SCALING,
    TOTALS,
    Scaling,
    make_samples,
    micro_batch,
    pack_rows,
    slime_args,
    slime_loss_function,
    top_p_replay,
)

HIDDEN = 16
VOCAB = 40
SEED = 11


def _on_cpu_megatron():
    """megatron-core's sequence-parallel all-gather allocates on `torch.cuda.current_device()`; on
    these CPU workers that device is the CPU."""
    torch.cuda.current_device = lambda: "cpu"


def _output_layer(tp: int, sequence_parallel: bool, tied: bool):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, use_cpu_initialization=True
    )
    return ColumnParallelLinear(
        HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False,
        skip_weight_param_allocation=tied,
    )  # fmt: skip


def _run_once(info, layer, weight, x, args, batch, fused: bool):
    """(loss, metrics, input grad, weight grad, forward-only log-probs, entropies) of one path."""
    from fusedrl.slime_ext import lm_head
    from fusedrl.slime_ext.logprobs import get_log_probs_and_entropy
    from fusedrl.slime_ext.losses import policy_loss

    x = x.clone().requires_grad_()
    if fused:
        lm_head.hand_off(layer)
    try:
        out, bias = layer(x, weight=weight)
        assert bias is None
        output = out.transpose(0, 1).contiguous()  # GPTModel's [s b h] -> [b s h]
        assert output.shape[-1] == (HIDDEN if fused else VOCAB // info.tp_size)
        scaling = Scaling(dp_cp_size=info.cp_size * info.dp_size, cp_size=info.cp_size, **SCALING)
        loss, metrics = slime_loss_function(args, batch, output, policy_loss, info.cp_rank, scaling)
        loss.backward()
        with torch.no_grad():
            out, _ = layer(x, weight=weight)
            _, res = get_log_probs_and_entropy(
                out.transpose(0, 1).contiguous(), args=args, unconcat_tokens=batch["unconcat_tokens"],
                total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"], with_entropy=True,
                **_top_p_kwargs(batch),
            )  # fmt: skip
    finally:
        lm_head.restore()
    weight = layer.weight if weight is None else weight
    grad_weight = weight.grad.clone()
    weight.grad = None
    return loss, metrics, x.grad, grad_weight, res["log_probs"], res["entropy"]


def _top_p_kwargs(batch):
    if "rollout_top_p_token_ids" not in batch:
        return {}
    return dict(top_p_token_ids=batch["rollout_top_p_token_ids"], top_p_token_offsets=batch["rollout_top_p_token_offsets"])


def _rank_paths(info, case, full_hidden, full_weight, samples, replay):
    """Per embedding mode (untied, tied): the unfused and the fused results of this rank."""
    _on_cpu_megatron()
    sequence_parallel, allgather = case
    args = slime_args(
        allgather_cp=allgather, rollout_temperature=0.7, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1,
        kl_loss_type="low_var_kl", rollout_top_p=1.0 if replay is None else 0.9,
    )  # fmt: skip
    batch = micro_batch(samples, info.cp_rank, info.cp_size)
    if replay is not None:
        batch["rollout_top_p_token_ids"], batch["rollout_top_p_token_offsets"] = replay
    hidden = pack_rows(full_hidden, info.cp_rank, info.cp_size, allgather_cp=allgather, pad_multiple=PAD)
    x = hidden.float().unsqueeze(1)  # [T, 1, H], megatron's [s b h]
    if sequence_parallel:
        x = x.chunk(info.tp_size)[info.tp_rank]
    shard = full_weight.float().chunk(info.tp_size)[info.tp_rank]
    results = {}
    for tied in (False, True):
        layer = _output_layer(info.tp_size, sequence_parallel, tied)
        weight = torch.nn.Parameter(shard.clone()) if tied else None
        if not tied:
            layer.weight.data.copy_(shard)
        results[tied] = [_run_once(info, layer, weight, x, args, batch, fused) for fused in (False, True)]
    return results


CASES = [  # tp, cp, sequence parallel, allgather CP, top-p replay
    (1, 1, False, False, False),
    (1, 2, False, False, True),
    (1, 2, False, True, False),
    (2, 1, False, False, True),
    (2, 1, True, False, False),
    (2, 2, False, True, False),
    (2, 2, True, False, True),
    (2, 2, True, True, False),
]


@pytest.mark.parametrize("tp,cp,sequence_parallel,allgather,top_p", CASES)
def test_fused_lm_head_matches_the_unfused_output_layer(tp, cp, sequence_parallel, allgather, top_p):
    gen = torch.Generator().manual_seed(SEED)
    full_hidden = [torch.randn(total, HIDDEN, generator=gen, dtype=torch.float64) for total in TOTALS]
    full_weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.5
    samples = make_samples(SEED, TOTALS, RESPONSES, VOCAB)
    replay = top_p_replay(SEED, RESPONSES, VOCAB) if top_p else None
    gradient_mass = 0.0
    for results in get_pool(tp, cp).run(
        _rank_paths, (sequence_parallel, allgather), full_hidden, full_weight, samples, replay
    ):
        for tied, (unfused, fused) in results.items():
            what = "tied" if tied else "untied"
            loss, metrics, grad_x, grad_w, log_probs, entropies = fused
            assert_parity(loss, unfused[0], 1e-5, f"{what} loss")
            assert set(metrics) == set(unfused[1]) and "kl_loss" in metrics and "entropy_loss" in metrics
            for key, value in metrics.items():
                assert_parity(value, unfused[1][key], 1e-5, f"{what} {key}")
            assert bool(torch.isfinite(grad_x).all())
            gradient_mass += float(grad_x.abs().sum())  # a rank's sequence-parallel slice may hold no response row
            assert_parity(grad_x, unfused[2], 1e-5, f"{what} hidden-state gradient")
            assert_parity(grad_w, unfused[3], 1e-5, f"{what} output-weight gradient")
            assert len(log_probs) == len(TOTALS)
            for mine, theirs in zip(log_probs + entropies, unfused[4] + unfused[5], strict=True):
                assert_parity(mine, theirs, 1e-5, f"{what} forward-only log-probs / entropy")
    assert gradient_mass > 0
