#!/usr/bin/env bash
# SFC + KL on GSM8K with Qwen3-0.6B: the run of the score-function-centering description, as it was
# run. slime's train_async.py with the trainer and the SGLang engines on separate GPUs
# (TRAINER_GPUS, ROLLOUT_GPUS; the described results used 2 and 2), 64 prompts x 4 samples per
# rollout, 16 optimizer steps per rollout (global batch 16), lr 1e-6, token-sum aggregation
# (--sfc-loss-agg-mode token-sum: --loss-aggregation constant, divisor 1), beta_0 = 0.3, K = 8.
# Rollouts run at least one weight version behind the trainer (slime's async loop); SFC centers each
# token's score on K draws from the sampler and pulls stale tokens back toward it. (The described
# run also pushed weight snapshots three versions old through an experiment-only hook, not part of
# this recipe.)
#
# Usage: SLIME_DIR=... MODEL_DIR=... TRAIN_DATA_PATH=... MODEL_TYPE=... bash sfc_qwen3_0.6b_gsm8k.sh
# Needs: slime checked out at $SLIME_DIR (its scripts/models/$MODEL_TYPE.sh defines MODEL_ARGS),
# fusedrl installed where slime and SGLang run (`pip install -e .`: registers the SGLang plugin),
# the HF checkpoint at $MODEL_DIR and its Megatron torch_dist conversion at $REF_LOAD, and GSM8K
# jsonl files (messages / label).
set -euo pipefail

SLIME_DIR=${SLIME_DIR:-/root/slime}
MODEL_DIR=${MODEL_DIR:-/root/Qwen3-0.6B}
MODEL_TYPE=${MODEL_TYPE:-qwen3-0.6B}
REF_LOAD=${REF_LOAD:-${MODEL_DIR}_torch_dist}
SAVE_DIR=${SAVE_DIR:-${MODEL_DIR}_sfc}
TRAIN_DATA_PATH=${TRAIN_DATA_PATH:-/root/gsm8k/train.jsonl}
EVAL_DATA_PATH=${EVAL_DATA_PATH:-/root/gsm8k/test.jsonl}
TRAINER_GPUS=${TRAINER_GPUS:-4}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}

source "${SLIME_DIR}/scripts/models/${MODEL_TYPE}.sh"  # defines MODEL_ARGS

CKPT_ARGS=(--hf-checkpoint "${MODEL_DIR}" --ref-load "${REF_LOAD}" --save "${SAVE_DIR}" --save-interval 50)

ROLLOUT_ARGS=(
  --prompt-data "${TRAIN_DATA_PATH}" --input-key messages --label-key label --apply-chat-template
  --rollout-shuffle --rm-type math
  --num-rollout 300 --rollout-batch-size 64 --n-samples-per-prompt 4
  --num-steps-per-rollout 16
  --rollout-max-response-len 1024
  # SFC needs the untruncated sampling distribution at the training temperature.
  --rollout-temperature 1.0 --rollout-top-p 1.0 --rollout-top-k -1
)

EVAL_ARGS=(--eval-interval 10 --eval-prompt-data gsm8k "${EVAL_DATA_PATH}" --n-samples-per-eval-prompt 1
  --eval-max-response-len 1024 --eval-top-p 1.0)

SFC_ARGS=(
  --loss-type custom_loss
  --custom-loss-function-path fusedrl.slime_ext.losses.sfc_loss
  --custom-megatron-init-path fusedrl.slime_ext.install
  --sfc-num-auxiliary-token-samples 8
  --sfc-kl-beta 0.3
  --sfc-loss-agg-mode token-sum
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

ray start --head --num-gpus $((TRAINER_GPUS + ROLLOUT_GPUS)) --disable-usage-stats

# AGENTCORE_SGLANG_TOKEN_SAMPLES=1 reaches every Ray actor, the SGLang engines included: with it the
# plugin answers top_logprobs_num = K with the sampled token plus K draws at every position.
RUNTIME_ENV_JSON='{"env_vars": {"PYTHONPATH": "/root/Megatron-LM/", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "AGENTCORE_SGLANG_TOKEN_SAMPLES": "1"}}'

ray job submit --address="http://127.0.0.1:8265" --runtime-env-json="${RUNTIME_ENV_JSON}" -- \
  python3 -m fusedrl.slime_ext.train "${SLIME_DIR}/train_async.py" \
  --actor-num-nodes 1 --actor-num-gpus-per-node "${TRAINER_GPUS}" \
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${SFC_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}"
