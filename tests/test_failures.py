"""Failures during a run (docs/failures.md), each through the real CLI in-process: a full disk or
no permission during a save (a fault-injecting writer; a real tmpfs and a read-only mount where
the machine allows them), resume targets that are not checkpoints or of another model shape,
NaN/inf at a chosen step, two runs on one folder, the dataset changed under a resume, SIGTERM's
exit code. Each asserts the exit code, the line and that what was written before is intact."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from e2e_helpers import REPO, expect_failure, tiny_config, tree_digest, write_config

from lmms_train._metrics import read_jsonl
from lmms_train.cli import main


class _FailingStream:
    """A file whose writes fail with `err` after `budget` bytes, as a full disk would."""

    def __init__(self, stream, err: int, path: str, budget: int = 1024) -> None:
        self._stream, self._err, self._path, self._left = stream, err, path, budget

    def write(self, data) -> int:
        if len(data) > self._left:
            raise OSError(self._err, os.strerror(self._err), self._path)
        self._left -= len(data)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _fail_writes(monkeypatch, err: int, when: str, on_first=lambda: None) -> None:
    """DCP's writes to paths containing `when` fail with OSError(`err`); `on_first` runs first."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream
    calls = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            if when in str(path) and "w" in mode:
                if not calls:
                    on_first()
                calls.append(path)
                yield _FailingStream(stream, err, str(path))
            else:
                yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def test_full_disk_during_a_save_keeps_the_last_checkpoint(
    tiny_inputs, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    path = write_config(tiny_config(tiny_inputs, out, save_steps=2), tmp_path / "c.yaml")
    ck2 = out / "checkpoints" / "step_000002"
    seen: dict = {}
    with monkeypatch.context() as m:
        _fail_writes(m, errno.ENOSPC, "step_000004.tmp", lambda: seen.update(ck2=tree_digest(ck2)))
        expect_failure(
            main, [str(path)], capsys, "could not write the checkpoint of step 4:",
            "no space left on the device while writing", "step_000004.tmp was removed",
            f"the last good checkpoint is {ck2}",
        )  # fmt: skip
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000002"]
    assert seen["ck2"] and tree_digest(ck2) == seen["ck2"]
    assert main([str(path), "trainer_args.resume_from=latest"]) == 0  # the kept one resumes
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("err", "needle"),
    [
        (errno.EACCES, "permission denied for "),
        (errno.EROFS, "read-only file system while writing"),
    ],
)
def test_unwritable_checkpoints_folder_during_a_save(tmp_path, monkeypatch, err, needle):
    from lmms_train._checkpoint import RunCheckpointer
    from lmms_train._dist import DistEnv
    from lmms_train._errors import UserError
    from lmms_train._state import TrainState

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ck = RunCheckpointer(tmp_path, 3)
    kw = dict(model=model, optimizer=opt, scheduler=sched, state=TrainState(), data_state={})
    first = ck.save(step=1, env=DistEnv(), **kw)
    before = tree_digest(first)
    _fail_writes(monkeypatch, err, "step_000002.tmp")
    with pytest.raises(UserError) as info:
        ck.save(step=2, env=DistEnv(), **kw)
    message = str(info.value)
    assert needle in message and f"the last good checkpoint is {first}" in message, message
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001"]
    assert tree_digest(first) == before


def test_resume_targets_and_model_shape(finished_run, tmp_path, capsys):
    out, path, before = finished_run
    (tmp_path / "not_a_ckpt").mkdir()
    (tmp_path / "a_file").write_text("x")
    ckpt = out / "checkpoints" / "step_000002"
    for target, needle in (
        (out, f"is a run folder, not a checkpoint (its latest is {ckpt}"),
        (tmp_path / "not_a_ckpt", "is not a checkpoint folder (no COMPLETE marker or .metadata)"),
        (tmp_path / "a_file", "is a file, not a checkpoint folder"),
        (tmp_path / "nope", "does not exist"),
    ):
        expect_failure(main, [str(path), f"trainer_args.resume_from={target}"], capsys, needle)
    for name, damage, needle in (
        ("no_shard", lambda d: (d / "__0_0.distcp").unlink(), "FileNotFoundError"),
        ("bad_meta", lambda d: (d / ".metadata").write_bytes(b"x"), ".metadata: Unpickling"),
    ):  # a checkpoint folder whose files are incomplete or corrupt
        shutil.copytree(ckpt, tmp_path / name)
        damage(tmp_path / name)
        resume = f"trainer_args.resume_from={tmp_path / name}"
        expect_failure(main, [str(path), resume], capsys, needle, "incomplete or corrupt")
    wider = "model_config.load_from_config.config.text_config.intermediate_size=96"
    expect_failure(
        main, [str(path), "trainer_args.resume_from=latest", wider], capsys,
        f"the checkpoint {ckpt} does not fit this model: checkpoint has ", "[128, 64], model has [96, 64]",
        "the config differs from the checkpoint's: "
        "model_config.load_from_config.config.text_config: None -> {'intermediate_size': 96}",
    )  # fmt: skip
    assert tree_digest(out) == before  # config.yaml, metrics.jsonl, checkpoints untouched
    # a data-shape difference: the saved data position does not apply; said, or restarted
    args = ["trainer_args.resume_from=latest", "trainer_args.max_steps=3"]
    longer = [str(path), *args, "dataset_config.packing_length=512"]
    expect_failure(
        main, longer, capsys, "the data config changed (dataset_config.packing_length: 384 -> 512)",
        "on_data_change: restart",
    )  # fmt: skip
    assert tree_digest(out) == before
    assert main([*longer, "trainer_args.on_data_change=restart"]) == 0
    err = capsys.readouterr().err
    assert "differs from the checkpoint's: dataset_config.packing_length: 384 -> 512" in err, err


def _inject(monkeypatch, step: int, what: str, *, every: bool = False) -> None:
    """Make step `step` (and every later one with `every`) produce a non-finite `what`: `loss`
    (the forward's loss times inf) or `grad` (one gradient set to NaN after backward)."""
    import lmms_train._loop as loop

    real = loop.run_micro_batches
    calls = {"n": 0}

    def run_micro_batches(**kw):
        calls["n"] += 1
        hit = calls["n"] == step or (every and calls["n"] > step)
        if hit and what == "loss":
            forward = kw["forward"]
            kw["forward"] = lambda model, batch: (lambda ls, n: (ls * math.inf, n))(
                *forward(model, batch)
            )
        total = real(**kw)
        if hit and what == "grad":
            next(p for p in kw["model"].parameters() if p.grad is not None).grad.fill_(math.nan)
        return total

    monkeypatch.setattr(loop, "run_micro_batches", run_micro_batches)


@pytest.mark.parametrize(
    ("what", "quantity"), [("loss", "the loss is inf"), ("grad", "the gradient norm is nan")]
)
def test_non_finite_stops_before_anything_is_saved(
    tiny_inputs, tmp_path, capsys, monkeypatch, what, quantity
):
    out = tmp_path / "out"
    path = write_config(
        tiny_config(tiny_inputs, out, max_steps=6, save_steps=2), tmp_path / "c.yaml"
    )
    _inject(monkeypatch, 3, what)
    expect_failure(
        main, [str(path)], capsys, f"training diverged at step 3: {quantity}",
        f"the last good checkpoint is {out / 'checkpoints' / 'step_000002'}", "on_nonfinite: skip",
    )  # fmt: skip
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000002"]


def test_non_finite_skip_drops_the_update_and_counts_it(tiny_inputs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    cfg = tiny_config(tiny_inputs, out, on_nonfinite="skip", lr_scheduler_type="linear")
    path = write_config(cfg, tmp_path / "c.yaml")
    _inject(monkeypatch, 2, "grad")
    assert main([str(path)]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 1]
    assert rows[1]["grad_norm"] == "nan" and rows[2]["lr"] == rows[1]["lr"]  # schedule held
    assert "step 2: gradient norm nan, update skipped" in capsys.readouterr().err
    from torch.distributed.checkpoint import FileSystemReader

    assert FileSystemReader(str(out / "checkpoints" / "step_000004")).read_metadata()
    resume = ["trainer_args.resume_from=latest", "trainer_args.max_steps=5"]
    assert main([str(path), *resume]) == 0  # the count is part of the checkpoint
    assert read_jsonl(out / "metrics.jsonl")[-1]["skipped_steps"] == 1
    # a gradient that stays non-finite stops the run past max_nonfinite_skips
    _inject(monkeypatch, 2, "grad", every=True)
    over = ["trainer_args.max_nonfinite_skips=1", f"trainer_args.output_dir={tmp_path / 'o2'}"]
    expect_failure(
        main, [str(path), *over], capsys,
        "the gradient norm was non-finite (nan) for 2 steps in a row up to step 3",
    )  # fmt: skip


def test_no_checkpoint_holds_non_finite_weights(tmp_path):
    from lmms_train._checkpoint import RunCheckpointer
    from lmms_train._dist import DistEnv
    from lmms_train._errors import DivergenceError
    from lmms_train._state import TrainState

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[1, 2] = math.inf
    ck = RunCheckpointer(tmp_path, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DivergenceError, match="NaN/inf values, so no checkpoint was written"):
        ck.save(step=1, model=model, optimizer=opt, scheduler=None, state=TrainState(),
                data_state={}, env=DistEnv())  # fmt: skip
    assert not (tmp_path / "checkpoints").exists()


def test_flat_runs_warn_once(capsys):
    from lmms_train._guard import FLAT_STEPS, DivergenceGuard

    guard = DivergenceGuard(vocab_size=1000)
    for step in range(1, FLAT_STEPS + 5):
        guard.check(step, math.log(1000) * 1.001, 0.0)
    err = capsys.readouterr().err
    assert err.count("gradient norm has been exactly 0 for 3 steps (to step 3)") == 1, err
    assert (
        err.count(f"loss has stayed at ln(vocab size) = 6.908, a uniform guess, for {FLAT_STEPS}")
        == 1
    )


def test_sigterm_exits_75_after_saving(tiny_inputs, tmp_path, capsys, sigterm_after_logging):
    sigterm_after_logging(1)
    out = tmp_path / "out"
    path = write_config(tiny_config(tiny_inputs, out, max_steps=6), tmp_path / "c.yaml")
    assert main([str(path)]) == 75
    # step 1 is logged once step 2's work is queued: the signal comes during step 2, and the
    # save lands at the next step boundary, after step 2 (no further step runs)
    assert "SIGTERM: saved step 2 and stopped" in capsys.readouterr().err
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000002"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_sigterm_while_the_data_stalls(tiny_inputs, tmp_path, capsys, monkeypatch):
    """A loader that never yields again (a stalled file system, a bucket that never fills) does
    not hold SIGTERM: the wait is interrupted, the last finished step is saved, exit 75, and a
    resume continues from it."""
    import threading

    import lmms_train._data_setup as data_setup

    original = data_setup.TrainData.__iter__
    stalled = threading.Event()

    def stalls_after_two(self):
        it = original(self)
        for _ in range(2):
            yield next(it)
        stalled.set()
        threading.Event().wait()  # forever (a lock wait: signals interrupt it)

    def term_when_stalled():
        if stalled.wait(120):
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(data_setup.TrainData, "__iter__", stalls_after_two)
    threading.Thread(target=term_when_stalled, daemon=True).start()
    out = tmp_path / "out"
    path = write_config(tiny_config(tiny_inputs, out, max_steps=6), tmp_path / "c.yaml")
    t0 = time.monotonic()
    assert main([str(path)]) == 75
    assert time.monotonic() - t0 < 120
    assert "SIGTERM: saved step 2 and stopped" in capsys.readouterr().err
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000002"]
    monkeypatch.setattr(data_setup.TrainData, "__iter__", original)
    resume = ["trainer_args.resume_from=latest", "trainer_args.max_steps=3"]
    assert main([str(path), *resume]) == 0  # one step more, from the saved one
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_resume_after_the_dataset_files_changed(tiny_inputs, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny_inputs["data"], data)
    cfg = tiny_config(tiny_inputs, tmp_path / "out", max_steps=2)
    cfg["dataset_config"].update(dataset_path=str(data), eval_dataset_path=None)
    path = write_config(cfg, tmp_path / "c.yaml")
    assert main([str(path)]) == 0
    shard = sorted(data.glob("*.parquet"))[0]
    shutil.copy(shard, data / "zz-added.parquet")
    resume = [str(path), "trainer_args.resume_from=latest", "trainer_args.max_steps=3"]
    expect_failure(
        main, resume, capsys, "the dataset files changed: 1 file(s) added (e.g. zz-added.parquet)",
        "since the checkpoint", "on_data_change: restart",
    )  # fmt: skip
    assert main([*resume, "trainer_args.on_data_change=restart"]) == 0
    assert "the data order restarts" in capsys.readouterr().out


def test_one_run_per_output_folder(tiny_inputs, tmp_path, capsys):
    """A second run on a folder in use is refused; the lock of a run killed with SIGKILL is
    not stuck."""
    out = tmp_path / "out"
    long = write_config(tiny_config(tiny_inputs, out, max_steps=100000), tmp_path / "long.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    first = subprocess.Popen(
        [sys.executable, "-m", "lmms_train", str(long)], cwd=REPO, env=env, stdout=log, stderr=log
    )
    try:
        deadline = time.time() + 240
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            assert time.time() < deadline, "the first run did not start"
            time.sleep(0.5)
        config = (out / "config.yaml").read_text()
        short = write_config(tiny_config(tiny_inputs, out, max_steps=1), tmp_path / "short.yaml")
        expect_failure(
            main, [str(short)], capsys, f"trainer_args.output_dir {str(out)!r} is in use by "
            f"another run (pid {first.pid} on", "wait for it to end or choose another output_dir",
        )  # fmt: skip
        assert (out / "config.yaml").read_text() == config  # the running run's, untouched
    finally:
        first.kill()  # SIGKILL: nothing of the first run cleans up
        first.wait()
        log.close()
    assert (out / ".lmms-train.lock").exists()
    assert main([str(short), "trainer_args.overwrite_output_dir=true"]) == 0  # the killed run's


_MOUNTS = """
import json, os, subprocess, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from e2e_helpers import tiny_config, write_config, tree_digest
from lmms_train.cli import main
inputs, root = {inputs!r}, Path({root!r})
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(root / "small")], check=True)
path = write_config(tiny_config(inputs, root / "small" / "out", save_steps=2), root / "a.yaml")
res = {{"full": main([str(path)])}}
res["full_left"] = sorted(os.listdir(root / "small" / "out" / "checkpoints"))
ro = root / "ro"
subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
before = tree_digest(ro)
path = write_config(tiny_config(inputs, ro / "out", max_steps=1), root / "b.yaml")
res["ro"] = main([str(path)])
res["ro_same"] = tree_digest(ro) == before
print("RESULT" + json.dumps(res))
"""


def test_real_full_disk_and_read_only_folder(tiny_inputs, tmp_path):
    """A 6 MiB tmpfs (two 4 MiB checkpoints do not fit) and a read-only bind mount, in a private
    mount namespace (`unshare`); skipped where the machine does not allow one."""
    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode
    ):
        pytest.skip("no user/mount namespaces here: the fault-injecting writer covers this")
    (tmp_path / "small").mkdir()
    (tmp_path / "ro" / "out").mkdir(parents=True)
    (tmp_path / "ro" / "out" / "config.yaml").write_text("earlier: run\n")
    script = _MOUNTS.format(tests=str(REPO / "tests"), inputs=tiny_inputs, root=str(tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", script],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, proc.stdout + proc.stderr
    res = json.loads(line[len("RESULT") :])
    assert res["full"] == 2 and res["full_left"] == ["step_000002"], (res, proc.stderr)
    assert "could not write the checkpoint of step 4: no space left on the device" in proc.stderr
    assert res["ro"] == 2 and res["ro_same"], (res, proc.stderr)
    assert "is not writable by this process (read-only?)" in proc.stderr, proc.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("fsdp", [None, True])
def test_non_finite_guard_on_the_gpu(tiny_inputs, tmp_path, capsys, monkeypatch, fsdp):
    """On CUDA with bf16 (fp32 masters with the fused MasterAdamW step, or one-rank FSDP2): an
    inf loss at step 2 is skipped under `skip` (the masters' pending bf16 gradients dropped,
    the weights written at the end finite) and stops the run under `stop` before any save."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cfg = tiny_config(tiny_inputs, tmp_path / "skip", device="cuda", bf16=True, fsdp=fsdp,
                      on_nonfinite="skip", attn_backend="auto")  # fmt: skip
    _inject(monkeypatch, 2, "loss")
    assert main([str(write_config(cfg, tmp_path / "skip.yaml"))]) == 0
    rows = read_jsonl(tmp_path / "skip" / "metrics.jsonl")
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 1]
    assert all(isinstance(r["loss"], float) for i, r in enumerate(rows) if i != 1), rows
    _inject(monkeypatch, 3, "loss")
    cfg["trainer_args"].update(output_dir=str(tmp_path / "stop"), on_nonfinite="stop", save_steps=2)
    expect_failure(
        main, [str(write_config(cfg, tmp_path / "stop.yaml"))], capsys,
        "training diverged at step 3: the loss is inf", "step_000002",
    )  # fmt: skip
    assert sorted(os.listdir(tmp_path / "stop" / "checkpoints")) == ["step_000002"]
