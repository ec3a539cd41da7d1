"""lmms_optim.MasterAdamW: clip scale and mirror write-back inside AdamW's step."""

import pytest
import torch
from optim_scripts import run_script

from lmms_optim import MasterAdamW


def _pair(backend: str = "torch"):
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(s)) for s in [(8, 16), (16,), (4, 4)]]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]

    ours = MasterAdamW(groups(a), lr=1e-2, betas=(0.9, 0.95), backend=backend)
    ref = torch.optim.AdamW(groups(b), lr=1e-2, betas=(0.9, 0.95))
    return a, b, ours, ref


def test_torch_path_is_adamw_on_scaled_grads_and_writes_the_mirrors():
    a, b, ours, ref = _pair()
    mirrors = {id(p): torch.zeros(p.shape, dtype=torch.bfloat16) for p in a}
    ours.set_mirrors(mirrors)
    for step in range(3):
        gs = [torch.randn(p.shape) for p in a]
        scale = torch.tensor(0.25 if step else 1.0)
        for p, q, g in zip(a, b, gs, strict=True):
            p.grad, q.grad = g.clone(), g * scale
        ours.clip_scale = scale
        ours.step()
        ref.step()
        assert ours.clip_scale is None  # consumed
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(mirrors[id(p)], p.detach().bfloat16())
    assert ours.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


def test_mirrors_must_cover_every_parameter_with_its_shape():
    a, _, ours, _ = _pair()
    with pytest.raises(ValueError, match="no mirror"):
        ours.set_mirrors({id(a[0]): torch.zeros(a[0].shape)})
    bad = {id(p): torch.zeros(p.shape) for p in a}
    bad[id(a[1])] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        ours.set_mirrors(bad)
    with pytest.raises(ValueError, match="backend"):
        MasterAdamW(a, backend="cuda")


def test_triton_path_under_the_interpreter():
    pytest.importorskip("triton")
    r = run_script("master_adamw_checks.py", "cpu")
    assert "triton == torch over 3 steps on cpu" in r.stdout
    assert "resumes torch state on cpu" in r.stdout
    assert "bf16 gradients on cpu" in r.stdout


@pytest.mark.gpu
def test_triton_path_on_the_gpu():
    run_script("master_adamw_checks.py", "cuda", interpret=False)


def test_clip_norm_measures_the_gradients_and_is_zero_without_any():
    a, _, ours, _ = _pair()
    assert float(ours.clip_norm_(1.0)) == 0.0 and ours.clip_scale is None
    for p in a:
        p.grad = torch.full(p.shape, 2.0)
    norm = ours.clip_norm_(1.0)
    n = sum(p.numel() for p in a)
    torch.testing.assert_close(norm, torch.tensor(2.0 * n**0.5))
    torch.testing.assert_close(ours.clip_scale, torch.tensor(1.0 / (2.0 * n**0.5 + 1e-6)))
