"""The run's HF export: weights (lmms_parallel.export_hf) plus everything `from_pretrained` users
need beside them, so the folder is a complete checkpoint.

`<output_dir>/hf/` holds `config.json`, `generation_config.json`, the safetensors shards (in
`trainer_args.export_dtype`), and the tokenizer, processor and chat template of the run (saved
through transformers from the run's processor folder). It loads with `AutoProcessor` (or
`AutoTokenizer` for text models) and the model's Auto class (`auto_class_for`), and generates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["EXPORT_DTYPES", "auto_class_for", "export_run", "save_processor"]

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Auto classes tried in order; the first whose mapping holds the model's config class wins
_AUTO = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForSeq2SeqLM",
         "AutoModelForVision2Seq", "AutoModelForMultimodalLM", "AutoModel")  # fmt: skip


def auto_class_for(config: Any, model_class: str) -> Any:
    """The transformers Auto class that builds `model_class` from `config` (None if none does)."""
    import transformers

    for name in _AUTO:
        auto = getattr(transformers, name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is None:
            continue
        try:
            cls = mapping[type(config)]
        except KeyError:
            continue
        classes = cls if isinstance(cls, tuple | list) else (cls,)
        if any(c.__name__ == model_class for c in classes):
            return auto
    return None


def save_processor(src: str | Path, out: str | Path) -> list[str]:
    """Save the processor (or tokenizer) of folder `src` into `out`; returns the files written.

    Loaded and re-saved through transformers rather than copied, so only processor files land in
    the export (never `src`'s weights or config) and they are in this transformers' format."""
    from transformers import AutoProcessor, AutoTokenizer

    before = set(Path(out).iterdir()) if Path(out).exists() else set()
    try:
        proc = AutoProcessor.from_pretrained(str(src), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        proc = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    proc.save_pretrained(str(out))
    return sorted(p.name for p in set(Path(out).iterdir()) - before)


def export_run(
    model: nn.Module,
    out_dir: str | Path,
    *,
    weights: nn.Module | None,
    processor_path: str | None,
    dtype: str = "auto",
    adapter: Any = None,
    adapter_dir: str | Path | None = None,
    writer: Any = None,
) -> Path | None:
    """Write the complete HF folder (rank 0 returns it; other ranks return None).

    `dtype`: `auto` keeps the masters' dtype (fp32 for a bf16 run), or `float32` / `bfloat16` /
    `float16`; `config.json` then names the same dtype, so `from_pretrained(dtype="auto")` loads
    the weights as written.

    `adapter` (lmms_models.LoraHandle, `model_config.lora`): `out_dir` gets the adapters merged
    into the upstream weights, and `adapter_dir` (if given) peft's adapter folder
    (`adapter_config.json` + `adapter_model.safetensors`, fp32 unless `dtype` says otherwise).
    `writer`: the family's own folder writer (`spec.export_writer(model)`; lmms_parallel.export_hf).
    """
    from lmms_parallel import export_hf

    torch_dtype = None if dtype == "auto" else EXPORT_DTYPES[dtype]
    transform = None
    if adapter is not None:

        def transform(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if adapter_dir is not None:
                cast = {
                    k: v.to(torch_dtype) if torch_dtype is not None and v.is_floating_point() else v
                    for k, v in full.items()
                    if ".lora_" in k
                }  # fmt: skip
                adapter.save_adapter(cast, adapter_dir)
            return adapter.merged_state(full)

    out = export_hf(
        model, out_dir, weights=weights, dtype=torch_dtype, transform=transform, writer=writer
    )
    if out is None:
        return None
    if torch_dtype is not None:
        conf_file = out / "config.json"
        conf = json.loads(conf_file.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in conf or key == "dtype":
                conf[key] = dtype
        conf_file.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    if processor_path:
        try:
            save_processor(processor_path, out)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the weights are written
            import sys

            print(
                f"[lmms-train] export: {out} has the weights, but the processor of "
                f"{processor_path} could not be saved beside them ({exc}); copy its tokenizer "
                "and processor files there by hand",
                file=sys.stderr,
                flush=True,
            )
    return out
