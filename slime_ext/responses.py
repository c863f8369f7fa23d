"""Where a micro-batch's response tokens sit on this rank, and the fused kernel run over them.

Every per-micro-batch path of the package (slime's log-prob path, the policy loss, the SFC loss)
needs the same steps: check the logits are slime's packed `[1, T, V/tp]`, find this rank's
context-parallel layout, list the logits rows that predict response tokens and the sampled token
each predicts, run `token_stats` over those rows only, and hand the per-token results back per
sample in the layout of slime's batch (zigzag; allgather-CP results are redistributed to it).
`ResponseTokens` does them once; the layouts themselves are the pure functions of
`context_parallel`. Under --fusedrl-fused-lm-head the model output is the output layer's hidden
states `[1, T, H]` instead (`lm_head`), and the kernel is `linear_token_stats` with the output
weight: same rows, same results.
"""

import os
from typing import List, NamedTuple, Optional, Sequence

import torch

from ..kernels import linear_token_stats, token_stats
from . import lm_head, main_grad, megatron
from .context_parallel import SampleRows, allgather_to_zigzag, local_response_rows

_values_checked = False


def check_values() -> bool:
    """Whether this kernel call checks its ids and rows values (a host sync and a sort each).

    Once per process, on the first call, where a vocabulary that does not match the rollouts'
    shows at once; on every call only under the debug switch `FUSEDRL_VALIDATE=1`. Later
    micro-batches skip them, so no host sync stands in the way of CUDA-graph capture; the rows
    are built here, correct by construction, and the ids come from the same rollouts.
    """
    global _values_checked
    first, _values_checked = not _values_checked, True
    return first or os.environ.get("FUSEDRL_VALIDATE") == "1"


class ResponseTokens(NamedTuple):
    """This rank's response tokens of one micro-batch.

    samples: per sample, the logits rows and the response positions they predict;
    rows: those rows concatenated (what the kernel reads; every other row gets zero gradient);
    allgather: the rows are an allgather-CP piece, whose results slime expects in zigzag layout.
    """

    samples: List[SampleRows]
    rows: torch.Tensor
    total_lengths: List[int]
    response_lengths: List[int]
    cp_rank: int
    cp_size: int
    allgather: bool

    @classmethod
    def locate(cls, logits: torch.Tensor, total_lengths, response_lengths, args) -> "ResponseTokens":
        """The response rows of `logits` (slime's `[1, T, V/tp]`) for the micro-batch's lengths,
        in the CP layout megatron-core and `args.allgather_cp` select."""
        if logits.dim() != 3 or logits.shape[0] != 1:
            raise ValueError(f"logits must have shape [1, T, V/tp], got {tuple(logits.shape)}")
        totals, responses = list(total_lengths), list(response_lengths)
        cp_rank, cp_size = megatron.cp_rank_and_size()
        allgather = bool(getattr(args, "allgather_cp", False)) and cp_size > 1
        device = logits.device
        samples = local_response_rows(
            totals, responses, cp_rank, cp_size, allgather_cp=allgather, local_length=logits.shape[1], device=device
        )
        rows = torch.cat([s.rows for s in samples]) if samples else torch.zeros(0, dtype=torch.long, device=device)
        return cls(samples, rows, totals, responses, cp_rank, cp_size, allgather)

    def targets(self, unconcat_tokens: Sequence[torch.Tensor]) -> torch.Tensor:
        """[N] int64: the sampled token each row predicts (token prompt_length + position)."""
        parts = [
            tokens[total - response + sample.positions.to(tokens.device)]
            for tokens, total, response, sample in zip(
                unconcat_tokens, self.total_lengths, self.response_lengths, self.samples, strict=True
            )
        ]
        targets = torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)
        return targets.to(self.rows.device)

    def at_positions(self, per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
        """The rows of full-response per-sample tensors `[response_length, ...]` at this rank's
        positions, concatenated in row order."""
        parts = [full[s.positions.to(full.device)] for full, s in zip(per_sample, self.samples, strict=True)]
        return torch.cat(parts).to(self.rows.device)

    def token_stats(self, output: torch.Tensor, ids: torch.Tensor, *, validate: Optional[bool] = None, **kwargs):
        """Token statistics of the response rows on Megatron's tensor-parallel group, from the
        model output: `token_stats` of the logits, or `linear_token_stats` of the hidden states and
        output weight when the output layer handed off (--fusedrl-fused-lm-head). validate: check
        the ids' and rows' values (default `check_values()`)."""
        validate = check_values() if validate is None else validate
        weight = lm_head.output_weight()
        if weight is None:
            return token_stats(output, ids, rows=self.rows, tp_group=megatron.tp_group(), validate=validate, **kwargs)
        lm_head.log_path_once("log-probs", "recompute path (linear_token_stats)")
        hidden, weight, into = main_grad.recompute_inputs(lm_head.hidden_rows(output, weight), weight)
        return linear_token_stats(
            hidden, weight, ids, rows=self.rows, tp_group=megatron.tp_group(), main_grad=into, validate=validate,
            **kwargs,
        )  # fmt: skip

    def per_sample(self, values: torch.Tensor) -> List[torch.Tensor]:
        """Per-row values `[N, ...]` split per sample, in the layout of slime's batch (zigzag)."""
        parts = list(values.split([s.rows.numel() for s in self.samples]))
        if not self.allgather:
            return parts
        return allgather_to_zigzag(
            parts, self.samples, self.total_lengths, self.response_lengths, self.cp_rank, self.cp_size, megatron.cp_group()
        )
