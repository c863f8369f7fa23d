"""The stale-rollouts task: a contextual target token, as language modelling.

The prompt is one context token (CONTEXTS of them, in a vocabulary of VOCAB); each context has a
fixed random target token, and the reward of a response is the fraction of its ANSWER_TOKENS
tokens equal to its context's target. Dense and learnable from a random initialisation; a single
global target would be learned by the output layer within a few steps, so staleness would barely
matter. The policy is a tiny random Llama (`write_model`) with a word-level tokenizer (`w<id>` is
token `<id>`) and no end-of-sequence token, so every response has ANSWER_TOKENS tokens.

slime reads the prompts from `write_prompts`' JSONL file (`--prompt-data`, keys `prompt` and
`label`) and scores each sample with `reward` (`--custom-rm-path target_task.reward`).
"""

import json
from pathlib import Path

import torch

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
    """A random LlamaForCausalLM (hidden 64, 2 layers, 4 heads in 2 groups, untied output layer)
    over the task's vocabulary, fp32, and its word-level tokenizer, in `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        LlamaForCausalLM(config).float().save_pretrained(directory)
    finally:
        torch.random.set_rng_state(state)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(directory)
    return directory


def score(response_tokens, label) -> float:
    """Fraction of the ANSWER_TOKENS answer slots holding the target `label`."""
    return sum(int(token) == int(label) for token in response_tokens) / ANSWER_TOKENS


async def reward(args, sample, **kwargs) -> float:
    """slime's custom reward (--custom-rm-path): `score` of the sample's response."""
    return score(sample.tokens[len(sample.tokens) - sample.response_length :], sample.label)
