"""The learner's reward: what the trainer's own weights score on the task, beside the reward of
the samples it trains on (the sampler's, which on stale rollouts is the policy of `lag` pushes
earlier).

At every weight push (one per rollout) the weights just pushed, the trainer's after the rollout's
optimizer steps, answer the task's prompts at the training temperature: EVAL_ANSWERS fresh answers
per context, sampled token by token from the HF checkpoint slime's `UpdateWeightFromDisk` wrote for
the push. These answers are held out: no optimizer step ever sees them. (The task has no other
prompts to hold out: each context's target is its own, so an unseen context has nothing to learn.)

It must not change the run it observes: it samples with a generator of its own, seeded by the
run's seed and the push, and runs under a fork of the process's random state (model construction
draws from torch's global generator), so the sampler, the data order and the optimizer see the
same random numbers with it as without it (`tests/test_slime/test_upstream_slime_loop.py` checks
the sampler's series bitwise).
"""

import random
from pathlib import Path

import torch

from . import target_task

EVAL_ANSWERS = 16  # answers per context: 256 per push, a standard error of the mean reward near 0.02


def evaluation_generator(seed: int, version: int) -> torch.Generator:
    """The stream the learner's answers at `version`'s push are drawn from (the run's seed, the push)."""
    return torch.Generator().manual_seed(1_000_003 * (seed + 1) + version)


def load_policy(config_dir: Path, weights_dir: Path):
    """The task's Llama from its config (`config_dir`) with the pushed weights (`weights_dir`, safetensors)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig.from_pretrained(config_dir)).float().eval()
    state = {}
    for path in sorted(Path(weights_dir).glob("*.safetensors")):
        state.update(load_file(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"the pushed checkpoint {weights_dir} does not match the task's model: missing {missing}, unexpected {unexpected}")
    return model


@torch.no_grad()
def sample_answers(model, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """[CONTEXTS * EVAL_ANSWERS, ANSWER_TOKENS]: answers sampled at `temperature`, every context
    EVAL_ANSWERS times (a context's prompt is its token)."""
    tokens = torch.arange(target_task.CONTEXTS).repeat_interleave(EVAL_ANSWERS)[:, None]
    for _ in range(target_task.ANSWER_TOKENS):
        logits = model(input_ids=tokens).logits[:, -1].double() / temperature
        drawn = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, drawn], dim=1)
    return tokens[:, 1:]


def learner_reward(config_dir: Path, weights_dir: Path, temperature: float, seed: int, version: int) -> float:
    """The mean reward of the pushed weights' held-out answers; the process's random state unchanged."""
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        model = load_policy(config_dir, weights_dir)
        answers = sample_answers(model, temperature, evaluation_generator(seed, version))
    random.setstate(python_state)
    labels = torch.tensor(target_task.targets()).repeat_interleave(EVAL_ANSWERS)
    return sum(target_task.score(answer.tolist(), label) for answer, label in zip(answers, labels.tolist())) / len(answers)
