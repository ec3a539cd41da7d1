"""Iterative unmasking for masked-diffusion LMs (LLaDA's sampler, low-confidence remasking).

The answer starts as ``gen_length`` mask tokens after the prompt. It is filled block by block
(``block_length`` tokens, left to right: semi-autoregressive; one block = fully parallel); each
block gets ``steps / n_blocks`` denoising steps. Every step runs the bidirectional model on the
whole sequence, proposes a token for every masked position (argmax, or Gumbel-max sampling with
``temperature > 0``), and commits only the ``k`` proposals it is most confident in (softmax
probability of the proposed token) inside the current block; the others stay masked and are
proposed again next step ("low-confidence remasking"). ``k`` spreads the block's masked count
evenly over its steps, so after the last step nothing is masked.

The model call is the upstream forward (``[1, L, V]`` logits of one short sequence: sampling is
for looking at results, not a serving path). With ``shift=True`` (Dream-style checkpoints)
position ``i``'s logits predict token ``i + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["SampleResult", "diffusion_generate"]


@dataclass(kw_only=True, slots=True)
class SampleResult:
    tokens: torch.Tensor  # [P + G] prompt and generated ids
    prompt_length: int
    states: list[torch.Tensor] = field(default_factory=list)  # [G] answer after each step


def _spread(n: int, steps: int) -> list[int]:
    """``n`` split over ``steps`` as evenly as possible, earlier steps taking the remainder."""
    base, extra = divmod(n, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


@torch.no_grad()
def diffusion_generate(
    model: nn.Module,
    prompt: torch.Tensor,  # [P] int64
    *,
    mask_token_id: int,
    gen_length: int = 64,
    steps: int = 64,
    block_length: int | None = None,
    temperature: float = 0.0,
    shift: bool = False,
    keep_states: bool = False,
    generator: torch.Generator | None = None,
) -> SampleResult:
    """Generate ``gen_length`` tokens after ``prompt`` in ``steps`` unmasking steps."""
    block_length = block_length or gen_length
    if gen_length % block_length:
        raise ValueError(
            f"gen_length {gen_length} must be a multiple of block_length {block_length}"
        )
    n_blocks = gen_length // block_length
    if steps % n_blocks or steps < n_blocks:
        raise ValueError(f"steps {steps} must be a positive multiple of the {n_blocks} blocks")
    dev = next(model.parameters()).device
    p = prompt.numel()
    x = torch.full((p + gen_length,), mask_token_id, dtype=torch.long, device=dev)
    x[:p] = prompt.to(dev)
    result = SampleResult(tokens=x, prompt_length=p)
    for b in range(n_blocks):
        lo, hi = p + b * block_length, p + (b + 1) * block_length
        for k in _spread(int((x[lo:hi] == mask_token_id).sum()), steps // n_blocks):
            logits = model(input_ids=x[None], use_cache=False).logits[0].float()  # [L, V]
            if shift:  # row i predicts token i+1: align row i with token i
                logits = torch.cat([logits[:1], logits[:-1]])
            logits[:, mask_token_id] = -torch.inf  # never propose the mask itself
            probs = logits.softmax(-1)
            if temperature > 0:
                u = torch.rand(logits.shape, device=dev, generator=generator).clamp_(1e-20, 1.0)
                proposal = (logits / temperature - torch.log(-torch.log(u))).argmax(-1)
            else:
                proposal = logits.argmax(-1)
            conf = probs.gather(1, proposal[:, None]).squeeze(1)  # [L]
            eligible = torch.zeros_like(conf, dtype=torch.bool)
            eligible[lo:hi] = x[lo:hi] == mask_token_id
            conf = torch.where(eligible, conf, -torch.inf)
            if k > 0:
                pick = conf.topk(k).indices
                x[pick] = proposal[pick]
            if keep_states:
                result.states.append(x[p:].clone())
    return result
