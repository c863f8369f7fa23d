"""The one-pass LM head's weight gradient straight into megatron-core's `main_grad`
(`slime_ext/main_grad.py`), under megatron-core's real DistributedDataParallel and schedule steps
and slime's real `loss_function` (FUSEDRL_SLIME_SRC; tests/upstream_slime.py).

Two gloo workers (dp = 2), each with its own micro-batches, run one training step of a tiny model
(embedding lookup, a mixing layer, a megatron-core `ColumnParallelLinear` output layer; untied, or
tied to the embedding as GPTModel ties it, `zero_out_wgrad` set) wrapped in megatron-core's
`DistributedDataParallel` (overlap_grad_reduce on and off): three micro-batches through
megatron-core's own `forward_step` (which divides by num_microbatches) and `backward_step` (which
applies `config.grad_scale_func`, here a loss scale of 4), the first two under `no_sync`, then
megatron-core's `finalize_model_grads`. The package's policy loss runs inside slime's
`loss_function`, wrapped by `main_grad.publishing` as the init hook wraps it. Every parameter's
`main_grad` after the step equals the unfused output layer's (its weight gradient through
autograd and DDP's hook) within 1e-5, with the sample-mean and the per-token (token_mean)
scalings; the output weight's gradient went into `main_grad` in the forward (its `.grad` only
carried megatron's dummy); a backward whose incoming gradient is not the scale raises naming both;
and forward-only passes (no grad mode) leave every `main_grad` untouched.
"""

import functools

import pytest
import torch
import upstream_slime
from distributed import get_pool
from numerics import assert_parity
from slime_harness import make_samples, micro_batch, slime_args

upstream_slime.require()

HIDDEN, VOCAB = 16, 40
TOTALS = [[9, 6], [7, 5, 8], [6, 10]]  # three micro-batches of one rank (dp rank shifts the seed)
RESPONSES = [[5, 2], [3, 1, 4], [4, 6]]
NUM_MICROBATCHES = len(TOTALS)
LOSS_SCALE = 4.0


def _model(config, tied: bool, seed: int):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class Tiny(torch.nn.Module):
        """Embedding lookup -> tanh(mix) -> the output layer, megatron's [s, b, h] in between."""

        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(seed)
            self.embedding = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5)
            self.mix = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
            self.output_layer = ColumnParallelLinear(
                HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False,
                skip_weight_param_allocation=tied,
            )  # fmt: skip
            if tied:
                self.embedding.zero_out_wgrad = True  # as megatron-core's LanguageModule sets it
            else:
                self.output_layer.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5)
            self.tied = tied

        def set_input_tensor(self, input_tensor):
            pass

        def forward(self, tokens):
            hidden = torch.tanh(self.embedding[tokens] @ self.mix).unsqueeze(1)
            out, _ = self.output_layer(hidden, weight=self.embedding if self.tied else None)
            return out.transpose(0, 1)

    return Tiny()


def _step(info, case, fused: bool, scale_error: bool = False):
    """One training step on this rank: every parameter's main_grad after it, the output weight's
    main_grad before the first backward, and (scale_error) the error a wrongly scaled backward raises."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.transformer.transformer_config import TransformerConfig

    import slime.backends.megatron_utils.loss as slime_loss

    from fusedrl.slime_ext import lm_head, main_grad
    from fusedrl.slime_ext.logprobs import get_log_probs_and_entropy

    overlap, tied, per_token = case
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True,
        calculate_per_token_loss=per_token,
    )  # fmt: skip
    model = _model(config, tied, seed=5)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=None), model
    )  # fmt: skip
    config.grad_scale_func = lambda loss: LOSS_SCALE * loss
    config.no_sync_func = ddp.no_sync
    layer = model.output_layer
    weight = model.embedding if tied else layer.weight
    if fused:
        lm_head.hand_off(layer)
    args = slime_args(
        entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, eps_clip_c=3.0,
        loss_aggregation="token_mean" if per_token else "sample_mean", calculate_per_token_loss=per_token,
    )  # fmt: skip
    loss_function = main_grad.publishing(slime_loss.loss_function)
    batches = []
    for i, (totals, responses) in enumerate(zip(TOTALS, RESPONSES)):
        samples = make_samples(100 * info.dp_rank + i, totals, responses, VOCAB)
        batch = micro_batch(samples, 0, 1)
        batch["tokens"] = torch.cat([s.tokens for s in samples])
        batch["rollout_mask_sums"] = [torch.tensor(total) for total in batch["rollout_mask_sums"]]  # slime's form
        batches.append(batch)
    step_global_batch_size = sum(len(t) for t in TOTALS) * info.dp_size

    def forward_step_func(data_iterator, model_):
        batch = next(data_iterator)
        output = model_(batch["tokens"])
        return output, functools.partial(loss_function, args, batch, NUM_MICROBATCHES, step_global_batch_size)

    ddp.zero_grad_buffer()
    seen = {}
    try:
        with torch.no_grad():  # a forward-only pass (old log-probs) computes no gradient
            get_log_probs_and_entropy(
                ddp(batches[0]["tokens"]), args=args, unconcat_tokens=batches[0]["unconcat_tokens"],
                total_lengths=batches[0]["total_lengths"], response_lengths=batches[0]["response_lengths"],
                with_entropy=True,
            )  # fmt: skip
        seen["untouched by forward-only"] = all(not bool(p.main_grad.any()) for p in model.parameters())
        data = iter(batches)
        for i in range(NUM_MICROBATCHES):
            context = ddp.no_sync() if i < NUM_MICROBATCHES - 1 else torch.enable_grad()
            with context:
                output, num_tokens = forward_step(
                    forward_step_func, data, ddp, NUM_MICROBATCHES, None, [], config, cp_group_size=1
                )  # fmt: skip
                if i == 0:
                    seen["after first forward"] = weight.main_grad.clone()
                if scale_error:
                    try:
                        backward_step(None, output * 3, None, ModelType.encoder_or_decoder, config)
                    except ValueError as error:
                        return str(error)
                    return None
                backward_step(None, output, None, ModelType.encoder_or_decoder, config)
                seen.setdefault("grad after backward", weight.grad)
        finalize_model_grads([ddp], num_tokens=None)
    finally:
        lm_head.restore()
    seen["main_grads"] = {name: p.main_grad.clone() for name, p in model.named_parameters()}
    return seen


def _rank(info, case):
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's buffers, on these CPU workers
    upstream_slime.load()
    return {fused: _step(info, case, fused) for fused in (False, True)}, _step(info, case, True, scale_error=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("per_token", [False, True], ids=["sample_mean", "per_token"])
def test_main_grad_equals_the_unfused_path(overlap, tied, per_token):
    for results, scale_error in get_pool(1, 1, dp=2).run(_rank, (overlap, tied, per_token)):
        unfused, fused = results[False], results[True]
        for seen in (unfused, fused):
            assert seen["untouched by forward-only"]
            assert seen["grad after backward"] is None  # DDP's hook took every .grad
        assert not bool(unfused["after first forward"].any())
        assert bool(fused["after first forward"].any())  # the one-pass forward added the weight gradient
        assert set(fused["main_grads"]) == set(unfused["main_grads"])
        for name, grad in fused["main_grads"].items():
            assert bool(grad.any()), name
            assert_parity(grad, unfused["main_grads"][name], 1e-5, name)
        assert scale_error is not None and "grad_scale" in scale_error and "incoming gradient" in scale_error
