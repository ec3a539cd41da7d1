"""Checkpoint layouts of released models that lmms reads and writes besides the families' own
upstream layouts: diffusion LMs (Dream's shifted layout, LLaDA's names and config), with the
models, not the objectives that train them (DESIGN.md, "The family contract")."""

from .dllm import DLLM_LAYOUTS, DllmCheckpoint, DllmLayout, export_dream, load_dllm, read_layout
from .llada import LLADA_MASK_TOKEN_ID, export_llada

__all__ = [
    "DLLM_LAYOUTS",
    "LLADA_MASK_TOKEN_ID",
    "DllmCheckpoint",
    "DllmLayout",
    "export_dream",
    "export_llada",
    "load_dllm",
    "read_layout",
]
