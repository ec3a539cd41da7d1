"""MasterWeights: bf16 compute weights, fp32 masters, fp32 gradient accumulation, write-back,
checkpoint names, export of the masters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lmms_parallel as lp


class Tied(nn.Module):
    """Tied embedding / head, a frozen projection, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("cache", torch.ones(3), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.frozen(torch.tanh(self.mid(h))) * self.scale.to(h.dtype)
        return self.head(h)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:-1]).float()
    return nn.functional.cross_entropy(logits, ids[1:], reduction="sum")


def test_compute_weights_are_bf16_casts_of_the_fp32_masters():
    torch.manual_seed(0)
    model = Tied()
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    mw = lp.MasterWeights(model)
    assert set(mw.masters) == {"embed.weight", "mid.weight", "mid.bias"}
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, fp32[name].to(torch.bfloat16))
        if name in mw.masters:
            assert mw.masters[name].dtype == torch.float32
            assert torch.equal(mw.masters[name], fp32[name])  # bit for bit
    assert model.head.weight is model.embed.weight  # still tied
    assert model.scale.dtype == torch.float32  # buffers keep their dtype, as under FSDP2
    ptrs = [p.data_ptr() for p in mw.parameters()]
    assert all((ptr - ptrs[0]) % 256 == 0 for ptr in ptrs)  # aligned views of one flat buffer


def test_gradients_accumulate_in_fp32_and_compute_grads_are_freed():
    torch.manual_seed(0)
    model = Tied()
    mw = lp.MasterWeights(model)
    batches = [torch.randint(0, 11, (9,)) for _ in range(3)]
    expected: dict[str, torch.Tensor] = {}
    for ids in batches:  # the same micro-batches on a bf16 twin, gradients summed in fp32
        twin = Tied().to(torch.bfloat16)
        twin.load_state_dict(model.state_dict())
        _loss(twin, ids).backward()
        for name, p in twin.named_parameters():
            if p.grad is not None:
                g = p.grad.float()
                expected[name] = expected[name] + g if name in expected else g
    for ids in batches:
        _loss(model, ids).backward()
        assert all(p.grad is None for p in model.parameters())  # moved to the masters at once
    for name, m in mw.masters.items():
        assert m.grad.dtype == torch.float32
        torch.testing.assert_close(m.grad, expected[name], rtol=0, atol=0)


def test_optimizer_steps_the_masters_and_writes_them_back():
    torch.manual_seed(0)
    model = Tied()
    mw = lp.MasterWeights(model)
    opt = torch.optim.AdamW(mw.parameters(), lr=1e-2)
    mw.attach(opt)
    before = {n: m.detach().clone() for n, m in mw.masters.items()}
    for _ in range(2):
        _loss(model, torch.randint(0, 11, (9,))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = dict(model.named_parameters())
    for name, m in mw.masters.items():
        assert not torch.equal(m, before[name])  # updated in fp32 ...
        assert torch.equal(params[name], m.detach().to(torch.bfloat16))  # ... and written back
    with pytest.raises(ValueError, match="not masters"):
        mw.attach(torch.optim.SGD(model.parameters(), lr=0.1))


def test_state_module_has_the_model_names_with_the_masters():
    model = Tied()
    mw = lp.MasterWeights(model)
    state = mw.state_module().state_dict()
    assert list(state) == list(model.state_dict())  # tied key, persistent buffer, no cache
    assert state["embed.weight"].data_ptr() == state["head.weight"].data_ptr()
    assert state["embed.weight"].dtype == torch.float32  # the master
    assert state["frozen.weight"].dtype == torch.bfloat16  # frozen: the compute weight itself
    with torch.no_grad():  # loading into it, then copy_to_model, updates the model
        mw.state_module().get_parameter("mid.weight").fill_(0.25)
    mw.copy_to_model()
    assert torch.equal(model.mid.weight, torch.full_like(model.mid.weight, 0.25))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on one process
def test_checkpoint_round_trip_through_the_state_module(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    mw = lp.MasterWeights(model)
    opt = torch.optim.AdamW(mw.parameters(), lr=1e-2)
    mw.attach(opt)
    _loss(model, torch.randint(0, 11, (9,))).backward()
    opt.step()
    ckpt = lp.Checkpointer(tmp_path)
    ckpt.save(1, model=mw.state_module(), optimizer=opt)

    torch.manual_seed(1)
    other = Tied()
    mw2 = lp.MasterWeights(other)
    opt2 = torch.optim.AdamW(mw2.parameters(), lr=1e-2)
    mw2.attach(opt2)
    ckpt.load(model=mw2.state_module(), optimizer=opt2)
    mw2.copy_to_model()
    for name, m in mw.masters.items():
        assert torch.equal(mw2.masters[name], m)
        state = opt2.state[mw2.masters[name]]
        assert torch.equal(state["exp_avg"], opt.state[m]["exp_avg"])
    assert torch.equal(other.mid.weight, model.mid.weight)


def test_export_writes_the_fp32_masters(tmp_path):
    from safetensors.torch import load_file

    model = Tied()
    mw = lp.MasterWeights(model)
    lp.export_hf(model, tmp_path / "out", weights=mw.state_module())
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written["mid.weight"].dtype == torch.float32
    assert torch.equal(written["mid.weight"], mw.masters["mid.weight"].detach())


def test_refuses_a_model_with_nothing_to_train():
    model = Tied().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        lp.MasterWeights(model)
