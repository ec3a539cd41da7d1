"""Worker for test_distributed.py (importable by spawned children: spawn pickles by module)."""

import json
import os

import torch
import torch.distributed as dist
from torch import nn

import lmms_optim as lo

STEPS = 3


class _Net(nn.Module):
    # odd row counts: 5 rows over 4 ranks leaves empty shards; 2 same-shaped blocks batch.
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 12)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(12, 21), nn.Tanh(), nn.Linear(21, 12)) for _ in range(2)
        )
        self.narrow = nn.Linear(12, 5, bias=False)
        self.wide = nn.Linear(5, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 13, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        h = h + self.wide(self.narrow(h))
        return self.head(self.norm(h))


def _make(seed=0):
    torch.manual_seed(seed)
    return _Net()


def _opt(model):
    groups = lo.build_muon_param_groups(model, lr=0.02, weight_decay=0.1, adamw_lr=1e-2)
    return lo.Muon(groups, adjust_lr="rms", dist_bucket_numel=300)  # several buckets


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 13, (16,), generator=g)  # same batch on every rank
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), x).backward()
        opt.step()


def _full(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}  # fmt: skip


def worker(rank, world, port, mesh_shapes, tmp):
    """Runs every mesh layout in ``mesh_shapes`` on one gloo group; writes tmp/result{rank}.json."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ref = _make()  # single-process reference, computed locally on every rank
    _train(ref, _opt(ref), STEPS)
    ref_sd = _full(ref)
    results = {}
    for shape in mesh_shapes:
        results[str(shape)] = _check_layout(tuple(shape), ref_sd, f"{tmp}/ckpt{len(shape)}")
    with open(f"{tmp}/result{rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _check_layout(mesh_shape, ref_sd, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)

    def sharded():
        m = _make()
        for b in m.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    model = sharded()
    opt = _opt(model)
    _train(model, opt, STEPS)
    got = _full(model)
    errs = {k: ((got[k] - ref_sd[k]).abs().max() / ref_sd[k].abs().max()).item() for k in ref_sd}
    w = model.blocks[0][0].weight
    buf = opt.state[w]["momentum_buffer"]
    momentum_is_dtensor = isinstance(buf, DTensor) and buf.placements == w.placements

    # DCP: save after STEPS, continue 2 steps; a fresh model+optimizer loads and continues
    msd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(msd, checkpoint_id=ckpt_dir)
    _train(model, opt, 2, seed=7)
    after = _full(model)
    model2 = sharded()
    opt2 = _opt(model2)
    _train(model2, opt2, 1, seed=99)  # populate state so the load must overwrite it
    sd2 = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd2, checkpoint_id=ckpt_dir)
    model2.load_state_dict(sd2["model"])
    set_optimizer_state_dict(model2, opt2, sd2["optim"])
    _train(model2, opt2, 2, seed=7)
    after2 = _full(model2)
    dcp_err = max((after[k] - after2[k]).abs().max().item() for k in after)

    # tensor-parallel shards (Shard(1)) are orthogonalised as the whole matrix: == one process
    gen = torch.Generator().manual_seed(11)
    full_w, full_g = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    p = nn.Parameter(distribute_tensor(full_w.clone(), mesh["shard"], [Shard(1)]))
    p.grad = distribute_tensor(full_g.clone(), mesh["shard"], [Shard(1)])
    lo.Muon([p], lr=0.1).step()
    q = nn.Parameter(full_w.clone())
    q.grad = full_g.clone()
    lo.Muon([q], lr=0.1).step()
    tp_err = ((p.full_tensor() - q.detach()).abs().max() / (q - full_w).abs().max()).item()
    return {
        "errs": errs,
        "momentum_dtensor": momentum_is_dtensor,
        "dcp_err": dcp_err,
        "tp_err": tp_err,
    }
