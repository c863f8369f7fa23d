"""The stale-rollouts task: a contextual target token, as language modelling.

The prompt is one context token (CONTEXTS of them, in a vocabulary of VOCAB); each context has a
fixed random target token, and the reward of a response is the fraction of its ANSWER_TOKENS
tokens equal to its context's target. Dense and learnable from a random initialisation; a single
global target would be learned by the output layer within a few steps, so staleness would barely
matter. The policy is a tiny random Llama (`write_model`) with a word-level tokenizer (`w<id>` is
token `<id>`) and no end-of-sequence token, so every response has ANSWER_TOKENS tokens.

slime reads the prompts from `write_prompts`' JSONL file (`--prompt-data`, keys `prompt` and
`label`) and scores each sample with `reward` (`--custom-rm-path bench.slime_loop.target_task.reward`).
"""

import json
from pathlib import Path

import torch

from . import sglang_server

VOCAB = 64
CONTEXTS = 16
ANSWER_TOKENS = 8
TASK_SEED = 30  # the targets: one task for every run, whatever the run's seed


def targets() -> list:
    """The target token of each context (context token `c` is id `c`, 0 <= c < CONTEXTS)."""
    return torch.randint(VOCAB, (CONTEXTS,), generator=torch.Generator().manual_seed(TASK_SEED)).tolist()


def write_prompts(path: Path) -> Path:
    """One JSONL line per context: its token as the prompt, its target as the label."""
    lines = [json.dumps({"prompt": f"w{context}", "label": str(target)}) for context, target in enumerate(targets())]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_model(directory: Path, seed: int = 0) -> Path:
    """A random tiny Llama over the task's vocabulary, initialised with `seed`, with no
    end-of-sequence token, and its word-level tokenizer, in `directory`."""
    return sglang_server.llama_checkpoint(directory, VOCAB, seed=seed, max_positions=64, with_eos=False)


def score(response_tokens, label) -> float:
    """Fraction of the ANSWER_TOKENS answer slots holding the target `label`."""
    return sum(int(token) == int(label) for token in response_tokens) / ANSWER_TOKENS


async def reward(args, sample, **kwargs) -> float:
    """slime's custom reward (--custom-rm-path): `score` of the sample's response."""
    return score(sample.tokens[len(sample.tokens) - sample.response_length :], sample.label)
