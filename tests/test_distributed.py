"""DDP on CPU (gloo, 2 processes): the losses on gathered features equal the single-process losses
on the same global batch, and the gradients reaching each rank's local features match."""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from cxrdr.train import distributed as dist_utils
from tests.fakes import FakeOutput
from cxrdr.train.losses import LossConfig, Objective

WORLD = 2
SLICES = [(0, 3), (3, 5)]  # uneven on purpose: rank 0 holds 3 samples, rank 1 holds 2
D = 6
FIELDS = ("image_emb", "text_emb", "masked_image_emb", "mask", "local_visual", "local_text", "syn_text_emb")




def global_case():
    g = torch.Generator().manual_seed(123)
    b = SLICES[-1][1]

    def u(*shape):
        return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1).float()

    leaves = {
        "image_emb": u(b, D), "text_emb": u(b, D), "masked_image_emb": u(b, D),
        "mask": torch.rand(b, 7, generator=g), "local_visual": torch.randn(b, 4, D, generator=g),
        "local_text": torch.randn(b, 4, D, generator=g), "syn_text_emb": u(b, D),
    }
    text_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    batch = {
        "teacher": {"clipT": {"img": u(b, 8), "txt": u(b, 8), "syn": u(b, 8)},
                    "textT": {"img": None, "txt": u(b, 3), "syn": u(b, 3)}},
        "subject_id": ["p1", "p2", "p3", "p1", "p4"], "study_id": ["a", "b", "c", "d", "b"],
        "report_text": ["r1", "r2", "r3", "r4", "R3 "], "caption_text": ["n", "x", "y", "n", "z"],
        "labels": (torch.rand(b, 14, generator=g) > 0.6).float(),
    }
    return leaves, text_mask, batch


CONFIGS = [
    LossConfig(lambda_distill=0.6, fn_masking="all", fn_mode="multi", beta_min=0.2, beta_max=1.0,
               teacher_scales={"textT": 20.0}, lambda_sparse=0.1, mu_consistency=2.0, w_local=0.5,
               local_loss="cosine"),  # FakeOutput has local features, not the contrastive pairs
    LossConfig(lambda_distill=0.3, fn_masking="subject,text", fn_mode="mask", label_soft_targets=True,
               queue_size=16, distill_kind="ce", w_local=1.0, local_loss="cosine"),
]


def run_losses(leaves, text_mask, batch, lo, hi, gather):
    """Build local outputs for rows lo:hi, run every config (twice with a queue), backward each total.
    Returns ({config index: {term: value}}, {field: grad of the local leaf}) with grads summed over runs."""
    local = {k: v[lo:hi].clone().requires_grad_(True) for k, v in leaves.items()}
    scale = torch.tensor(10.0, requires_grad=True)
    real = FakeOutput(local["image_emb"], local["text_emb"], scale, mask=local["mask"],
                      masked_image_emb=local["masked_image_emb"], local_visual=local["local_visual"],
                      local_text=local["local_text"], text_mask=text_mask[lo:hi])
    local_batch = {
        "teacher": {n: {p: None if t is None else t[lo:hi] for p, t in e.items()} for n, e in batch["teacher"].items()},
        **{k: batch[k][lo:hi] for k in ("subject_id", "study_id", "report_text", "caption_text", "labels")},
    }
    values = {}
    for ci, cfg in enumerate(CONFIGS):
        objective = Objective(cfg, embed_dim=D, gather=gather)
        for run in range(2 if objective.queue is not None else 1):
            terms = objective(real, local_batch, step=3, total_steps=10, syn_text_emb=local["syn_text_emb"])
            terms["total"].backward()
            values[f"{ci}.{run}"] = {k: v.item() for k, v in terms.items()}
    grads = {k: v.grad.clone() for k, v in local.items()}
    grads["logit_scale"] = scale.grad.clone()
    return values, grads


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    assert dist_utils.init_distributed(backend="gloo", timeout_s=60)
    try:
        leaves, text_mask, batch = global_case()
        lo, hi = SLICES[rank]
        values, grads = run_losses(leaves, text_mask, batch, lo, hi, gather=None)  # auto: DDP is on
        helpers = {
            "world": dist_utils.world_size(), "rank": dist_utils.rank(), "is_main": dist_utils.is_main(),
            "ids": dist_utils.gather_list(batch["subject_id"][lo:hi]),
            "mean": dist_utils.global_mean(torch.tensor(float(sum(range(lo, hi)))), hi - lo).item(),
        }
        dist_utils.barrier()
        torch.save({"values": values, "grads": grads, "helpers": helpers}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist_utils.cleanup()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_losses_and_local_gradients_match_single_process(tmp_path):
    ctx = mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.time() + 120
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("DDP workers did not finish within 120 s")

    leaves, text_mask, batch = global_case()
    b = SLICES[-1][1]
    ref_values, ref_grads = run_losses(leaves, text_mask, batch, 0, b, gather=False)
    assert set(ref_values["0.0"]) == {"clip", "distill", "clip_syn", "distill_syn", "mask_nce", "sparsity",
                                      "consistency", "local", "total"}
    for rank, (lo, hi) in enumerate(SLICES):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["helpers"]["world"] == WORLD and got["helpers"]["rank"] == rank
        assert got["helpers"]["is_main"] == (rank == 0)
        assert got["helpers"]["ids"] == batch["subject_id"]
        assert got["helpers"]["mean"] == pytest.approx(sum(range(b)) / b)
        for run, terms in ref_values.items():
            assert set(got["values"][run]) == set(terms), run
            for key, value in terms.items():
                assert got["values"][run][key] == pytest.approx(value, abs=1e-5), (rank, run, key)
        for name, grad in ref_grads.items():
            if name != "logit_scale":
                torch.testing.assert_close(got["grads"][name], grad[lo:hi], atol=1e-5, rtol=1e-4,
                                           msg=f"rank {rank} {name}")
    # the logit scale is used in full by every rank: its per-rank gradient is 1/W of the global one,
    # so `loss * world_size` + DDP averaging (= the sum over ranks) gives the single-process gradient
    summed = sum(torch.load(tmp_path / f"rank{r}.pt")["grads"]["logit_scale"] for r in range(WORLD))
    torch.testing.assert_close(summed, ref_grads["logit_scale"], atol=1e-5, rtol=1e-4)


def test_helpers_without_process_group():
    x = torch.randn(3, 2, requires_grad=True)
    assert dist_utils.gather_features(x) is x and dist_utils.gather_features(None) is None
    assert dist_utils.world_size() == 1 and dist_utils.rank() == 0 and dist_utils.is_main()
    assert dist_utils.gather_list(("a", "b")) == ["a", "b"] and dist_utils.all_gather_object(5) == [5]
    assert dist_utils.global_mean(torch.tensor(6.0), 3).item() == pytest.approx(2.0)
    assert dist_utils.loss_scale_for_ddp() == 1
    assert dist_utils.init_distributed() is False  # no WORLD_SIZE in the environment
