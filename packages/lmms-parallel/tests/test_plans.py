"""Plans as data, single process: pattern matching, the style registry, degree validation, EP
slicing on the meta device. (Multi-process parity: tests/test_ep_tp.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lmms_parallel as lp


class _Experts(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.arange(n * 6 * 4.0).reshape(n, 6, 4))
        self.down_proj = nn.Parameter(torch.zeros(n, 4, 3))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Module()
        self.mlp.experts = _Experts()


def _model() -> nn.Module:
    m = nn.Module()
    m.layers = nn.ModuleList([_Layer(), _Layer()])
    return m


def test_match_plan_finds_every_layer_and_refuses_a_stray_pattern():
    model = _model()
    hits = lp.match_plan(model, {"layers.*.mlp.experts": "experts", "layers.*.attn": "colwise"})
    assert [(n, s) for n, _, s in hits] == [
        ("layers.0.mlp.experts", "experts"),
        ("layers.1.mlp.experts", "experts"),
        ("layers.0.attn", "colwise"),
        ("layers.1.attn", "colwise"),
    ]
    with pytest.raises(ValueError, match="matches no module"):
        lp.match_plan(model, {"layers.*.self_attn.q_proj": "colwise"})
    # "" names the root itself (e.g. sp_deepstack on the text decoder); "*" never matches it
    hits = lp.match_plan(model, {"": "sp_deepstack", "*": "sum_grad"})
    assert hits[0][:2] == ("", model) and all(n for n, _, _ in hits[1:])


def test_style_registry_lists_and_refuses_duplicates():
    assert {"colwise", "rowwise", "sum_grad", "vocab_parallel"} <= set(lp.registered_styles("tp"))
    assert lp.registered_styles("ep") == ["experts"]
    with pytest.raises(ValueError, match="already registered"):
        lp.register_style("tp", "colwise")(lambda mesh: None)
    with pytest.raises(ValueError, match="style kind"):
        lp.register_style("pp", "x")
    with pytest.raises(KeyError, match="registered: experts"):
        lp.apply_ep(_model(), {"layers.*.mlp.experts": "expert"}, group=None)


def test_vocab_parallel_head_refuses_what_it_cannot_split():
    class _Mesh:  # only the size is read before anything is split
        def size(self) -> int:
            return 3

    with pytest.raises(ValueError, match=r"vocabulary \(10\) must divide by tp=3"):
        lp.VocabParallelHead(_Mesh()).apply(nn.Linear(4, 10))
    with pytest.raises(TypeError, match=r"an nn\.Linear"):
        lp.VocabParallelHead(_Mesh()).apply(nn.Embedding(9, 4))
    assert lp.vocab_parallel_shard(torch.zeros(9, 4)) is None  # a plain head: the fused loss


def test_degrees_that_do_not_compose_raise_at_start_up():
    with pytest.raises(NotImplementedError, match="tp = 2 with ep = 2"):
        lp.ParallelDims(dp_shard=2, tp=2, ep=2).resolve(4)
    with pytest.raises(NotImplementedError, match="both split the attention heads"):
        lp.ParallelDims(dp_shard=1, sp=2, tp=2).resolve(4)
    assert lp.ParallelDims(dp_shard=-1, ep=2).resolve(4).dp_shard == 4
    assert lp.ParallelDims(dp_shard=-1, tp=2).resolve(4).dp_shard == 2


def test_ep_slices_experts_on_meta_and_on_cpu(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    real = _Experts()
    lp.ExpertParallel(group=None).apply(real)
    assert real.gate_up_proj.shape == (2, 6, 4) and real.down_proj.shape == (2, 4, 3)
    assert torch.equal(real.gate_up_proj.detach(), _Experts().gate_up_proj.detach()[2:])
    with torch.device("meta"):
        meta = _Experts()
    lp.ExpertParallel(group=None).apply(meta)
    assert meta.gate_up_proj.is_meta and meta.gate_up_proj.shape == (2, 6, 4)
    assert "forward" in vars(meta)  # the dispatch wraps this instance only
    assert lp.ep_local_slice(8, 4, 3) == slice(6, 8)
    with pytest.raises(ValueError, match="must divide the number of experts"):
        lp.ep_local_slice(6, 4, 0)
    with pytest.raises(TypeError, match="3-D"):
        lp.ExpertParallel(group=None).apply(nn.Linear(2, 2))
