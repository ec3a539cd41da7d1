"""Hub ids (`org/name[@revision]`) for models, tokenizers/processors and datasets (issue 34, 1).

No network: a tiny saved model and its local tokenizer are laid out as the Hub's cache holds a
download (`hub_cache_layout`), and everything runs with HF_HUB_OFFLINE=1 against it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from lmms_data import HubError, hub_cache_dir, is_hub_id, resolve_hub_path, split_hub_id
from lmms_train._metrics import read_jsonl
from lmms_train.cli import main


def hub_cache_layout(
    folder: Path, cache: Path, repo_id: str, *, repo_type: str = "model", ref: str = "main"
) -> str:
    """Lay `folder` out in `cache` as the Hugging Face Hub's cache holds a downloaded snapshot:
    `models--org--name/{blobs/<hash>, refs/<ref>, snapshots/<commit>/<file> -> blob}`. Returns
    the (made-up, deterministic) commit hash."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    digest = hashlib.sha1()
    for p in files:
        digest.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    commit = digest.hexdigest()
    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    for p in files:
        blob = repo / "blobs" / hashlib.sha256(p.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(p.read_bytes())
        link = repo / "snapshots" / commit / p.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return commit


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub cache holding `lmms-test/tiny-qwen2` (weights + tokenizer) and a text dataset."""
    from lmms_data import build_local_processor, generate_synthetic_text
    from lmms_models import get_model_spec

    root = tmp_path_factory.mktemp("hub")
    info = build_local_processor(str(root / "src"), "qwen2")
    spec = get_model_spec("qwen2")
    torch.manual_seed(0)
    model = spec.build(config=spec.tiny_config(vocab_size=info["vocab_size"] + 8))
    model.save_pretrained(root / "src")  # config.json + model.safetensors beside the tokenizer
    generate_synthetic_text(str(root / "data"), 48, seed=0)
    cache = root / "cache"
    commit = hub_cache_layout(root / "src", cache, "lmms-test/tiny-qwen2")
    shutil.copytree(root / "data", root / "data_repo")  # as on the Hub: metadata beside the shards
    (root / "data_repo" / "dataset_infos.json").write_text('{"default": {"splits": {}}}')
    (root / "data_repo" / "README.md").write_text("---\nlicense: mit\n---\n")
    data_commit = hub_cache_layout(
        root / "data_repo", cache, "lmms-test/shapes-text", repo_type="dataset"
    )
    return {"root": root, "cache": cache, "commit": commit, "data_commit": data_commit}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    return hub


def test_hub_id_syntax_and_cache_folder(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen2.5-VL-3B-Instruct") and is_hub_id("org/name@v1.0")
    assert split_hub_id("org/name@0123abc") == ("org/name", "0123abc")
    assert split_hub_id("org/name") == ("org/name", None)
    for local in ("./org/name", "/abs/name", "a/b/c", "name", "org/na--me", "org/..x"):
        assert not is_hub_id(local), local
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")  # an existing local folder wins
    assert resolve_hub_path("org/name") == "org/name"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"  # HF_HOME honoured
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"  # HF_HUB_CACHE wins


def test_offline_resolution_from_the_cache(offline):
    snap = offline["cache"] / "models--lmms-test--tiny-qwen2" / "snapshots" / offline["commit"]
    assert resolve_hub_path("lmms-test/tiny-qwen2") == str(snap)
    assert resolve_hub_path(f"lmms-test/tiny-qwen2@{offline['commit']}") == str(snap)
    data = resolve_hub_path("lmms-test/shapes-text", kind="dataset")  # its Parquet shards only
    snap = offline["cache"] / "datasets--lmms-test--shapes-text" / "snapshots"
    assert data == str(snap / offline["data_commit"] / "**" / "*.parquet")
    with pytest.raises(HubError) as exc:
        resolve_hub_path("lmms-test/not-there")
    msg = str(exc.value)
    assert "'lmms-test/not-there'" in msg and str(offline["cache"]) in msg and "\n" not in msg


def test_download_lock_times_out_with_a_clear_error(hub, monkeypatch):
    """Another process of the node holds the download lock: the wait ends with one line
    (online mode, but the lock comes before any network use)."""
    import hashlib

    from filelock import FileLock

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    key = hashlib.sha1(b"model:lmms-test/busy").hexdigest()[:16]
    lock = FileLock(str(hub["cache"] / ".locks" / "lmms" / f"{key}.lock"))
    (hub["cache"] / ".locks" / "lmms").mkdir(parents=True, exist_ok=True)
    with lock, pytest.raises(HubError, match="waited 0 s for another process of this node"):
        resolve_hub_path("lmms-test/busy", timeout_s=0.2)


def test_unreachable_hub_falls_back_to_the_cache(hub, monkeypatch):
    """Online mode (HF_HUB_OFFLINE unset) with the Hub unreachable (a closed local port): the
    download path takes the node lock, fails to connect, and uses the cached snapshot; an id not
    cached is one line."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    snap = hub["cache"] / "models--lmms-test--tiny-qwen2" / "snapshots" / hub["commit"]
    assert resolve_hub_path("lmms-test/tiny-qwen2") == str(snap)
    with pytest.raises(
        HubError, match="'lmms-test/elsewhere' is no local path, and as a Hub model"
    ):
        resolve_hub_path("lmms-test/elsewhere")


def _config(out, model: str, data: str, **model_keys) -> dict:
    return {
        "model_config": {"load_from_pretrained_path": model, **model_keys},
        "dataset_config": {"dataset_path": data, "packing_length": 256, "num_workers": 0},
        "trainer_args": {"output_dir": str(out), "max_steps": 2, "report_to": [],
                         "learning_rate": 1e-3, "save_final": False, "seed": 0},
    }  # fmt: skip


def test_train_from_hub_ids_offline(offline, tmp_path, capsys):
    """The real CLI trains 2 steps from `org/name` (model + tokenizer + dataset from the cache),
    then from `org/name@<commit>`; an id not in the cache is one error line naming the cache."""
    from e2e_helpers import write_config

    commit = offline["commit"]
    runs = {
        "main": _config(tmp_path / "a", "lmms-test/tiny-qwen2", "lmms-test/shapes-text"),
        "pinned": _config(
            tmp_path / "b", f"lmms-test/tiny-qwen2@{commit}", str(offline["root"] / "data"),
            processor_path=f"lmms-test/tiny-qwen2@{commit}",
        ),
    }  # fmt: skip
    losses = {}
    for name, cfg in runs.items():
        path = write_config(cfg, tmp_path / f"{name}.yaml")
        assert main([str(path)]) == 0, capsys.readouterr().err
        rows = read_jsonl(tmp_path / ("a" if name == "main" else "b") / "metrics.jsonl")
        assert len(rows) == 2
        losses[name] = [r["loss"] for r in rows]
    assert losses["main"] == losses["pinned"]  # the same weights, tokenizer and records

    missing = write_config(
        _config(tmp_path / "c", "lmms-test/not-cached", "lmms-test/shapes-text"),
        tmp_path / "missing.yaml",
    )
    capsys.readouterr()
    assert main([str(missing)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lmms-train: error:")]
    assert len(lines) == 1, err
    assert "'lmms-test/not-cached'" in lines[0] and str(offline["cache"]) in lines[0]
    assert "HF_HUB_OFFLINE=1" in lines[0]


def test_a_local_folder_is_not_copied(offline, tmp_path):
    """A local folder named like an id stays local (nothing resolved, nothing copied)."""
    local = tmp_path / "lmms-test" / "tiny-qwen2"
    shutil.copytree(offline["root"] / "src", local)
    assert resolve_hub_path(str(local)) == str(local)


def test_hub_dataset_resumes_exactly(tmp_path, monkeypatch):
    """A dataset repo id streams from the cache's snapshot with lmms-data's readers: stopping
    after 7 batches and resuming from the state gives the uninterrupted run's batches."""
    import itertools
    import json

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmms_data import DatasetConfig, build_dataloader

    def processor(messages: list) -> dict:
        i = int(messages[0]["content"][0]["text"])
        ids = np.full(1 + i % 5, i, dtype=np.int64)
        return {"input_ids": ids, "labels": ids.copy(), "length": len(ids)}

    src = tmp_path / "src" / "data"
    src.mkdir(parents=True)
    for shard in range(2):
        msgs = [json.dumps([{"role": "user", "content": [{"type": "text", "text": str(i)}]},
                            {"role": "assistant", "content": "ok"}])
                for i in range(shard * 60, shard * 60 + 60)]  # fmt: skip
        pq.write_table(pa.table({"messages": msgs}), src / f"train-{shard}.parquet",
                       row_group_size=8)  # fmt: skip
    held_out = [json.dumps([{"role": "user", "content": [{"type": "text", "text": "1000"}]},
                            {"role": "assistant", "content": "ok"}])] * 8  # fmt: skip
    pq.write_table(pa.table({"messages": held_out}), src / "test-0.parquet")  # another split
    (tmp_path / "src" / "dataset_infos.json").write_text("{}")  # metadata, not records
    hub_cache_layout(tmp_path / "src", tmp_path / "cache", "org/ids", repo_type="dataset")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    cfg = DatasetConfig(dataset_path=resolve_hub_path("org/ids", kind="dataset"),
                        packing_length=16, shuffle_buffer=8, seed=3)  # fmt: skip

    def ids(batch: dict) -> list[int]:
        return [int(batch["input_ids"][a]) for a in batch["cu_seqlens"].tolist()[:-1]]

    def loader():
        return build_dataloader(cfg, processor, dp_rank=0, dp_world=1, num_workers=0)

    ref = [ids(b) for b in itertools.islice(iter(loader()), 20)]
    a = loader()
    first = [ids(b) for b in itertools.islice(iter(a), 7)]
    b = loader()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert first + [ids(x) for x in itertools.islice(iter(b), 13)] == ref
    seen = {i for batch in ref for i in batch}
    assert len(seen) > 60 and max(seen) < 120  # both train shards, not the test split


def test_sample_and_render_take_hub_ids(offline, capsys):
    """The checkpoint and --processor arguments of `sample` and `render` are resolved the same
    way: an id not in the cache is one line naming the argument, the id and the cache."""
    for argv in (["sample", "lmms-test/not-cached", "--prompt", "hi"],
                 ["render", "lmms-test/not-cached", "--out", "x.png"],
                 ["sample", "lmms-test/tiny-qwen2", "--prompt", "hi",
                  "--processor", "lmms-test/no-processor"]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("lmms-train: error:")]
        assert len(lines) == 1 and str(offline["cache"]) in lines[0], err
        assert ("--processor: 'lmms-test/no-processor'" in lines[0]) == ("--processor" in argv)
        assert "CHECKPOINT_DIR: 'lmms-test/not-cached'" in lines[0] or "--processor" in argv


def test_only_id_shaped_paths_are_resolved(offline, tmp_path):
    """In a config: ids resolve (model, processor, dataset); a data file's path and the folder a
    demo processor is built into stay as written."""
    from lmms_train._hub_ids import resolve_config_hub_ids
    from lmms_train.config import config_from_dict

    cfg = config_from_dict({
        "model_config": {"load_from_pretrained_path": "lmms-test/tiny-qwen2",
                         "processor_path": "demo/processor", "build_local_processor": True},
        "dataset_config": {"dataset_path": ["data/missing.jsonl", "lmms-test/shapes-text"]},
        "trainer_args": {"output_dir": str(tmp_path / "out")},
    })  # fmt: skip
    assert resolve_config_hub_ids(cfg) == []
    assert cfg.model_config.load_from_pretrained_path.endswith(offline["commit"])
    assert cfg.model_config.processor_path == "demo/processor"
    first, second = cfg.dataset_config.dataset_path
    assert first == "data/missing.jsonl" and second.endswith(
        f"{offline['data_commit']}/**/*.parquet"
    )


def test_plan_reads_hub_ids_offline(offline, tmp_path, capsys):
    """`lmms-train plan` resolves the model id as training does (from the cache, offline; its
    configs only: the model is built on meta); the data is not read, so a dataset id that is not
    cached is no problem; a model id that is not cached is the same one line."""
    from e2e_helpers import write_config

    cfg = _config(tmp_path / "a", f"lmms-test/tiny-qwen2@{offline['commit']}", "lmms-test/no-data")
    assert main(["plan", str(write_config(cfg, tmp_path / "plan.yaml")), "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("qwen2: ") and "B parameters" in out, out
    cfg = _config(tmp_path / "b", "lmms-test/not-cached", "lmms-test/no-data")
    assert main(["plan", str(write_config(cfg, tmp_path / "missing.yaml"))]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lmms-train: error:")]
    assert len(lines) == 1, err
    assert "model_config.load_from_pretrained_path: 'lmms-test/not-cached'" in lines[0]
    assert str(offline["cache"]) in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
