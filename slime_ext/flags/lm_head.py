"""--fusedrl-fused-lm-head: registered on slime's parser and checked at startup.

With the flag, the actor's output layer hands its hidden states to the loss instead of logits and
the log-prob path computes from them and the output weight (`slime_ext/lm_head.py`). Whatever
would read the model output as logits is refused here: MTP (megatron-core computes its loss from
the output layer's logits inside the model), slime's value loss, custom losses other than the
package's (they receive the model output as logits), and megatron's deferred embedding weight
gradient (it expects the output layer's own backward), and the newer megatron-core output layers
the hand-off does not reproduce: a weight sharded beyond tensor parallelism
(--tensor-parallel-num-weight-shards) and the MXFP8 projection (--fp8-output-proj). A critic keeps
the unfused path: only models built for the actor role hand off.
"""

from . import Switch
from .policy import LOSS_PATHS as POLICY_LOSS_PATHS
from .sfc import LOSS_PATHS as SFC_LOSS_PATHS

FLAG = "--fusedrl-fused-lm-head"
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")  # losses that read log-probs, never logits
CUSTOM_LOSS_PATHS = (*POLICY_LOSS_PATHS, *SFC_LOSS_PATHS)
SWITCH = Switch(
    FLAG,
    help="Compute the actor's log-probs, entropy and SFC scores from the output layer's hidden "
    "states and weight in row chunks (fusedrl.kernels.linear_token_stats; fusedrl's policy and "
    "SFC losses: linear_token_loss, the gradient made in the forward), never materialising "
    "the [T, V/tp] logits or their gradient. Refuses MTP, the value loss and custom losses "
    "other than fusedrl's.",
)
enabled = SWITCH.enabled  # whether slime's args ask for the fused LM head
add_arguments = SWITCH.add_arguments  # register --fusedrl-fused-lm-head on slime's parser


def validate_args(args) -> None:
    """Startup checks when the flag is on; ValueError naming the flag and the conflicting one."""
    if not enabled(args):
        return
    if getattr(args, "mtp_num_layers", None) or getattr(args, "enable_mtp_training", False):
        raise ValueError(
            f"{FLAG} cannot run with MTP (--mtp-num-layers / --enable-mtp-training): megatron-core "
            "computes the MTP loss from the output layer's logits inside the model"
        )
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{FLAG} needs a loss computed from log-probs ({', '.join(LOSS_TYPES)}), got --loss-type {loss_type}")
    path = getattr(args, "custom_loss_function_path", None)
    if loss_type == "custom_loss" and path not in CUSTOM_LOSS_PATHS:
        raise ValueError(
            f"{FLAG} hands the loss hidden states, not logits: --custom-loss-function-path must be one of "
            f"{CUSTOM_LOSS_PATHS}, got {path}"
        )
    if getattr(args, "defer_embedding_wgrad_compute", False):
        raise ValueError(
            f"{FLAG} cannot run with --defer-embedding-wgrad-compute: megatron would compute the output "
            "weight's gradient from logits gradients the fused head never forms"
        )
    weight_shards = getattr(args, "tensor_parallel_num_weight_shards", None)
    if weight_shards and weight_shards > getattr(args, "tensor_model_parallel_size", 1):
        raise ValueError(
            f"{FLAG} cannot run with --tensor-parallel-num-weight-shards {weight_shards} above "
            "--tensor-model-parallel-size (generalized tensor parallelism): the output weight would be a shard "
            "of this rank's vocabulary slice, gathered only inside megatron's own layer forward"
        )
    if getattr(args, "fp8_output_proj", False):
        raise ValueError(
            f"{FLAG} cannot run with --fp8-output-proj: megatron builds the output layer as "
            "TELMHeadColumnParallelLinear (an MXFP8 projection), whose quantized GEMM the fused head does not do"
        )
