"""`lmms-train sample`: decode text from a masked-diffusion checkpoint folder.

The folder is an HF-layout dLLM (what `export_hf: true` writes for `objective: masked_diffusion`,
or a Dream- or LLaDA-layout release; `lmms_models.layouts.load_dllm`); the tokenizer comes from
`--processor` (default: the folder itself). The prompt goes through the tokenizer's chat template
(a user turn and the assistant's header) unless `--raw`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmms_train._errors import UserError

__all__ = ["sample_text"]


def sample_text(
    folder: str,
    prompt: str,
    *,
    processor: str | None = None,
    gen_length: int = 32,
    steps: int = 32,
    block_length: int | None = None,
    temperature: float = 0.0,
    mask_token_id: int | None = None,
    chat: bool = True,
    show_steps: bool = False,
) -> str:
    """The decoded answer (with `show_steps`, one line per step before it, masks shown as `_`)."""
    from transformers import AutoTokenizer

    from lmms_models.layouts import load_dllm
    from lmms_models.objectives import diffusion_generate

    if not (Path(folder) / "config.json").is_file():
        raise UserError(f"sample: no config.json in {folder!r} (a local checkpoint folder)")
    tok_dir = processor or folder
    try:
        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"sample: no tokenizer in {tok_dir!r} (pass --processor DIR): {exc}"
        ) from None
    try:
        ckpt = load_dllm(folder, mask_token_id=mask_token_id)
    except (ValueError, OSError) as exc:
        raise UserError(f"sample: {exc}") from None
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tok(prompt)["input_ids"]
    try:
        res = diffusion_generate(
            ckpt.model, torch.tensor(ids, dtype=torch.long), mask_token_id=ckpt.mask_token_id,
            gen_length=gen_length, steps=steps, block_length=block_length,
            temperature=temperature, shift=ckpt.shift, keep_states=show_steps,
        )  # fmt: skip
    except ValueError as exc:
        raise UserError(f"sample: {exc}") from None
    lines = []
    for i, state in enumerate(res.states, 1):
        shown = [tok.decode([t]) if t != ckpt.mask_token_id else "_" for t in state.tolist()]
        lines.append(f"[step {i:3d}] " + "".join(shown).replace("\n", "\\n"))
    answer = res.tokens[res.prompt_length :].tolist()
    eos = tok.eos_token_id
    if eos is not None and eos in answer:
        answer = answer[: answer.index(eos)]
    lines.append(tok.decode(answer, skip_special_tokens=True))
    return "\n".join(lines)
