"""Shared fixtures of the end-to-end trainer tests: made once per session, a tiny dataset +
processor, a LLaDA-layout folder and the tiny BAGEL example's straight run; per test, a SIGTERM
sent by the run's metrics sink."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for e2e_helpers (tests use importlib mode)


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory) -> dict[str, str]:
    """A 96-record synthetic dataset and a local processor, generated once."""
    from lmms_data import build_local_processor, generate_synthetic_vl

    root = tmp_path_factory.mktemp("tiny_inputs")
    generate_synthetic_vl(str(root / "data"), 96, format="parquet", seed=0)
    build_local_processor(str(root / "processor"), "qwen2_5_vl")
    return {"data": str(root / "data"), "processor": str(root / "processor")}


@pytest.fixture
def finished_run(tiny_inputs, tmp_path, capsys) -> tuple[Path, Path, str]:
    """A tiny 2-step run trained to the end in ``tmp_path / "out"``: (that folder, the run's
    config file, the folder's digest), for tests that start runs on it and check it is intact."""
    from e2e_helpers import tiny_config, tree_digest, write_config

    from lmms_train.cli import main

    out = tmp_path / "out"
    path = write_config(tiny_config(tiny_inputs, out, max_steps=2), tmp_path / "c.yaml")
    assert main([str(path)]) == 0
    capsys.readouterr()
    return out, path, tree_digest(out)


@pytest.fixture(scope="session")
def llada_inputs(tmp_path_factory) -> dict:
    """A LLaDA-layout folder written by hand (the release's config keys and parameter names),
    a local Qwen2 tokenizer and 96 text records (e2e_helpers.llada_config trains on them)."""
    from lmms_data import build_local_processor, generate_synthetic_text
    from lmms_models.testing_llada import llada_conf, llada_weights, write_llada

    root = tmp_path_factory.mktemp("llada")
    info = build_local_processor(str(root / "proc"), "qwen2")
    generate_synthetic_text(str(root / "data"), 96, seed=0)
    vocab = (info["vocab_size"] + 63) // 64 * 64
    mask = info["special_token_ids"]["<|audio_pad|>"]
    conf = llada_conf(vocab_size=vocab, embedding_size=vocab, mask_token_id=mask,
                      eos_token_id=info["special_token_ids"]["<|im_end|>"], pad_token_id=None)  # fmt: skip
    folder = write_llada(root / "llada", conf, llada_weights(vocab=vocab))
    return {"root": root, "folder": folder, "mask": mask, "vocab": vocab}


@pytest.fixture(scope="session")
def bagel_straight(tmp_path_factory) -> Path:
    """examples/bagel/tiny_cpu.yaml, 3 straight steps of 2 micro-batches from 2 loader workers
    (the packs 2 DP ranks with no workers see), exported with its EMA; the folder holding it
    (`straight/`), its data and processor."""
    pytest.importorskip("diffusers")
    from e2e_helpers import REPO, bagel_args

    from lmms_train import train
    from lmms_train.config import load_config

    tmp = tmp_path_factory.mktemp("bagel")
    train(load_config(REPO / "examples" / "bagel" / "tiny_cpu.yaml", bagel_args(tmp, "straight",
          "trainer_args.max_steps=3", "trainer_args.save_steps=0",
          "trainer_args.gradient_accumulation_steps=2", "dataset_config.num_workers=2")))  # fmt: skip
    return tmp


@pytest.fixture
def sigterm_after_logging(monkeypatch):
    """``arm(step)``: this process gets SIGTERM right after the run's metrics sink logs `step`
    (metrics are logged one step late, so the signal comes while step + 1 runs; the trainer saves
    and stops at the next step boundary). ``arm(None)`` disarms."""
    import lmms_train._metrics as metrics

    original = metrics.JsonlSink.log

    def arm(step: int | None) -> None:
        def log_and_term(self, logged, m):
            original(self, logged, m)
            if logged == step:
                os.kill(os.getpid(), signal.SIGTERM)

        monkeypatch.setattr(metrics.JsonlSink, "log", original if step is None else log_and_term)

    return arm
