"""The worked family of docs/adding-a-model.md, run from the page (tests/test_adding_a_model_doc.py;
a module of its own so that the spawned ranks import it by name)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-a-model.md"
REGISTERED = 'register_model("olmo2")'
TEMP_NAME = "doc_worked_olmo2"


def worked_example() -> str:
    """The python code block that follows the page's worked-example marker."""
    text = DOC.read_text()
    marker = text.index("<!-- worked-example")
    block = re.search(r"```python\n(.*?)```", text[marker:], re.S)
    assert block is not None, "docs/adding-a-model.md: no python block after the marker"
    code = block.group(1)
    assert code.count(REGISTERED) == 1, f"the worked example must register with {REGISTERED}"
    assert len(code.splitlines()) <= 120, "the worked family is at most 120 lines"
    return code


def register(code: str) -> Any:
    """Run the block with its family renamed to ``TEMP_NAME``; returns the registered spec."""
    from lmms_models import get_model_spec

    code = code.replace(REGISTERED, f'register_model("{TEMP_NAME}")')
    exec(compile(code, str(DOC), "exec"), {"__name__": "adding_a_model_doc"})
    return get_model_spec(TEMP_NAME)


def unregister() -> None:
    from lmms_models import MODEL_REGISTRY

    MODEL_REGISTRY.pop(TEMP_NAME, None)


SAMPLES = [(12, None), (1, 0), (7, 3), (9, 2)]  # (text tokens, prompt tokens): a length-1 sample


def samples_of(spec: Any, model: Any) -> list[dict[str, Any]]:
    from lmms_models.testing import SampleSpec, make_sample

    gen = torch.Generator().manual_seed(1)
    specs = [SampleSpec(text=t) if p is None else SampleSpec(text=t, prompt=p) for t, p in SAMPLES]
    return [make_sample(spec, model.config, s, gen=gen) for s in specs]


def tiny(spec: Any, attn: str) -> Any:
    torch.manual_seed(0)
    return spec.build(config=spec.tiny_config(), attn_backend=attn)


def two_ranks(rank: int, world: int, code: str) -> dict[str, Any]:
    """SP 2 == SP 1 (the default SequenceParallel + UlyssesAttention) and FSDP2 2 == 1 process
    (each rank half of the samples), on the worked family."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import lmms_parallel as lp
    from lmms_models.testing import pack_samples
    from lmms_parallel.testing import run_cases
    from lmms_train._forward import call_through_root

    torch.set_num_threads(1)
    spec = register(code)
    model = tiny(spec, "varlen_sdpa")
    samples = samples_of(spec, model)
    whole = pack_samples(spec, model, samples)

    def step(batch: dict[str, Any], group: Any = None, norm: float = 1.0):
        model.zero_grad(set_to_none=True)
        loss, count = call_through_root(
            model, lambda: spec.packed_forward(model, batch, sp_group=group)
        )
        (loss / norm).backward()
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        full = {
            k: g.full_tensor() if isinstance(g, DTensor) else g.clone() for k, g in grads.items()
        }
        return float(loss), int(count), full

    ref_loss, n, ref = step(whole, norm=float(whole["num_loss_tokens"]))

    def worst(grads: dict[str, torch.Tensor]) -> float:
        return max(
            float((grads[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-8)) for k in ref
        )

    def sp() -> dict[str, Any]:
        group = dist.group.WORLD
        spec.set_attention(model, backend="varlen_sdpa", wrapper=lp.UlyssesAttention(group))
        handle = spec.install_sp(model, group)
        loss, count, grads = step(whole, group, norm=float(n))
        for g in grads.values():  # FSDP sums the gradients over the dp_shard x sp mesh
            dist.all_reduce(g)
        handle.remove()
        spec.set_attention(model, backend="varlen_sdpa")
        return {"loss": loss, "ref": ref_loss, "count": count, "n": n, "worst": worst(grads)}

    def fsdp() -> dict[str, Any]:
        half = pack_samples(spec, model, samples[2 * rank : 2 * rank + 2])
        lp.apply_fsdp(model, init_device_mesh("cpu", (2,)), blocks=spec.decoder_blocks(model),
                      param_dtype=None)  # fmt: skip
        loss, count, grads = step(half, norm=float(n))
        total = torch.tensor([loss, float(count)])
        dist.all_reduce(total)
        return {"loss": float(total[0]), "ref": ref_loss, "count": int(total[1]), "n": n,
                "worst": worst(grads)}  # fmt: skip

    try:
        return run_cases([("sp", sp), ("fsdp", fsdp)])
    finally:
        unregister()
