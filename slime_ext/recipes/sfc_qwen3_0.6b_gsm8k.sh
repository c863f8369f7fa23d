#!/usr/bin/env bash
# SFC + KL on GSM8K with Qwen3-0.6B, asynchronous training (slime's train_async.py), trainer and
# rollout engines on separate GPUs. Rollouts run one or more weight versions behind the trainer;
# SFC centers each token's score on K draws from the sampler and pulls stale tokens back toward it.
#
# Needs: slime checked out at $SLIME_DIR (its scripts/models/qwen3-0.6B.sh), fusedrl installed in
# the same environment as slime and SGLang (`pip install -e .`: registers the SGLang plugin), the
# HF checkpoint, its Megatron torch_dist conversion and GSM8K jsonl files (messages/label) below.
set -euo pipefail

SLIME_DIR=${SLIME_DIR:-/root/slime}
HF_CKPT=${HF_CKPT:-/root/Qwen3-0.6B}
REF_CKPT=${REF_CKPT:-/root/Qwen3-0.6B_torch_dist}
SAVE_DIR=${SAVE_DIR:-/root/Qwen3-0.6B_sfc}
TRAIN_DATA=${TRAIN_DATA:-/root/gsm8k/train.jsonl}
EVAL_DATA=${EVAL_DATA:-/root/gsm8k/test.jsonl}
TRAIN_GPUS=${TRAIN_GPUS:-4}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}

source "${SLIME_DIR}/scripts/models/qwen3-0.6B.sh"  # defines MODEL_ARGS

CKPT_ARGS=(--hf-checkpoint "${HF_CKPT}" --ref-load "${REF_CKPT}" --save "${SAVE_DIR}" --save-interval 50)

ROLLOUT_ARGS=(
  --prompt-data "${TRAIN_DATA}" --input-key messages --label-key label --apply-chat-template
  --rollout-shuffle --rm-type math
  --num-rollout 300 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 1024
  # SFC needs the untruncated sampling distribution at the training temperature.
  --rollout-temperature 1.0 --rollout-top-p 1.0 --rollout-top-k -1
  --global-batch-size 256
)

EVAL_ARGS=(--eval-interval 10 --eval-prompt-data gsm8k "${EVAL_DATA}" --n-samples-per-eval-prompt 1
  --eval-max-response-len 1024 --eval-top-p 1.0)

SFC_ARGS=(
  --loss-type custom_loss
  --custom-loss-function-path fusedrl.slime_ext.losses.sfc_loss
  --sfc-num-auxiliary-token-samples 8
  --sfc-kl-beta 0.1
  --sfc-loss-agg-mode sample-mean
  --advantage-estimator grpo
  --entropy-coef 0
)

OPTIMIZER_ARGS=(--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.98)

PERF_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
  --use-dynamic-batch-size --max-tokens-per-gpu 9216)

SGLANG_ARGS=(--rollout-num-gpus "${ROLLOUT_GPUS}" --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7)

MISC_ARGS=(--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32 --attention-backend flash)

ray start --head --num-gpus $((TRAIN_GPUS + ROLLOUT_GPUS)) --disable-usage-stats

# AGENTCORE_SGLANG_TOKEN_SAMPLES=1 reaches every Ray actor, the SGLang engines included: with it the
# plugin answers top_logprobs_num = K with the sampled token plus K draws at every position.
RUNTIME_ENV_JSON='{"env_vars": {"PYTHONPATH": "/root/Megatron-LM/", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "AGENTCORE_SGLANG_TOKEN_SAMPLES": "1"}}'

ray job submit --address="http://127.0.0.1:8265" --runtime-env-json="${RUNTIME_ENV_JSON}" -- \
  python3 -m fusedrl.slime_ext.train "${SLIME_DIR}/train_async.py" \
  --actor-num-nodes 1 --actor-num-gpus-per-node "${TRAIN_GPUS}" \
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${SFC_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}"
