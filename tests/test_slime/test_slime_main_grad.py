"""The one-pass LM head's weight gradient straight into megatron-core's `main_grad`
(`slime_ext/main_grad.py`), under megatron-core's real DistributedDataParallel and schedule steps
and slime's real `loss_function` (FUSEDRL_SLIME_SRC; tests/upstream_slime.py).

Two gloo workers (dp = 2), each with its own micro-batches, run one training step of a tiny model
(embedding lookup, a mixing layer, a megatron-core `ColumnParallelLinear` output layer; untied, or
tied to the embedding as GPTModel ties it, `zero_out_wgrad` set) wrapped in megatron-core's
`DistributedDataParallel` (overlap_grad_reduce on and off): three micro-batches through
megatron-core's own `forward_step` (which divides by num_microbatches) and `backward_step` (which
applies `config.grad_scale_func`, here a loss scale of 4), the first two under `no_sync`, then
megatron-core's `finalize_model_grads`; also a one-layer megatron-core GPTModel built by slime's real
model provider through the init hook (`install`), tied and untied. The package's policy loss runs inside slime's
`loss_function`, wrapped by `main_grad.publishing` as the init hook wraps it. Every parameter's
`main_grad` after the step equals the unfused output layer's (its weight gradient through
autograd and DDP's hook) within 1e-5, with the sample-mean and the per-token (token_mean)
scalings; the output weight's gradient went into `main_grad` in the forward (its `.grad` only
carried megatron's dummy), except under --recompute-loss-function (slime's checkpoint runs the
loss twice: the per-call buffer, no scale assumed); a backward whose incoming gradient is not the scale raises naming both;
and forward-only passes (no grad mode) leave every `main_grad` untouched.
"""

import functools
from argparse import Namespace

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


class Built:
    """A model wrapped in megatron-core's DDP, its config, output weight and forward on packed tokens."""

    def __init__(self, ddp, config, weight, forward):
        self.ddp, self.config, self.weight, self.forward = ddp, config, weight, forward


def _ddp(config, model, overlap):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=overlap), model)
    config.grad_scale_func = lambda loss: LOSS_SCALE * loss
    config.no_sync_func = ddp.no_sync
    return ddp


def _tiny(overlap, tied, per_token, fused, args):
    """The tiny model above, its output layer handed off (fused) as the provider would."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fusedrl.slime_ext import lm_head

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True,
        calculate_per_token_loss=per_token,
    )  # fmt: skip
    model = _model(config, tied, seed=5)
    ddp = _ddp(config, model, overlap)
    if fused:
        lm_head.hand_off(model.output_layer)
    return Built(ddp, config, model.embedding if tied else model.output_layer.weight, ddp)


def _gpt(overlap, tied, per_token, fused, args):
    """A one-layer megatron-core GPTModel built by slime's real model provider, through the init
    hook's wrapper when fused (GPTModel sets `zero_out_wgrad` itself when tied)."""
    import slime.backends.megatron_utils.model as slime_model
    import test_slime_fused_lm_head_upstream as gpt
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    import fusedrl.slime_ext as fusedrl_slime

    assert not per_token
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # no CUDA RNG to fork; dropout is 0
    gpt.TIED[0] = tied
    torch.manual_seed(0)
    build_args = Namespace(**vars(args), fusedrl_fused_lm_head=True, custom_model_provider_path="test_slime_fused_lm_head_upstream.tiny_gpt")
    if fused:
        fusedrl_slime.install(build_args)
    model = slime_model.get_model_provider_func(build_args, "actor")(pre_process=True, post_process=True)
    ddp = _ddp(model.config, model, overlap)

    def forward(tokens):
        length = tokens.numel()
        causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)
        return ddp(input_ids=tokens.unsqueeze(0), position_ids=torch.arange(length).unsqueeze(0), attention_mask=causal)

    weight = model.embedding.word_embeddings.weight if tied else model.output_layer.weight
    return Built(ddp, model.config, weight, forward)


def _step(info, case, fused: bool, scale_error: bool = False):
    """One training step on this rank: every parameter's main_grad after it, the output weight's
    main_grad after the first forward, and (scale_error) the error a wrongly scaled backward raises."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step

    import slime.backends.megatron_utils.loss as slime_loss

    import fusedrl.slime_ext as fusedrl_slime
    from fusedrl.slime_ext import lm_head, main_grad
    from fusedrl.slime_ext.logprobs import get_log_probs_and_entropy

    overlap, tied, per_token, model_kind, recompute = case
    args = slime_args(
        entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, eps_clip_c=3.0,
        loss_aggregation="token_mean" if per_token else "sample_mean", calculate_per_token_loss=per_token,
        recompute_loss_function=recompute,
    )  # fmt: skip
    built = (_gpt if model_kind == "gpt" else _tiny)(overlap, tied, per_token, fused, args)
    ddp, config, weight = built.ddp, built.config, built.weight
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
        output = built.forward(batch["tokens"])
        return output, functools.partial(loss_function, args, batch, NUM_MICROBATCHES, step_global_batch_size)

    ddp.zero_grad_buffer()
    seen = {}
    try:
        with torch.no_grad():  # a forward-only pass (old log-probs) computes no gradient
            get_log_probs_and_entropy(
                built.forward(batches[0]["tokens"]), args=args, unconcat_tokens=batches[0]["unconcat_tokens"],
                total_lengths=batches[0]["total_lengths"], response_lengths=batches[0]["response_lengths"],
                with_entropy=True,
            )  # fmt: skip
        seen["untouched by forward-only"] = all(not bool(p.main_grad.any()) for p in ddp.module.parameters())
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
        fusedrl_slime.uninstall()
        lm_head.restore()
    seen["main_grads"] = {name: p.main_grad.clone() for name, p in ddp.module.named_parameters()}
    return seen


def _rank(info, case):
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's buffers, on these CPU workers
    upstream_slime.load()
    return {fused: _step(info, case, fused) for fused in (False, True)}, _step(info, case, True, scale_error=True)


# overlap_grad_reduce, tied, per-token loss, model, --recompute-loss-function
CASES = [(overlap, tied, per_token, "tiny", False) for overlap in (False, True) for tied in (False, True) for per_token in (False, True)]
CASES += [(True, True, False, "gpt", False), (False, False, False, "gpt", False), (True, False, False, "tiny", True)]


def _case_id(case):
    overlap, tied, per_token, model_kind, recompute = case
    names = ["overlap" if overlap else "no_overlap", "tied" if tied else "untied", "per_token" if per_token else "sample_mean"]
    return "-".join(names + [model_kind] + (["recompute_loss_function"] if recompute else []))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_main_grad_equals_the_unfused_path(case):
    recompute = case[4]
    for results, scale_error in get_pool(1, 1, dp=2).run(_rank, case):
        unfused, fused = results[False], results[True]
        for seen in (unfused, fused):
            assert seen["untouched by forward-only"]
            assert seen["grad after backward"] is None  # DDP's hook took every .grad
        assert not bool(unfused["after first forward"].any())
        # the one-pass forward added the weight gradient, except under --recompute-loss-function (per-call buffer)
        assert bool(fused["after first forward"].any()) != recompute
        assert set(fused["main_grads"]) == set(unfused["main_grads"])
        for name, grad in fused["main_grads"].items():
            assert bool(grad.any()), name
            assert_parity(grad, unfused["main_grads"][name], 1e-5, name)
        if recompute:
            assert scale_error is None  # no scale assumed: any incoming gradient scales the buffer
        else:
            assert scale_error is not None and "grad_scale" in scale_error and "incoming gradient" in scale_error
