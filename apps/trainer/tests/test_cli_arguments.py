"""`sample` and `render` check their arguments before any work (issue 37): one report, exit 2,
no model, tokenizer or checkpoint read first (the checkpoint folder here does not even exist)."""

from __future__ import annotations

import json

from lmms_train.cli import main


def _fails(argv, capsys, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_sample_arguments(tmp_path, capsys):
    missing = str(tmp_path / "no_such_checkpoint")
    _fails([ "sample", missing, "--prompt", "hi", "--gen-length", "0"], capsys,
           "--gen-length must be >= 1, got 0")  # fmt: skip
    _fails(["sample", missing, "--prompt", "hi", "--temperature", "-1", "--steps", "0"], capsys,
           "--temperature must be a finite number >= 0", "--steps must be >= 1",
           "2 problems")  # fmt: skip
    _fails(["sample", missing, "--prompt", "hi", "--gen-length", "30", "--block-length", "8"],
           capsys, "--gen-length 30 must be a multiple of --block-length 8")  # fmt: skip
    _fails(["sample", missing, "--prompt", "hi", "--temperature", "nan"], capsys, "--temperature")


def test_render_arguments(tmp_path, capsys):
    missing = str(tmp_path / "no_such_checkpoint")
    _fails(["render", missing, "--out", "x.jpgx"], capsys,
           "--out 'x.jpgx': the file type comes from its suffix: .png, .gif, .mp4")  # fmt: skip
    _fails(["render", missing, "--out", "x.png", "--steps", "0", "--method", "rk4",
            "--classes", "a,b", "--guidance", "-2", "--objective-args", "{bad"], capsys,
           "--steps must be >= 1", "--method: 'rk4'", "--classes: expected integers",
           "--guidance must be", "--objective-args: not JSON", "5 problems")  # fmt: skip
    dllm = tmp_path / "dllm"  # a masked-diffusion export: config.json of a text family
    dllm.mkdir()
    (dllm / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _fails(["render", str(dllm), "--out", "x.png"], capsys, "llama does not render")
