"""`vision_balance_window` (issue 28, point 4): each DP rank's loader emits, at step s, the pack at
the shared u_s quantile of its look-ahead window's vision cost, so the ranks of a step carry
packs of similar vision FLOPs. Tested: the pick follows the FLOPs formula (not the patch count),
max/mean vision FLOPs over 8 ranks falls on a skewed synthetic stream with every pack emitted
once and none waiting past max_age, and the loader resumes exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from lmms_data_testutil import batch_ids, id_processor, write_id_parquet

from lmms_data import DatasetConfig, build_dataloader
from lmms_data._balance import VisionBalancer, default_vision_cost, quantile_target

D_VIT = 64  # a ViT width for the formula below


def vit_flops(batch: dict) -> float:
    """Per image/video of p patches: linear layers ~ 24 p d^2 plus attention 4 p^2 d (each item
    attends within itself), so one long video costs more than many small images of as many
    patches."""
    grids = [batch.get(k) for k in ("image_grid_thw", "video_grid_thw")]
    p = np.concatenate([np.asarray(g).prod(-1) for g in grids if g is not None] or [[0]])
    return float((24 * p * D_VIT**2 + 4 * p**2 * D_VIT).sum())


def _pack(*grids: tuple[int, int, int], video: bool = False) -> dict:
    return {("video_grid_thw" if video else "image_grid_thw"): np.asarray(grids).reshape(-1, 3)}


def test_pick_follows_the_flops_formula():
    packs = {
        "video": _pack((4, 16, 16), video=True),  # one item of 1024 patches
        "images": _pack(*[(1, 8, 16)] * 8),  # 8 items of 128: as many patches, less attention
        "text": {},
        "two": _pack((1, 20, 15), (1, 20, 15)),  # 600 patches
    }
    assert default_vision_cost(packs["video"]) == default_vision_cost(packs["images"]) == 1024
    picks = {}
    for name, cost in (("flops", vit_flops), ("patches", default_vision_cost)):
        bal = VisionBalancer(4, cost)
        for k, b in packs.items():
            bal.push(b, k)
        picks[name] = bal.pop().item
    u = quantile_target(0)
    assert int(u * 4) == 2  # step 0 takes the third of four by cost
    by_flops = sorted(packs, key=lambda k: vit_flops(packs[k]))
    assert by_flops == ["text", "two", "images", "video"]
    assert picks["flops"] == by_flops[2] == "images"
    assert picks["patches"] == "video"  # the tie on patches goes to the earlier pack


def _imbalance(costs_per_rank: list[list[float]]) -> float:
    """Mean over steps (with any vision work) of max/mean vision FLOPs over the ranks."""
    c = np.asarray(costs_per_rank)  # [ranks, steps]
    mean = c.mean(0)
    return float((c.max(0)[mean > 0] / mean[mean > 0]).mean())


def test_balancing_lowers_max_over_mean_on_a_skewed_stream():
    ranks, n, window = 8, 400, 16
    streams = []
    for r in range(ranks):  # 60% text-only, 25% a few images, 15% a long video
        rng = np.random.default_rng(r)
        kind = rng.choice(3, size=n, p=[0.6, 0.25, 0.15])
        streams.append([
            {} if k == 0 else _pack(*[(1, 16, 16)] * int(rng.integers(1, 4))) if k == 1
            else _pack((int(rng.integers(8, 17)), 16, 16), video=True)
            for k in kind
        ])  # fmt: skip
    plain = [[vit_flops(b) for b in s] for s in streams]
    balanced, waits = [], []
    for s in streams:
        bal, out = VisionBalancer(window, vit_flops), []
        for i, b in enumerate(s):
            bal.push(b, i)
            while (e := bal.pop()) is not None:
                out.append(e.item)
                waits.append(bal.step - 1 - e.born)
                bal.advance()
        while (e := bal.pop(draining=True)) is not None:
            out.append(e.item)
        assert sorted(out) == list(range(n))  # every pack once
        balanced.append([vit_flops(s[i]) for i in out])
    assert max(waits) <= 4 * window
    steps = n - window  # the steps every rank filled from a full window
    before, after = (
        _imbalance([p[:steps] for p in plain]),
        _imbalance([b[:steps] for b in balanced]),
    )
    # 8 ranks, window 16: mean over steps of max/mean 5.57 -> 3.50; sum over steps of the
    # slowest rank's vision FLOPs (what each step waits for) over the mean's: 5.09 -> 1.86
    assert after < 0.7 * before, (before, after)
    slowest = lambda c: float(c.max(0).sum() / c.mean(0).sum())  # noqa: E731
    p_run, b_run = np.asarray(plain)[:, :steps], np.asarray(balanced)[:, :steps]
    assert slowest(b_run) < 0.5 * slowest(p_run), (slowest(p_run), slowest(b_run))


def vision_processor(messages: list) -> dict:
    sample = id_processor(messages)
    i = int(sample["input_ids"][0])
    sample["vision_tokens"] = 200 if i % 7 == 3 else 20 if i % 3 == 0 else 0
    return sample


@pytest.mark.parametrize("workers", [0, 2])
def test_balanced_loader_resumes_exactly(tmp_path, workers):
    path = write_id_parquet(str(tmp_path / "d.parquet"), range(150))
    cfg = DatasetConfig(dataset_path=path, packing_length=16, max_open_bins=2, shuffle_buffer=8,
                        seed=5, num_epochs=1, vision_balance_window=6)  # fmt: skip
    cost = lambda b: float(b["vision_tokens"])  # noqa: E731
    mk = lambda c=cfg: build_dataloader(c, vision_processor, num_workers=workers, vision_cost=cost)  # noqa: E731
    ref = [batch_ids(b) for b in mk()]
    plain_cfg = DatasetConfig(**{**cfg.to_dict(), "vision_balance_window": 0})
    plain = [batch_ids(b) for b in mk(plain_cfg)]
    assert sorted(map(tuple, ref)) == sorted(map(tuple, plain)) and ref != plain
    out, loader = [], mk()
    for k in (7, 11, 10**9):  # two saves mid-run (JSON round trip), then to the end
        it = iter(loader)
        for _ in range(k):
            b = next(it, None)
            if b is None:
                break
            out.append(batch_ids(b))
        state = json.loads(json.dumps(loader.state_dict()))
        loader = mk()
        loader.load_state_dict(state)
    assert out == ref
    again = mk()  # a second iter() on the same loader continues after the last pack returned
    head = [batch_ids(b) for _, b in zip(range(9), iter(again), strict=False)]
    assert head + [batch_ids(b) for b in again] == ref
    with pytest.raises(ValueError, match="vision_balance_window"):
        mk(plain_cfg).load_state_dict(state)
    other = DatasetConfig(**{**cfg.to_dict(), "vision_balance_window": 8})
    with pytest.raises(ValueError, match="vision_balance_window 6"):
        mk(other).load_state_dict(state)
    with pytest.raises(ValueError, match="vision_balance_window"):
        DatasetConfig(dataset_path=path, vision_balance_window=1)
