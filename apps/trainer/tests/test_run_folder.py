"""One run per output folder (issue 34): a fresh run into a used folder is refused unless
`overwrite_output_dir`, pruning and `latest` stay inside the run's lineage, `metrics.jsonl`
keeps its history across resumes, and a resumed run follows its own config's LR schedule."""

from __future__ import annotations

import json

import pytest

from lmms_train import train
from lmms_train._optim_setup import build_schedule
from lmms_train.config import config_from_dict


@pytest.fixture
def cfg(text_config):
    """`cfg(out, **trainer_args)`: a 3-step text run (packs of 128 tokens) into `tmp_path / out`."""
    return lambda out, **trainer: config_from_dict(text_config(out, packing_length=128, **trainer))


def _expected_lrs(cfg, steps: int) -> list[float]:
    """The LR a fresh run of `cfg` logs at steps 1..`steps`."""
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.trainer_args.learning_rate)
    sched = build_schedule(opt, cfg.trainer_args)
    lrs = []
    for _ in range(steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


def test_resume_follows_the_new_schedule(cfg, logged_steps):
    """Run to step 3 of a 3-step cosine schedule, resume to 6 with another warmup, floor and
    peak: every logged LR (old steps' history kept) is the new schedule's from step 4 on."""
    kw = dict(lr_scheduler_type="cosine", warmup_steps=1, min_lr_ratio=0.0)
    train(cfg("run", **kw))
    new = cfg("run", max_steps=6, resume_from="latest", learning_rate=2e-3,
               lr_scheduler_type="linear", warmup_steps=2, min_lr_ratio=0.1)  # fmt: skip
    train(new)
    rows = logged_steps("run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the first 3 rows kept
    old = _expected_lrs(cfg("run", **kw), 3)
    assert [r["lr"] for r in rows[:3]] == pytest.approx(old)
    assert [r["lr"] for r in rows[3:]] == pytest.approx(_expected_lrs(new, 6)[3:], rel=1e-12)


def test_runs_in_one_folder_stay_apart(tmp_path, capsys, cfg, text_config, logged_steps):
    """The issue's sequence: a fresh run into a used folder is one error line (exit 2, nothing
    touched); a run resumed there from another folder's checkpoint prunes only its own lineage
    (the other run's newer step_000003 stays, its own step_000002 is kept), the end summary names
    its checkpoint, `latest` resumes its lineage, and `overwrite_output_dir` replaces the lot."""
    import yaml

    from lmms_train.cli import main

    x, y = tmp_path / "x", tmp_path / "y"
    train(cfg("x"))  # run A: steps 1-3, checkpoint step_000003
    before = sorted(str(p.relative_to(x)) for p in x.rglob("*"))
    path = tmp_path / "fresh.yaml"
    raw = yaml.safe_load(yaml.safe_dump(text_config("x", packing_length=128)))
    path.write_text(yaml.safe_dump(raw))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("lmms-train: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "holds another run (checkpoints/step_000003, metrics.jsonl)" in errors[0]
    assert "overwrite_output_dir: true" in errors[0]
    assert sorted(str(p.relative_to(x)) for p in x.rglob("*")) == before
    run_a = json.loads((x / "run.json").read_text())["run_id"]

    train(cfg("y", max_steps=1))  # run C
    train(cfg("x", max_steps=2, save_steps=1, save_total_limit=1,
               resume_from=str(y / "checkpoints" / "step_000001")))  # fmt: skip
    assert sorted(p.name for p in (x / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert f"wrote {x / 'metrics.jsonl'}, {x / 'checkpoints' / 'step_000002'}" in (
        capsys.readouterr().err
    )
    assert (x / f"metrics.{run_a}.jsonl").is_file()  # run A's history, set aside
    train(cfg("x", max_steps=4, save_total_limit=1, resume_from="latest"))
    err = capsys.readouterr().err
    assert "resumed from" in err and "step_000002 at step 2" in err
    assert sorted(p.name for p in (x / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    assert [r["step"] for r in logged_steps("x")] == [2, 3, 4]  # kept across the resume

    train(cfg("x", max_steps=1, overwrite_output_dir=True))
    assert sorted(p.name for p in (x / "checkpoints").iterdir()) == ["step_000001"]
    assert [r["step"] for r in logged_steps("x")] == [1]
    assert not list(x.glob("metrics.*.jsonl"))
    assert json.loads((x / "run.json").read_text())["run_id"] != run_a
