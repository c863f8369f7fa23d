"""SGLang plugin: the sampled token plus K random draws from its exact sampling distribution.

Server side: `plugin.register` (entry point `fusedrl_token_samples` in group
`sglang.srt.plugins`), active only under AGENTCORE_SGLANG_TOKEN_SAMPLES=1.
Client side: `client.parse_token_samples(meta_info, num_samples) -> TokenSamples`.
"""

from .client import TokenSamples, parse_token_samples

__all__ = ["TokenSamples", "parse_token_samples"]
