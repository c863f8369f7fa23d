"""Every test-only stand-in for slime on a CPU machine, in one place: each replaces one real part that
such a machine cannot run (no GPU, no Ray cluster, no Megatron-LM training package), says which and
why, and sits at the boundary of slime's or megatron-core's code, never inside the package
(`slime_ext/` knows nothing of them).

Two layers:

- `install_import_stubs()`: packages a CPU test machine cannot import, stubbed only when missing
  (an installed one is always used), and `select_cpu_accelerator()`: a CPU entry in slime's device
  registry. `upstream_slime.load()` applies both for every test that imports slime's source.
- `run_on_cpu()`: what slime's synchronous training loop (`train.py`) meets at run time on CPU, for
  the loop test and the stale-rollouts study (`loop.py`), each put where slime or
  megatron-core looks it up: megatron-core's CUDA-only calls (`cpu_torch`,
  `clip_grad_by_total_norm_fp32`), TE's attention for packed sequences
  (`packed_sequence_attention`), the TE-only layer-norm name of slime's llama conversions
  (`te_layer_norm_name`), Megatron-LM's training package where slime's train actor calls it
  (`initialize_megatron`, `get_model`, `core_transformer_config_from_args`; its flags:
  `megatron_args`; its checkpoints, `save_checkpoint` / `load_checkpoint`), Ray's placement of the
  train actors (`allocate_train_actors`, behind `ActorHandle`s) and the end of a killed actor's
  process (`release_process_state`, for --release-train). `create_placement_groups` and
  `rollout_manager(...)` stand for train.py's Ray set-up (`loop.py` hands them to it): slime's own
  rollout manager around an SGLang server already running, behind `RouterForwarder`, the
  stand-in for SGLang's router, its engine's /pull_weights (`pull_weights`, for
  --update-weight-mode delta) the stand-in for a newer SGLang's.

- `use_newer_flags()`: a newer slime's parser (THUDM/slime at d88425a0) as far as the package meets
  it, for the tests of the package's flags (`test_upstream_slime_args.py`).

Any other name of a stubbed package resolves to a placeholder class that raises when called or
instantiated, naming the stub: code that strays onto a stubbed path fails loudly, never quietly.
"""

import copy
import dataclasses
import http.client
import http.server
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import threading
import types
from pathlib import Path

import torch

# ----------------------------------------------------------------------------- import boundary

# Stubbed package -> what it is and why a CPU test machine cannot import it.
STUBS = {
    "ray": "the Ray cluster runtime (actors and object store) is not installed on the CPU test machine",
    "httpx": "slime's HTTP client for SGLang servers (SGLang installs it); the tests without SGLang send no request",
    "sglang_router": "SGLang's router is a compiled extension, not installed on CPU",
    # megatron-core 0.19's wheel ships one that needs Python >= 3.12: where it does not import, it
    # is stubbed too (IMPORT_CHECKED)
    "megatron.training": "Megatron-LM's training package is not part of the megatron-core wheel up to 0.16",
    "wandb": "experiment tracking client (network), imported by slime's logging setup",
    "torch_memory_saver": "GPU memory offloading, CUDA only",
    "zstandard": "the delta weight updater's compressor, not among the test dependencies",
}


def _placeholder(qualified: str, why: str) -> type:
    """A class standing for `qualified`: usable in annotations, as a base or in isinstance
    checks, but calling or instantiating it raises."""

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{qualified} is stubbed by bench/slime_loop/stand_ins.py ({why}) and cannot run")

    return type(qualified.rpartition(".")[2], (), {"__init__": refuse, "__module__": qualified.rpartition(".")[0]})


class _StubModule(types.ModuleType):
    """A stubbed (sub)module: explicit attributes as set, any other name a placeholder."""

    def __init__(self, name: str, why: str):
        super().__init__(name, f"stub: {why}")
        self.__path__ = []  # a package, so its submodules import
        self.__why__ = why

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _placeholder(f"{self.__name__}.{attr}", self.__why__)
        setattr(self, attr, value)
        return value


def _stub_root(name: str):
    for root in STUBS:
        if name == root or name.startswith(root + "."):
            return root
    return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the stubbed packages (and any submodule of them) to `_StubModule`s. It sits first on
    `sys.meta_path` but answers only for the packages left in STUBS, which are missing or do not
    import here, so a really installed, working package always wins."""

    def find_spec(self, name, path=None, target=None):
        root = _stub_root(name)
        if root is None:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name, STUBS[_stub_root(spec.name)])
        _FILL.get(spec.name, lambda module: None)(module)
        return module

    def exec_module(self, module):
        pass


def _fill_ray(module) -> None:
    """Ray: an actor is the plain class (`ray.remote` returns what it decorates) and the object
    store is the identity (`ray.put` / `ray.get` hand the object back), so slime's actors run in
    the calling process, on this machine; `ActorHandle` gives them the `.remote()` calls of a Ray
    handle; `ray.kill` ends nothing (the killed actor's handle is dropped by its caller, slime's
    `RayTrainGroup.release`)."""

    def remote(*args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @ray.remote on a class or function: the plain object
        return lambda target: target  # @ray.remote(num_gpus=...)

    module.remote = remote
    module.put = lambda value, **kwargs: value
    module.get = lambda ref, **kwargs: ref
    module.is_initialized = lambda: False
    module.kill = lambda actor, **kwargs: release_process_state(actor)
    module.get_gpu_ids = lambda: [0]  # the one train actor's slot (slime's train_actor.py reads it)
    # the node's address, where slime's actors pick a rendezvous port: this machine
    module._private = types.SimpleNamespace(services=types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"))



def release_process_state(handle) -> None:
    """What the end of a killed train actor's process releases (--release-train kills the train
    actors after every push and starts new ones, `RayTrainGroup.release` / `create`): in this
    process, for a slime train actor whose process group is up, megatron-core's model-parallel
    groups, its micro-batch calculator, torch.distributed's default group, slime's `Timer` (a
    per-process singleton whose timers the actor leaves running) and the package's SFC age clock
    (emptied: the next actor must restore it as a new process would), so that the next actor's
    `init` sets them up afresh. Anything else ends nothing."""
    from fusedrl.slime_ext import age
    from megatron.core import num_microbatches_calculator, parallel_state
    from slime.observability.timer import Timer
    from slime.ray.train_actor import TrainRayActor
    from slime.utils.misc import SingletonMeta

    target = getattr(handle, "_target", handle)
    if not isinstance(target, TrainRayActor) or not torch.distributed.is_initialized():
        return
    SingletonMeta._instances.pop(Timer, None)
    age.CLOCK.restore(age.AgeClock().state())
    parallel_state.destroy_model_parallel()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    torch.distributed.destroy_process_group()

def _fill_megatron_global_vars(module) -> None:
    """Megatron-LM's `global_vars.set_args` / `get_args` keep the args as Megatron's do (slime's
    train actor sets them and hooks read them back); nothing else from the package runs."""
    holder = {}

    def set_args(args):
        holder["args"] = args

    def get_args():
        if "args" not in holder:
            raise RuntimeError("megatron.training.global_vars.get_args() before set_args(args)")
        return holder["args"]

    module.set_args, module.get_args = set_args, get_args


def _fill_router_launcher(module) -> None:
    """sglang_router's `RouterArgs`: slime's SGLang half of `parse_args` registers the router's
    flags from it; without the router they are left out (`RouterForwarder` takes no flags)."""
    module.RouterArgs = type("RouterArgs", (), {"add_cli_args": staticmethod(lambda parser, **kwargs: None)})


_FILL = {
    "ray": _fill_ray,
    "megatron.training.global_vars": _fill_megatron_global_vars,
    "sglang_router.launch_router": _fill_router_launcher,
}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install_import_stubs() -> None:
    """Register the stub finder once, for the packages that are missing or do not import.

    The stubs stay for the life of the process and would stand in for those packages for any code,
    so call it only in processes that run slime (spawned workers, the loop's process), never in the
    pytest process, where SGLang's own tests must see the packages as missing."""
    if any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        return
    for name in list(STUBS):
        parent = name.rpartition(".")[0]
        if (not parent or importlib.util.find_spec(parent) is not None) and _installed(name):
            if name not in IMPORT_CHECKED or _imports(name):
                del STUBS[name]
    sys.meta_path.insert(0, _StubFinder())


# Installed packages that may still not import on this Python, tried before they are trusted.
IMPORT_CHECKED = {"megatron.training"}  # megatron-core 0.19's: `from typing import override` (Python >= 3.12)


def _imports(name: str) -> bool:
    """Whether `name` imports; a failed import leaves none of its modules behind."""
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        return False


def select_cpu_accelerator() -> None:
    """slime's device registry (`slime.utils.accelerator`) knows CUDA and MUSA only: a CPU entry,
    registered and selected through slime's own `register_accelerator` / `set_accelerator`, so that
    slime's device calls (`accelerator.current_device()`, ...) answer "cpu"."""
    import psutil
    from slime.utils import accelerator

    class CPUAccelerator(accelerator.Accelerator):
        name = device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self):
            return True

        def device(self, index=None):
            return torch.device("cpu")

        def device_name(self, index=None):
            return "cpu"

        def set_device(self, index):
            pass

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def synchronize(self, device=None):
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self):
            pass

        def mem_get_info(self, device=None):
            memory = psutil.virtual_memory()  # the device is the host (slime clears memory when this is low)
            return (memory.available, memory.total)

        def memory_allocated(self, device=None):
            return 0

        def memory_reserved(self, device=None):
            return 0

    accelerator.register_accelerator("cpu", CPUAccelerator, lambda: True, communication_backends=("gloo",))
    accelerator.set_accelerator(CPUAccelerator())


# ----------------------------------------------------------------------------- run time, on CPU


class ActorHandle:
    """A Ray actor handle for an object in this process: `handle.method.remote(*args)` calls
    `object.method(*args)` at once and returns the result, which the stand-in `ray.get` hands back.
    slime's loop (train.py, the train group, the train actor) talks to its rollout manager,
    train actors and engines through such handles; on a CPU machine there is no Ray cluster to
    host them, and their placement groups would ask for GPU bundles."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return types.SimpleNamespace(remote=getattr(self._target, name))


class _RouterServer(http.server.ThreadingHTTPServer):
    """The forwarder's HTTP server, with a listen backlog for a whole rollout's requests at once:
    slime opens up to `--sglang-server-concurrency` (512) connections together, and the standard
    library's backlog of 5 dropped most of them, each then retried by slime after a second's sleep
    (22 s of a 16-step rollout's 25 spent so)."""

    request_queue_size = 1024
    daemon_threads = True


class RouterForwarder:
    """SGLang's router (the sglang_router extension, not installed on CPU) in front of one engine:
    every request is forwarded to the engine unchanged, and `GET /workers` lists that engine, as
    slime's rollout abort reads it (`sglang_rollout.abort`). Serves on a free loopback port from a
    daemon thread until `stop()`."""

    def __init__(self, engine_host: str, engine_port: int, host: str = "127.0.0.1"):
        self.engine = (engine_host, engine_port)
        engine_url = f"http://{engine_host}:{engine_port}"
        forwarder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # the engine logs the requests
                pass

            def do_GET(self):
                if self.path == "/workers":
                    self._reply(200, json.dumps({"workers": [{"id": "0", "url": engine_url}]}).encode())
                else:
                    self._forward("GET")

            def do_POST(self):
                self._forward("POST")

            def _forward(self, method: str):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                connection = http.client.HTTPConnection(*forwarder.engine, timeout=3600)
                try:
                    connection.request(method, self.path, body=body or None, headers={"Content-Type": "application/json"})
                    response = connection.getresponse()
                    self._reply(response.status, response.read())
                finally:
                    connection.close()

            def _reply(self, status: int, payload: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = _RouterServer((host, 0), Handler)
        self.host, self.port = self.server.server_address[:2]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Delegate(types.ModuleType):
    """A module whose names are `target`'s, but for the `overrides`."""

    def __init__(self, name, target, **overrides):
        super().__init__(name)
        self._target = target
        vars(self).update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def _on_cpu(factory):
    def on_cpu(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return on_cpu


def cpu_torch() -> types.ModuleType:
    """`torch` for a module whose code hard-codes the GPU: its tensor factories given
    `device="cuda"` (or `torch.cuda.current_device()`, which answers the CPU here) or
    `pin_memory=True` make plain CPU tensors; every other name is torch's own."""
    cuda = _Delegate("torch.cuda", torch.cuda, current_device=lambda: torch.device("cpu"))
    factories = {name: _on_cpu(getattr(torch, name)) for name in ("tensor", "zeros", "ones", "empty", "full", "empty_like", "zeros_like")}
    return _Delegate("torch", torch, cuda=cuda, **factories)


# The modules whose code hard-codes the GPU on slime's training path, and where.
CUDA_ONLY_MODULES = {
    "megatron.core.distributed.param_and_grad_buffer": "DDP's grad buffers on torch.cuda.current_device()",
    "megatron.core.optimizer.optimizer": "FP32Optimizer._scale on device='cuda'",
    "megatron.core.optimizer.clip_grads": "the gradient norm's buffers on device='cuda'",
    "megatron.core.utils": "local_multi_tensor_l2_norm's result on device='cuda'",
    "megatron.core.pipeline_parallel.schedules": "forward_backward_no_pipelining's total_num_tokens on device='cuda'",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE's inv_freq moved to torch.cuda.current_device()",
    "slime.utils.tensor_backper": "TensorBackuper's host copies in pinned memory (pinning needs a GPU)",
}


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's gradient clip (megatron/core/optimizer/clip_grads.py), which asserts that
    every gradient is a `torch.cuda.FloatTensor`: the same in-place scaling of each gradient by
    max_norm / (total_norm + 1e-6) when that is below 1, on CPU gradients."""
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def packed_sequence_attention(forward):
    """megatron-core's local `DotProductAttention.forward`, which refuses packed sequences (slime's
    `get_batch` packs every micro-batch, qkv_format "thd") and asks for TE's attention, not
    installed on CPU: for packed input the same scaled softmax attention, computed exactly with a
    causal mask restricted to each sequence of `cu_seqlens_q` (block-diagonal); else `forward`."""

    def attention(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        # query [t, heads, d], key and value [t, groups, d]
        repeat = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        positions = torch.arange(query.size(0), device=query.device)
        ends = packed_seq_params.cu_seqlens_q[1:].to(device=query.device, dtype=torch.long)
        sequence = torch.bucketize(positions, ends, right=True)
        allowed = (sequence[:, None] == sequence[None, :]) & (positions[None, :] <= positions[:, None])
        scores = torch.einsum("qhd,khd->hqk", query, key) * self.softmax_scale
        probs = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1).to(value.dtype)
        return torch.einsum("hqk,khd->qhd", probs, value).reshape(query.size(0), -1)

    return attention


def te_layer_norm_name(name: str) -> str:
    """slime's llama weight conversions, to HF (megatron_to_hf/llama.py) and from HF
    (hf_to_megatron/qwen.py, which slime uses for llama), know the attention's input layer norm only
    by TE's fused name, `self_attention.linear_qkv.layer_norm_weight`; megatron-core's local layer
    spec (no TE on CPU) calls that parameter `input_layernorm.weight`: the name as TE's."""
    return name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")


def _to_hf_by_te_names(convert):
    return lambda args, name, param: convert(args, te_layer_norm_name(name), param)


def _from_hf_by_te_names(get_hf_tensor):
    return lambda name, reader, config: get_hf_tensor(te_layer_norm_name(name), reader, config)


def megatron_args(hf_config) -> dict:
    """Megatron-LM's flags that slime's loop reads and slime's parser leaves to Megatron (the
    megatron-core wheel has no argument parser: megatron/training/arguments.py): a Llama's shape from
    its HF config, as slime's model scripts (scripts/models/*.sh) give it, on one CPU rank in fp32
    with megatron-core's local layer spec, and Megatron-LM's defaults for the rest."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return {
        # the model (slime's scripts/models/llama*.sh)
        "num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
        "ffn_hidden_size": hf_config.intermediate_size, "num_attention_heads": hf_config.num_attention_heads,
        "group_query_attention": True, "num_query_groups": hf_config.num_key_value_heads, "kv_channels": head_dim,
        "max_position_embeddings": hf_config.max_position_embeddings, "seq_length": hf_config.max_position_embeddings,
        "decoder_seq_length": None, "position_embedding_type": "rope", "rotary_percent": 1.0,
        "rotary_base": int(hf_config.rope_parameters["rope_theta"]), "use_rope_scaling": False,
        "rotary_interleaved": False, "normalization": "RMSNorm", "norm_epsilon": hf_config.rms_norm_eps,
        "swiglu": True, "bias_swiglu_fusion": False, "add_bias_linear": False, "add_qkv_bias": False,
        "untie_embeddings_and_output_weights": not hf_config.tie_word_embeddings,
        "padded_vocab_size": hf_config.vocab_size, "make_vocab_size_divisible_by": 1,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02,
        # the implementation: no TE, no fusions, CPU tensors in fp32
        "transformer_impl": "local", "spec": None, "num_experts": None, "moe_grouped_gemm": False,
        "moe_use_legacy_grouped_gemm": False, "moe_use_upcycling": False, "qk_layernorm": False,
        "multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
        "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "moe_ffn_hidden_size": None, "moe_router_topk": 2,
        "moe_layer_freq": 1, "mtp_num_layers": None, "fp8_param_gather": False,
        "fp16_lm_cross_entropy": False, "fp16": False, "bf16": False, "params_dtype": torch.float32,
        "use_cpu_initialization": True, "perform_initialization": True, "attention_softmax_in_fp32": True,
        "accumulate_allreduce_grads_in_fp32": False, "masked_softmax_fusion": False,
        "bias_dropout_fusion": False, "apply_rope_fusion": False, "gradient_accumulation_fusion": False,
        # parallelism: one rank, gloo process groups
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None, "pipeline_model_parallel_comm_backend": None,
        "context_parallel_size": 1, "hierarchical_context_parallel_sizes": None, "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": None, "num_distributed_optimizer_instances": 1,
        "nccl_communicator_config_path": None, "use_tp_pp_dp_mapping": False, "enable_gloo_process_groups": True,
        "sequence_parallel": False, "data_parallel_size": 1, "use_distributed_optimizer": False,
        "overlap_grad_reduce": False, "overlap_param_gather": False, "align_grad_reduce": True,
        "align_param_gather": False, "data_parallel_random_init": False, "te_rng_tracker": False,
        "inference_rng_tracker": False, "enable_experimental": False, "deterministic_mode": False,
        "tp_comm_overlap": False, "rampup_batch_size": None, "decrease_batch_size_if_needed": False,
        # the optimizer (Megatron-LM's defaults), its schedule and the step
        "optimizer": "adam", "min_lr": 0.0, "weight_decay": 0.0, "start_weight_decay": 0.0, "end_weight_decay": 0.0,
        "weight_decay_incr_style": "constant", "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8,
        "lr_decay_style": "constant", "lr_decay_iters": None, "lr_wsd_decay_iters": None,
        "lr_wsd_decay_style": "exponential", "lr_warmup_fraction": None, "lr_warmup_iters": 0,
        "lr_warmup_init": 0.0, "use_checkpoint_opt_param_scheduler": False, "override_opt_param_scheduler": False,
        "check_for_nan_in_loss_and_grad": True, "manual_gc": False, "log_num_zeros_in_grad": False,
        # checkpoints and profiling: none
        "pretrained_checkpoint": None, "ckpt_step": None, "vocab_size": None, "tensorboard_dir": None,
        "use_pytorch_profiler": False,
    }  # fmt: skip


def core_transformer_config_from_args(args, config_class=None):
    """Megatron-LM's `core_transformer_config_from_args` (megatron/training/arguments.py), which
    slime's model provider calls: a TransformerConfig of every field the args name, with the
    conversions a Llama needs (SwiGLU, the norm epsilon, grouped-query attention)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config_class = config_class or TransformerConfig
    fields = {field.name for field in dataclasses.fields(config_class)}
    kwargs = {name: value for name, value in vars(args).items() if name in fields}
    kwargs.update(layernorm_epsilon=args.norm_epsilon, pipeline_dtype=args.params_dtype, deallocate_pipeline_outputs=True)
    kwargs["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    if args.swiglu:
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=args.bias_swiglu_fusion)
    return config_class(**kwargs)


def get_model(model_provider_func, model_type=None, wrap_with_ddp=True):
    """Megatron-LM's `get_model` (megatron/training/training.py), which slime's
    `setup_model_and_optimizer` calls, for one CPU rank without pipeline stages in fp32: the
    provider's model wrapped in megatron-core's DDP, as the one-chunk list slime keeps."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.training.global_vars import get_args

    args = get_args()
    model = model_provider_func(pre_process=True, post_process=True)
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if not wrap_with_ddp:
        return [model]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return [DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)]


def initialize_megatron(args) -> None:
    """slime's Megatron initialisation (backends/megatron_utils/initialize.py, `init`), less what
    needs Megatron-LM's training package (its tokenizer build), less megatron-core's CUDA RNG
    tracker (`model_parallel_cuda_manual_seed`: it seeds dropout on the GPU) and less its check for
    numpy 1.x (the test stack has numpy 2, which megatron-core runs with): the args set, the
    model-parallel groups, the host seeds as slime sets them, and the init hook
    (--custom-megatron-init-path)."""
    import random

    import numpy
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.training.global_vars import set_args
    from slime.backends.megatron_utils import initialize
    from slime.utils.misc import load_function

    set_args(args)
    initialize._initialize_distributed(args)
    seed = args.seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    init_num_microbatches_calculator(
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size, args.decrease_batch_size_if_needed,
    )  # fmt: skip
    if args.custom_megatron_init_path:
        load_function(args.custom_megatron_init_path)(args)



CHECKPOINT_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's, which slime's load reads to tell the format


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, **kwargs) -> None:
    """Megatron-LM's `save_checkpoint` (megatron/training/checkpointing.py; slime's `save` calls it
    under --save and --release-train): for one CPU rank, the model's, the optimizer's (unless
    --no-save-optim) and the scheduler's state and the host RNGs in --save/iter_NNNNNNN, and
    Megatron's tracker file naming that iteration."""
    import random

    import numpy
    from megatron.training.global_vars import get_args

    args = get_args()
    folder = Path(args.save) / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "iteration": iteration, "model": [chunk.state_dict() for chunk in model],
        "optimizer": None if args.no_save_optim else optimizer.state_dict(),
        "opt_param_scheduler": opt_param_scheduler.state_dict(),
        "rng": (random.getstate(), numpy.random.get_state(), torch.get_rng_state()),
    }  # fmt: skip
    torch.save(state, folder / "state.pt")
    (Path(args.save) / CHECKPOINT_TRACKER).write_text(str(iteration))


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, checkpointing_context=None, skip_load_to_model_and_opt=False, **kwargs):
    """Megatron-LM's `load_checkpoint` (slime's `load_checkpoint` calls it for a --load written by
    Megatron, as --release-train's next actors' is) for what `save_checkpoint` wrote: the model,
    the optimizer (unless --no-load-optim), the scheduler, the RNGs (unless --no-load-rng);
    (iteration, floating-point operations so far: 0)."""
    import random

    import numpy
    from megatron.training.global_vars import get_args

    args = get_args()
    iteration = int((Path(args.load) / CHECKPOINT_TRACKER).read_text())
    state = torch.load(Path(args.load) / f"iter_{iteration:07d}" / "state.pt", weights_only=False)
    for chunk, chunk_state in zip(ddp_model, state["model"], strict=True):
        chunk.load_state_dict(chunk_state)
    if optimizer is not None and not args.no_load_optim:
        if state["optimizer"] is None:
            raise ValueError(f"{args.load} holds no optimizer state (saved with --no-save-optim): pass --no-load-optim")
        optimizer.load_state_dict(state["optimizer"])
    if opt_param_scheduler is not None:
        opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    if not args.no_load_rng:
        python_rng, numpy_rng, torch_rng = state["rng"]
        random.setstate(python_rng)
        numpy.random.set_state(numpy_rng)
        torch.set_rng_state(torch_rng)
    return iteration, 0


def pull_weights(args, target_version: int) -> dict:
    """SGLang's /pull_weights (sglang.srt.weight_sync.disk_delta, in the SGLang builds slime's delta
    mode runs with; 0.5.23 has none), which slime's `SGLangEngine.pull_weights` calls, for one
    host: version 0 materialises the local checkpoint (--update-weight-local-checkpoint-dir) from
    --hf-checkpoint, the base the engine was launched on; version n applies the delta slime
    published in --update-weight-disk-dir/weight_vNNNNNN onto it, tensor by tensor in place
    (slime's default xor encoding; its checksums from the files' metadata), refusing a delta whose
    base is not the version the checkpoint holds or whose result fails its checksum."""
    import shutil

    import numpy
    import safetensors
    import zstandard
    from slime.utils.disk_delta import _tensor_locations, checksum

    local = Path(args.update_weight_local_checkpoint_dir)
    marker = local / "fusedrl_pulled_version"
    if target_version == 0:
        shutil.rmtree(local, ignore_errors=True)
        shutil.copytree(args.hf_checkpoint, local)
        marker.write_text("0")
        return {"success": True}
    source = Path(args.update_weight_disk_dir) / f"weight_v{target_version:06d}"
    metadata = json.loads((source / "model.safetensors.index.json").read_text())["metadata"]
    held = int(marker.read_text())
    if metadata["delta_encoding"] != "xor":
        raise ValueError(f"the stand-in applies slime's default xor deltas, not {metadata['delta_encoding']!r} ({source})")
    if int(metadata["base_version"]) != held:
        raise ValueError(f"{source} is a delta on version {metadata['base_version']}, the local checkpoint holds {held}")
    locations = _tensor_locations(str(local))
    for delta_file in sorted(source.glob("*.safetensors")):
        with safetensors.safe_open(str(delta_file), "np") as deltas:
            digests = deltas.metadata()
            for name in deltas.keys():
                path, offset, nbytes = locations[name]
                with open(path, "r+b") as tensor_file:
                    tensor_file.seek(offset)
                    old = numpy.frombuffer(tensor_file.read(nbytes), dtype=numpy.uint8)
                    diff = numpy.frombuffer(zstandard.ZstdDecompressor().decompress(deltas.get_tensor(name).tobytes()), numpy.uint8)
                    new = old ^ diff
                    if checksum(metadata["checksum_format"], new) != digests[name]:
                        raise ValueError(f"{name} of {delta_file} fails its {metadata['checksum_format']} checksum once applied")
                    tensor_file.seek(offset)
                    tensor_file.write(new.tobytes())
    marker.write_text(str(target_version))
    return {"success": True}


def create_placement_groups(args) -> dict:
    """train.py's GPU allocation (slime/ray/placement_group.py) asks Ray for placement groups of
    GPU bundles: here the one train actor takes slot 0 of no group, and the rollout side none (its
    engine is a server already running, `rollout_manager`)."""
    return {"actor": (None, [0], [0]), "rollout": (None, [], []), "critic": None}


def allocate_train_actors(group, pg, num_gpus_per_actor) -> None:
    """`RayTrainGroup._allocate_gpus_for_actor`: Ray actors on placement-group bundles; here the
    group's actors built in this process as Ray would build them,
    `MegatronTrainRayActor(world_size, rank, master_addr, master_port)`, behind `ActorHandle`s."""
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    world_size = group._num_nodes * group._num_gpus_per_node
    group._actor_handlers, master = [], (None, None)
    for rank in range(world_size):
        actor = ActorHandle((group._actor_cls or MegatronTrainRayActor)(world_size, rank, *master))
        if rank == 0:
            master = actor.get_master_addr_and_port.remote()
        group._actor_handlers.append(actor)


def rollout_manager(engine_host: str, engine_port: int):
    """train.py's `create_rollout_manager(args, pg)` for an SGLang server already running at
    `engine_host:engine_port`: slime's `RolloutManager` built as its `__init__` builds it (HTTP
    client, data source, rollout functions, the engine lock) but for its servers, which Ray would
    launch on rollout GPUs: one `SGLangEngine` naming the running server (`object.__new__`, as its
    `init` would leave it) behind a `RouterForwarder`. Returns that function; the forwarder stops
    with the manager's `dispose`."""

    def create_rollout_manager(args, pg):
        from slime.backends.sglang_utils.sglang_engine import SGLangEngine
        from slime.ray.rollout import RolloutManager, RolloutServer, ServerGroup
        from slime.ray.utils import Lock
        from slime.utils.http_utils import init_http_client
        from slime.utils.misc import load_function

        router = RouterForwarder(engine_host, engine_port)
        args.sglang_router_ip, args.sglang_router_port = router.host, router.port
        engine = object.__new__(SGLangEngine)
        engine.args, engine.rank, engine.worker_type, engine.node_rank = args, 0, "regular", 0
        engine.server_host, engine.server_port = engine_host, engine_port
        engine.router_ip, engine.router_port = router.host, router.port
        engine.pull_weights = lambda target_version: pull_weights(args, target_version)
        group = ServerGroup(args=args, pg=pg, all_engines=[ActorHandle(engine)], num_gpus_per_engine=1,
                            num_new_engines=1, router_ip=router.host, router_port=router.port)  # fmt: skip
        manager = object.__new__(RolloutManager)
        manager.pg, manager.args = pg, args
        init_http_client(args)
        manager.servers = {"default": RolloutServer(server_groups=[group], router_ip=router.host, router_port=router.port)}
        manager.data_source = load_function(args.data_source_path)(args)
        manager.generate_rollout = load_function(args.rollout_function_path)
        manager.eval_generate_rollout = load_function(args.eval_function_path)
        manager.custom_reward_post_process_func = manager.custom_convert_samples_to_train_data_func = None
        manager.rollout_engine_lock, manager.rollout_id, manager._health_monitors = ActorHandle(Lock()), -1, []
        dispose = manager.dispose
        manager.dispose = lambda: (dispose(), router.stop())
        return ActorHandle(manager), None

    return create_rollout_manager


def run_on_cpu() -> None:
    """Put the run-time stand-ins above in place (after `upstream_slime.load()`; once per process),
    each where slime's or megatron-core's code looks the real part up. `create_placement_groups`
    and `rollout_manager(...)` are train.py's to take (`loop.py`)."""
    from megatron.core.optimizer import optimizer
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from slime.backends.megatron_utils import actor, checkpoint, hf_to_megatron, megatron_to_hf, model, model_provider
    from slime.ray.actor_group import RayTrainGroup

    if getattr(DotProductAttention.forward, "_stand_in", False):
        return
    for name in CUDA_ONLY_MODULES:
        importlib.import_module(name).torch = cpu_torch()
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    DotProductAttention.forward = packed_sequence_attention(DotProductAttention.forward)
    DotProductAttention.forward._stand_in = True
    megatron_to_hf.convert_llama_to_hf = _to_hf_by_te_names(megatron_to_hf.convert_llama_to_hf)
    hf_to_megatron._LOADERS["llama"] = _from_hf_by_te_names(hf_to_megatron._LOADERS["llama"])
    model_provider.core_transformer_config_from_args = core_transformer_config_from_args
    model.get_model = get_model
    actor.init = initialize_megatron
    model.save_checkpoint, checkpoint._load_checkpoint_megatron = save_checkpoint, load_checkpoint
    RayTrainGroup._allocate_gpus_for_actor = allocate_train_actors


# The flags of slime d88425a0's slime/utils/arguments.py that 624b824 lacks: option -> add_argument
# keywords (name, choices and default as that file has them; help left out).
NEWER_FLAGS = {
    "--log-probs-backend": dict(choices=("torch", "triton"), default="torch"),  # add_train_arguments
    "--flush-cache-interval": dict(type=int, default=1),  # add_rollout_arguments
    "--pg-loss-type": dict(choices=["ppo", "reinforce"], default=None),  # add_algo_arguments
    "--use-score-centering": dict(action="store_true"),
    "--score-centering-top-k": dict(type=int, default=128),
}


def use_newer_flags() -> None:
    """Make this process's `slime.utils.arguments` a newer slime's, as far as the package meets it:
    its provider registers the custom arguments first and slime's groups after, these among them
    (so a custom `--pg-loss-type` collides as on the newer slime), and `slime_validate_args`
    returns `(args, restore_plan)` for a validated deep copy, leaving its argument untouched
    (restore_plan: None, no checkpoint to restore). Call after `load()`, in a spawned worker."""
    from slime.utils import arguments

    if getattr(arguments, "NEWER_FLAGS", None) is NEWER_FLAGS:
        return
    provider, validate = arguments.get_slime_extra_args_provider, arguments.slime_validate_args

    def get_slime_extra_args_provider(add_custom_arguments=None):
        add_slime_arguments = provider(add_custom_arguments)

        def add_newer_slime_arguments(parser):
            parser = add_slime_arguments(parser)
            for option, keywords in NEWER_FLAGS.items():
                parser.add_argument(option, **keywords)
            return parser

        return add_newer_slime_arguments

    def slime_validate_args(args):
        args = copy.deepcopy(args)
        validate(args)
        return args, None

    arguments.get_slime_extra_args_provider = get_slime_extra_args_provider
    arguments.slime_validate_args = slime_validate_args
    arguments.NEWER_FLAGS = NEWER_FLAGS
