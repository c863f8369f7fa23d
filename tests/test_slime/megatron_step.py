"""One training step of a small model through megatron-core's real schedule on gloo workers, with
slime's real `loss_function` and the package's policy loss: the fused LM head (`--fusedrl-fused-lm-head`,
the one-pass op) against the unfused output layer, for the Megatron configurations slime users run.

`Setup` names a configuration: the model (a tiny embedding -> mixing layer -> `ColumnParallelLinear`
model, or a megatron-core GPTModel built by slime's real model provider through `install`, per
pipeline stage and virtual stage), tied or untied embeddings, the parameters' dtype (megatron's
`Float16Module` for bf16 and fp16) and the grad buffers' (`main_grad` fp32, or the parameters'
dtype: --grad-reduce-in-bf16, --fp16 without --accumulate-allreduce-grads-in-fp32), megatron-core's
DistributedDataParallel options (overlap_grad_reduce, the distributed optimizer's reduce-scatter),
the loss scale (`config.grad_scale_func` on `get_model_config(model[0])`, as slime sets it), the
aggregation, --recompute-loss-function, and the steps' micro-batches: fixed, or packed by slime's
own `build_dp_schedule` under --use-dynamic-batch-size.

`step_results(info, setup)` runs on each rank, once unfused and once fused: a forward-only pass
through the schedule (no grad mode: every `main_grad` stays zero), then each step through
`get_forward_backward_func()` (no pipelining, 1F1B `forward_backward_pipelining_without_interleaving`
or the interleaved schedule, by the parallel sizes) with `finalize_model_grads`, and returns every
parameter's `main_grad` after each step, the gradient of the hidden states entering the output layer
per micro-batch, the output weight's `main_grad` after the first loss ran (before its backward) and its
`grad_added_to_main_grad` after the first step's backward, and
the error a loss the schedule scales by something else raises (without pipeline stages). The CUDA device megatron-core asks
for by name is the CPU here (`distributed.cuda_on_cpu`).
"""

import functools
from argparse import Namespace
from typing import NamedTuple, Optional, Tuple

import torch
from bench_package import import_bench
from distributed import cuda_on_cpu
from numerics import assert_parity
from slime_harness import make_samples, micro_batch, pack_rows, slime_args

import_bench()
from bench.slime_loop import upstream_slime  # noqa: E402

HIDDEN, VOCAB = 16, 40
FIXED_STEPS = (((9, 6), (7, 5, 8), (6, 10)),)  # one step of three micro-batches: each a tuple of sample lengths
# Four micro-batches of 16 tokens each: the interleaved schedule takes a multiple of pp micro-batches, and
# sizes its p2p buffers by `seq_length` even under `variable_seq_lengths` (megatron-core 0.16's
# `forward_backward_pipelining_with_interleaving`; Megatron-LM issue #2064), so micro-batches of other
# lengths arrive cut or padded to it (attention mask 16 long, hidden 15): one length for all of them.
PIPELINE_STEPS = (((9, 7), (6, 10), (5, 11), (8, 8)),)
# Samples of a multiple of 2 cp tokens: every cp rank's zigzag chunks (the first and last of four at cp 2)
# hold response rows; shorter or padded ones leave cp rank 0 with none.
CP_STEPS = (((12, 8), (16,), (8, 12)),)
RESPONSE_FRACTION = 0.6  # response length = this share of the sample (at least 1)
DYNAMIC_LENGTHS = (9, 6, 7, 5, 8, 6, 10, 4, 11, 3, 7, 9, 5, 12, 6, 8)  # samples, one rollout each
DYNAMIC = dict(max_tokens_per_gpu=16, global_batch_size=8)  # two steps of 8 rollouts


class Setup(NamedTuple):
    """A Megatron configuration of the step (see the module docstring)."""

    model: str = "tiny"  # "tiny" or "gpt" (slime's provider; needed for pipeline stages)
    tied: bool = False
    overlap: bool = False
    distributed_optimizer: bool = False
    dtype: str = "fp32"  # the parameters': fp32, bf16 or fp16
    main_grad_fp32: bool = True  # False: the grad buffer in the parameters' dtype
    loss_scale: float = 4.0
    aggregation: str = "sample_mean"  # --loss-aggregation (token_mean: --calculate-per-token-loss)
    divisor: Optional[float] = None  # --loss-aggregation-divisor for "constant"
    regularised: bool = True  # entropy bonus and KL loss on
    recompute: bool = False  # --recompute-loss-function
    dynamic: bool = False  # --use-dynamic-batch-size: micro-batches packed by slime's build_dp_schedule
    steps: tuple = FIXED_STEPS  # without dynamic batch size
    unwrapped_from: Optional[int] = None  # the micro-batch from which the loss runs outside slime's wrapper
    estimator: str = "grpo"  # --advantage-estimator; gspo's sequence-level ratio takes the recompute path
    m2po_tau: Optional[float] = None  # --fusedrl-m2po-tau: M2PO's trust region, which takes the recompute path too

    @property
    def per_token(self) -> bool:
        return self.aggregation == "token_mean"


GPT = {"tied": True, "layers": 1, "per_token": False}  # what `tiny_gpt` builds; set by the worker


def tiny_gpt(pre_process=True, post_process=True, vp_stage=None):
    """slime's custom model provider contract: a megatron-core GPTModel on CPU, one layer per
    pipeline chunk (GPT["layers"] in all), at this process's pipeline and virtual-pipeline sizes."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=GPT["layers"], hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_model_parallel_size=pipeline,
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=GPT["per_token"],
    )  # fmt: skip
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=32, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=GPT["tied"], position_embedding_type="learned_absolute",
        vp_stage=vp_stage,
    )  # fmt: skip


def _tiny(config, setup: Setup, info):
    """Embedding lookup -> tanh(mix) -> megatron-core's `ColumnParallelLinear` (this rank's vocabulary
    slice; tied: GPTModel's way, the embedding passed in and `zero_out_wgrad` set), [s, b, h] between."""
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(5)
            self.config, self.model_type = config, ModelType.encoder_or_decoder
            self.embedding = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5)
            self.mix = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
            output = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
            self.output_layer = ColumnParallelLinear(
                HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False,
                skip_weight_param_allocation=setup.tied,
            )  # fmt: skip
            if setup.tied:
                assert info.tp_size == 1, "the tiny model ties a replicated embedding: tp = 1 only"
                self.embedding.zero_out_wgrad = True  # as megatron-core's LanguageModule sets it
            else:
                self.output_layer.weight.data.copy_(output.chunk(info.tp_size)[info.tp_rank])

        def set_input_tensor(self, input_tensor):
            pass

        def forward(self, tokens):
            hidden = torch.tanh(self.embedding[tokens] @ self.mix).unsqueeze(1)
            out, _ = self.output_layer(hidden, weight=self.embedding if setup.tied else None)
            return out.transpose(0, 1)

    return Tiny()


def _transformer_config(setup: Setup, info):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=info.tp_size, use_cpu_initialization=True,
        tensor_model_parallel_size=info.tp_size, context_parallel_size=info.cp_size,
        calculate_per_token_loss=setup.per_token, fp16=setup.dtype == "fp16", bf16=setup.dtype == "bf16",
    )  # fmt: skip


class Chunks(NamedTuple):
    """The rank's model chunks as slime holds them (wrapped: Float16Module, DistributedDataParallel), the
    output weight (None off the last stage), the output layer, and the forward on packed tokens."""

    model: list
    weight: Optional[torch.Tensor]
    output_layer: Optional[torch.nn.Module]
    forward: object


def _wrapped(setup: Setup, module):
    """The chunk as megatron-LM's get_model wraps it: Float16Module under bf16 / fp16, then DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = module.config
    if setup.dtype != "fp32":
        module = Float16Module(config, module)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=setup.overlap, use_distributed_optimizer=setup.distributed_optimizer,
        grad_reduce_in_fp32=setup.main_grad_fp32,
    )  # fmt: skip
    return DistributedDataParallel(config, ddp_config, module)


def _build(setup: Setup, info, args, fused: bool) -> Chunks:
    from megatron.core import parallel_state

    from fusedrl.slime_ext import lm_head

    if setup.model == "tiny":
        raw = [_tiny(_transformer_config(setup, info), setup, info)]
        if fused:
            lm_head.hand_off(raw[0].output_layer)
        last = raw[0]
    else:
        import slime.backends.megatron_utils.model as slime_model
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        import fusedrl.slime_ext as fusedrl_slime

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # no CUDA RNG to fork; dropout is 0
        chunks = info.vp_size or 1
        GPT.update(tied=setup.tied, layers=chunks * info.pp_size, per_token=setup.per_token)
        torch.manual_seed(0)  # every rank and both paths: the same weights
        build_args = Namespace(**vars(args), fusedrl_fused_lm_head=True, custom_model_provider_path=f"{__name__}.tiny_gpt")
        if fused:
            fusedrl_slime.install(build_args)
        provider = slime_model.get_model_provider_func(build_args, "actor")
        raw = []
        for stage in range(chunks):  # megatron-LM's get_model
            vp_stage = stage if info.vp_size else None
            first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            raw.append(provider(pre_process=first, post_process=last_stage, vp_stage=vp_stage))
        last = raw[-1] if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None
    model = [_wrapped(setup, chunk) for chunk in raw]
    if last is None:
        return Chunks(model, None, None, _forward_of(setup))
    weight = last.output_layer.weight
    if setup.tied:  # the weight the output layer multiplies: the first stage's embedding, or its copy on the last
        weight = last.embedding if setup.model == "tiny" else last.shared_embedding_or_output_weight()
    return Chunks(model, weight, last.output_layer, _forward_of(setup))


def _forward_of(setup: Setup):
    def forward(chunk, tokens):
        if setup.model == "tiny":
            return chunk(tokens)
        length = tokens.numel()
        causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)  # True: masked
        return chunk(input_ids=tokens.unsqueeze(0), position_ids=torch.arange(length).unsqueeze(0), attention_mask=causal)

    return forward


def _response_length(total: int) -> int:
    return max(1, int(total * RESPONSE_FRACTION))


def steps_of(setup: Setup, info) -> Tuple[list, list, list]:
    """(per step: the rank's micro-batches as sample-length tuples, num_microbatches, and the step's
    global batch size): fixed, or packed by slime's `build_dp_schedule` (dynamic batch size)."""
    if not setup.dynamic:
        per_step = [list(step) for step in setup.steps]
        return per_step, [len(step) for step in per_step], [sum(len(mb) for mb in step) * info.dp_size for step in per_step]
    from slime.utils.dp_schedule import build_dp_schedule

    schedule_args = Namespace(use_dynamic_batch_size=True, max_tokens_per_gpu=DYNAMIC["max_tokens_per_gpu"],
                              micro_batch_size=1, balance_data=False, balance_by_flops=False)  # fmt: skip
    parallel = dict(dp_size=info.dp_size, cp_size=info.cp_size, vpp_size=info.vp_size or 1,
                    microbatch_group_size_per_vp_stage=info.pp_size)  # fmt: skip
    partitions, micro_batches, counts, global_sizes = build_dp_schedule(
        schedule_args, parallel, list(DYNAMIC_LENGTHS), global_batch_size=DYNAMIC["global_batch_size"],
        rollout_indices=list(range(len(DYNAMIC_LENGTHS))),
    )  # fmt: skip
    mine = [tuple(DYNAMIC_LENGTHS[partitions[info.dp_rank][i]] for i in mb) for mb in micro_batches[info.dp_rank]]
    per_step, start = [], 0
    for count in counts:
        per_step.append(mine[start : start + count])
        start += count
    return per_step, counts, global_sizes


def _batches(info, step_index: int, micro_batches) -> list:
    batches = []
    for i, totals in enumerate(micro_batches):
        responses = [_response_length(total) for total in totals]
        samples = make_samples(1000 * step_index + 100 * info.dp_rank + i, totals, responses, VOCAB)
        batch = micro_batch(samples, info.cp_rank, info.cp_size)
        batch["tokens"] = pack_rows([s.tokens for s in samples], info.cp_rank, info.cp_size)
        batch["rollout_mask_sums"] = [torch.tensor(total) for total in batch["rollout_mask_sums"]]  # slime's form
        batches.append(batch)
    return batches


def _loss_args(setup: Setup):
    regularisers = dict(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1) if setup.regularised else {}
    divisor = {} if setup.divisor is None else dict(loss_aggregation_divisor=setup.divisor)
    return slime_args(
        eps_clip_c=None if setup.m2po_tau else 3.0, loss_aggregation=setup.aggregation,  # M2PO has no clip to bound
        calculate_per_token_loss=setup.per_token, recompute_loss_function=setup.recompute,
        advantage_estimator=setup.estimator, fusedrl_m2po_tau=setup.m2po_tau, **regularisers, **divisor,
    )  # fmt: skip


def _run_step(chunks: Chunks, setup: Setup, args, batches, num_microbatches, step_global_batch_size, *,
              forward_only=False, loss_factor=1.0, seen=None):  # fmt: skip
    """One pass of megatron's schedule over `batches` (each chunk reads them all, in order)."""
    import slime.backends.megatron_utils.loss as slime_loss
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from fusedrl.slime_ext import main_grad

    wrapped = main_grad.publishing(slime_loss.loss_function)
    seen = {} if seen is None else seen
    calls = iter(range(len(chunks.model) * len(batches)))

    def loss_func(batch, output):
        outside = setup.unwrapped_from is not None and next(calls) >= setup.unwrapped_from
        loss_function = getattr(wrapped, "__wrapped__", wrapped) if outside else wrapped
        loss, *rest = loss_function(args, batch, num_microbatches, step_global_batch_size, output)
        if chunks.weight is not None and hasattr(chunks.weight, "main_grad"):
            seen.setdefault("after first loss", chunks.weight.main_grad.clone())
        return (loss * loss_factor, *rest)

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return chunks.forward(chunk, batch["tokens"]), functools.partial(loss_func, batch)

    iterators = [iter(batches) for _ in chunks.model]
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=chunks.model, num_microbatches=num_microbatches, seq_length=max(int(b["tokens"].numel()) for b in batches),
        micro_batch_size=1, forward_only=forward_only,
    )  # fmt: skip
    return seen


def _schedule_config(chunks: Chunks, setup: Setup):
    """`get_model_config(model[0])` with slime's train-loop settings (model.py `train`)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks.model[0])
    config.grad_scale_func = lambda loss: setup.loss_scale * loss
    no_sync = [chunk.no_sync for chunk in chunks.model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return config


def _hidden_grads(chunks: Chunks) -> list:
    """The gradient of the hidden states entering the output layer, per micro-batch (filled in the backward)."""
    grads = []

    def record(layer, inputs):
        if inputs[0].requires_grad:
            inputs[0].register_hook(grads.append)

    if chunks.output_layer is not None:
        chunks.output_layer.register_forward_pre_hook(record)
    return grads


def _one_path(info, setup: Setup, fused: bool) -> dict:
    import fusedrl.slime_ext as fusedrl_slime
    from fusedrl.slime_ext import lm_head

    args = _loss_args(setup)
    try:
        chunks = _build(setup, info, args, fused)
        _schedule_config(chunks, setup)
        hidden_grads = _hidden_grads(chunks)
        params = {f"{i}.{name}": p for i, chunk in enumerate(chunks.model) for name, p in chunk.module.named_parameters()}
        per_step, counts, global_sizes = steps_of(setup, info)
        results = {"main_grads": [], "hidden_grads": hidden_grads, "weight dtype": None}
        for index, (micro_batches, count, global_size) in enumerate(zip(per_step, counts, global_sizes)):
            batches = _batches(info, index, micro_batches)
            for chunk in chunks.model:
                chunk.zero_grad_buffer()
            with torch.no_grad():  # a forward-only pass (old log-probs) computes no gradient
                _run_step(chunks, setup, args, batches, count, global_size, forward_only=True)
            results.setdefault("untouched by forward-only", all(not bool(p.main_grad.any()) for p in params.values()))
            seen = _run_step(chunks, setup, args, batches, count, global_size)
            results.setdefault("after first loss", seen.get("after first loss"))
            results.setdefault("grad_added_to_main_grad", getattr(chunks.weight, "grad_added_to_main_grad", None))
            results["main_grads"].append({name: p.main_grad.clone() for name, p in params.items()})
            results.setdefault("grads left", [name for name, p in params.items() if p.grad is not None])
        results["hidden_grads"] = list(hidden_grads)
        if chunks.weight is not None:
            results["weight dtype"] = (chunks.weight.dtype, chunks.weight.main_grad.dtype)
        results["scale error"] = _scale_error(chunks, setup, args, info) if fused and info.pp_size == 1 else None
    finally:
        fusedrl_slime.uninstall()
        lm_head.restore()
    return results


def _scale_error(chunks: Chunks, setup: Setup, args, info) -> Optional[str]:
    """The error (or None) of a step whose loss the schedule scales by 3x what slime's chain says (not
    under pipeline stages: the last stage raises, and the others would wait for it forever)."""
    per_step, counts, global_sizes = steps_of(setup, info)
    for chunk in chunks.model:
        chunk.zero_grad_buffer()
    try:
        _run_step(chunks, setup, args, _batches(info, 0, per_step[0]), counts[0], global_sizes[0], loss_factor=3.0)
    except ValueError as error:
        return str(error)
    return None


def step_results(info, setup: Setup) -> dict:
    """{False: unfused, True: fused} results of this rank (see the module docstring)."""
    import os

    upstream_slime.load()
    interpret = os.environ.pop("TRITON_INTERPRET", None)  # the float64 reference per chunk: the kernels are not
    try:  # what this checks (tests/test_kernels/ are)
        with cuda_on_cpu():
            return {fused: _one_path(info, setup, fused) for fused in (False, True)}
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def assert_fused_matches_unfused(rank_results, tol: float, hidden_tol: Optional[float] = None) -> None:
    """On every rank: the same `main_grad` for every parameter after every step and the same hidden-state
    gradients (fused vs unfused, within `tol` / `hidden_tol`), nothing of it zero, no `.grad` left."""
    hidden_tol = tol if hidden_tol is None else hidden_tol
    mass = 0.0
    for results in rank_results:
        unfused, fused = results[False], results[True]
        for seen in (unfused, fused):
            assert seen["untouched by forward-only"]
            assert seen["grads left"] == []  # DDP's hook took every .grad
        assert len(fused["main_grads"]) == len(unfused["main_grads"])
        for step, (mine, theirs) in enumerate(zip(fused["main_grads"], unfused["main_grads"])):
            assert set(mine) == set(theirs)
            for name, grad in mine.items():
                assert bool(grad.any()), (step, name)
                assert_parity(grad, theirs[name], tol, f"step {step} {name}")
        assert len(fused["hidden_grads"]) == len(unfused["hidden_grads"])
        for i, (mine, theirs) in enumerate(zip(fused["hidden_grads"], unfused["hidden_grads"])):
            assert mine.dtype == theirs.dtype
            mass += float(theirs.abs().sum())
            assert_parity(mine, theirs, hidden_tol, f"hidden-state gradient of micro-batch {i}")
    assert mass > 0
