"""--fusedrl-fused-lm-head through slime's real model provider and log-prob path (FUSEDRL_SLIME_SRC;
bench/slime_loop/upstream_slime.py), on a tiny real megatron-core GPTModel (one layer, CPU).

In a spawned worker: `fusedrl.slime_ext.install` with the flag wraps slime's
`get_model_provider_func` (also where slime's `model.py` imported it); slime builds the actor
through it (`--custom-model-provider-path` pointing at the tiny GPTModel below); the model then
returns hidden states and the recorded weight is the shared embedding (tied) or the output layer's
(untied). The fused log-probs and entropies, and the gradients of every model parameter, equal
slime's own `get_log_probs_and_entropy` on the same model's logits after `uninstall`.
"""

from argparse import Namespace

import torch
from bench_package import import_bench
from distributed import run_on_ranks
from numerics import assert_parity

import_bench()
from bench.slime_loop import upstream_slime  # noqa: E402

upstream_slime.require()

HIDDEN, VOCAB, TOTALS, RESPONSES = 16, 40, [9, 6], [5, 2]
TIED = [True]  # whether tiny_gpt ties its embeddings; set by the worker before slime builds the model


def tiny_gpt(pre_process=True, post_process=True, vp_stage=None):
    """slime's custom model provider contract: a one-layer megatron-core GPTModel on CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=32, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=TIED[0], position_embedding_type="learned_absolute",
    )  # fmt: skip


def _log_probs_and_grads(model, tokens, args, get_log_probs_and_entropy):
    model.zero_grad()
    length = tokens.shape[1]
    causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)  # True: masked
    output = model(input_ids=tokens, position_ids=torch.arange(length).unsqueeze(0), attention_mask=causal)
    _, res = get_log_probs_and_entropy(
        output, args=args, unconcat_tokens=list(tokens[0].split(TOTALS)), total_lengths=TOTALS,
        response_lengths=RESPONSES, with_entropy=True,
    )  # fmt: skip
    (sum(x.sum() for x in res["log_probs"]) + 0.3 * sum(x.sum() for x in res["entropy"])).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.shape, res["log_probs"], res["entropy"], grads


def _observe(rank, world_size):
    """Per embedding mode (tied, untied): fused and unfused results and whether the recorded
    weight is the one GPTModel multiplies."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.current_device = lambda: "cpu"  # megatron-core's attention buffers, on these CPU workers
    upstream_slime.load()
    import slime.backends.megatron_utils.loss as slime_loss
    import slime.backends.megatron_utils.model as slime_model

    import fusedrl.slime_ext as fusedrl_slime
    from fusedrl.slime_ext import lm_head

    parallel_state.initialize_model_parallel(1, create_gloo_process_groups=False)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # no CUDA RNG to fork; dropout is 0
    original = slime_loss.get_log_probs_and_entropy
    args = Namespace(
        loss_type="policy_loss", fusedrl_fused_lm_head=True, custom_model_provider_path=f"{__name__}.tiny_gpt",
        rollout_temperature=0.8,
        allgather_cp=False, entropy_coef=0.01, log_probs_chunk_size=-1, qkv_format="thd",
    )  # fmt: skip
    tokens = torch.randint(0, VOCAB, (1, sum(TOTALS)), generator=torch.Generator().manual_seed(1))
    results = {}
    for tied in (True, False):
        TIED[0] = tied
        torch.manual_seed(0)
        fusedrl_slime.install(args)
        try:
            assert slime_model.get_model_provider_func.__module__ == "fusedrl.slime_ext.patching"
            model = slime_model.get_model_provider_func(args, "actor")(pre_process=True, post_process=True)
            fused = _log_probs_and_grads(model, tokens, args, slime_loss.get_log_probs_and_entropy)
            expected = model.embedding.word_embeddings.weight if tied else model.output_layer.weight
            recorded = lm_head.output_weight() is expected
        finally:
            fusedrl_slime.uninstall()
        results[tied] = fused, _log_probs_and_grads(model, tokens, args, original), recorded
    parallel_state.destroy_model_parallel()
    return results


def test_slimes_provider_builds_an_actor_that_hands_off():
    for tied, (fused, unfused, recorded) in run_on_ranks(1, _observe)[0].items():
        what = "tied" if tied else "untied"
        assert recorded, what
        assert fused[0] == (1, sum(TOTALS), HIDDEN) and unfused[0] == (1, sum(TOTALS), VOCAB)
        for mine, theirs in zip(fused[1] + fused[2], unfused[1] + unfused[2], strict=True):
            assert_parity(mine, theirs, 1e-5, f"{what} log-probs / entropy")
        assert set(fused[3]) == set(unfused[3])
        for name, grad in fused[3].items():
            assert_parity(grad, unfused[3][name], 1e-5, f"{what} {name}")
