"""Losses against small hand-computed examples (numpy loops, not the code under test)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.fakes import FakeOutput
from cxrdr.train.losses import (
    LossConfig,
    Objective,
    TextQueue,
    beta_schedule,
    clip_loss,
    consistency_loss,
    distill_loss,
    label_soft_targets,
    local_alignment_loss,
    attention_entropy,
    local_contrastive_loss,
    word_contrastive_loss,
    loss_balance,
    parse_fn_masking,
    positive_mask,
    sparsity_loss,
)


# ----------------------------------------------------------------------------- reference helpers
def objective_terms(real, syn, batch, cfg, **kwargs):
    """The Objective's terms for B_real ``real`` and B_syn ``syn`` (same image, caption text; or None)."""
    return Objective(cfg)(real, batch, syn_text_emb=None if syn is None else syn.text_emb, **kwargs)


def unit(b, d, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=1).float()


def ref_row_ce(logits_row, target_row, skip=()):
    """-sum_j t_j log softmax(logits)_j, entries in `skip` removed from the denominator."""
    keep = [j for j in range(len(logits_row)) if j not in skip]
    denom = sum(math.exp(logits_row[j]) for j in keep)
    return -sum(target_row[j] * math.log(math.exp(logits_row[j]) / denom) for j in keep if target_row[j] > 0)


def ref_clip(img, txt, scale, w_i2t=0.5, w_t2i=0.5, targets=None, skip=None, extra=None):
    img, txt = img.double().numpy(), txt.double().numpy()
    b = img.shape[0]
    s = np.array([[scale * float(np.dot(img[i], txt[j])) for j in range(b)] for i in range(b)])
    t = np.eye(b) if targets is None else np.asarray(targets, dtype=float)
    skip = skip or {}
    i2t = t2i = 0.0
    for i in range(b):
        row = list(s[i])
        trow = list(t[i])
        if extra is not None:
            row += [scale * float(np.dot(img[i], q)) for q in extra.double().numpy()]
            trow += [0.0] * extra.shape[0]
        i2t += ref_row_ce(row, trow, skip.get(i, ()))
        t2i += ref_row_ce(list(s[:, i]), list(t[i]), skip.get(i, ()))
    return w_i2t * i2t / b + w_t2i * t2i / b


def softmax_np(x):
    e = np.exp(x - x.max())
    return e / e.sum()


# ----------------------------------------------------------------------------- CLIP
def test_clip_loss_matches_hand_computation():
    img, txt = unit(4, 6, 0), unit(4, 6, 1)
    got = clip_loss(img, txt, torch.tensor(7.0), w_i2t=0.3, w_t2i=0.7)
    assert got.item() == pytest.approx(ref_clip(img, txt, 7.0, 0.3, 0.7), rel=1e-5)
    # symmetric default equals the usual cross-entropy formulation
    logits = 7.0 * img @ txt.T
    labels = torch.arange(4)
    usual = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))
    assert clip_loss(img, txt, 7.0).item() == pytest.approx(usual.item(), rel=1e-6)


def test_positive_mask_from_subject_study_text():
    m = positive_mask(["s1", "s1", "s2", ""], ["a", "b", "c", ""], ["No effusion.", "x", "no  EFFUSION.", "y"])
    expected = torch.tensor([
        [1, 1, 1, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, expected)
    only_study = positive_mask(["s1", "s1", "s2", ""], ["a", "b", "c", ""], None, criteria=("study",))
    assert torch.equal(only_study, torch.eye(4, dtype=torch.bool))
    assert parse_fn_masking("all") == ("subject", "study", "text")
    assert parse_fn_masking("none") == ()
    with pytest.raises(ValueError, match="unknown criterion"):
        parse_fn_masking("subject,patient")


def test_false_negative_multi_positive_targets_hand_computed():
    img, txt = unit(4, 5, 2), unit(4, 5, 3)
    pos = torch.zeros(4, 4, dtype=torch.bool)
    pos[0, 2] = pos[2, 0] = True
    targets = np.eye(4)
    targets[0] = [0.5, 0, 0.5, 0]
    targets[2] = [0.5, 0, 0.5, 0]
    got = clip_loss(img, txt, 5.0, positives=pos, fn_mode="multi")
    assert got.item() == pytest.approx(ref_clip(img, txt, 5.0, targets=targets), rel=1e-5)


def test_false_negative_masking_lowers_loss_for_duplicate_reports():
    # samples 0 and 1 have near-identical reports: a false-negative pair
    img = unit(4, 8, 4)
    txt = unit(4, 8, 5)
    txt[1] = F.normalize(txt[0] + 0.1 * txt[1], dim=0)
    img[1] = F.normalize(img[0] + 0.1 * img[1], dim=0)
    pos = positive_mask(texts=["same", "Same ", "a", "b"])
    plain = clip_loss(img, txt, 10.0)
    masked = clip_loss(img, txt, 10.0, positives=pos, fn_mode="mask")
    multi = clip_loss(img, txt, 10.0, positives=pos, fn_mode="multi")
    assert masked.item() < plain.item()
    assert multi.item() < plain.item()
    # "mask" mode: off-diagonal positives leave the denominator, target stays the diagonal
    skip = {0: (1,), 1: (0,)}
    assert masked.item() == pytest.approx(ref_clip(img, txt, 10.0, skip=skip), rel=1e-5)


def test_false_negative_gradient_direction():
    # img = basis vectors, so d loss / d txt[j, i] = scale * d loss / d s_ij
    img = torch.eye(4)
    txt0 = unit(4, 4, 25)
    pos = positive_mask(subject_ids=["p", "p", "q", "r"])
    grads = {}
    for mode in ("plain", "mask", "multi"):
        txt = txt0.clone().requires_grad_(True)
        kwargs = {} if mode == "plain" else {"positives": pos, "fn_mode": mode}
        clip_loss(img, txt, 3.0, **kwargs).backward()
        grads[mode] = txt.grad[1, 0].item()  # d loss / d s_01 (image 0 vs its false negative text 1)
    assert grads["plain"] > 0  # plain InfoNCE pushes the false negative away
    assert grads["mask"] == pytest.approx(0.0, abs=1e-8)  # masked: ignored
    assert grads["multi"] < 0  # multi-positive: pulled together


def test_hard_negative_beta_zero_is_plain_and_beta_positive_matches_robinson():
    img, txt = unit(5, 6, 6), unit(5, 6, 7)
    plain = clip_loss(img, txt, 4.0)
    assert clip_loss(img, txt, 4.0, beta=0.0).item() == pytest.approx(plain.item(), abs=1e-7)

    beta, scale = 0.8, 4.0
    s = (scale * img.double() @ txt.double().T).numpy()
    b = s.shape[0]

    def robinson(mat):
        total = 0.0
        for i in range(b):
            negs = [j for j in range(b) if j != i]
            w = np.array([math.exp(beta * mat[i, j]) for j in negs])
            w = w / w.sum()
            ng = len(negs) * sum(wk * math.exp(mat[i, j]) for wk, j in zip(w, negs))
            total += -math.log(math.exp(mat[i, i]) / (math.exp(mat[i, i]) + ng))
        return total / b

    expected = 0.5 * robinson(s) + 0.5 * robinson(s.T)
    got = clip_loss(img, txt, scale, beta=beta)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    assert got.item() > plain.item()  # harder negatives weigh more


def test_beta_schedule():
    assert beta_schedule(0, 100, 0.1, 1.1) == pytest.approx(0.1)
    assert beta_schedule(50, 100, 0.1, 1.1) == pytest.approx(0.6)
    assert beta_schedule(500, 100, 0.1, 1.1) == pytest.approx(1.1)


def test_label_soft_targets_hand_computed():
    labels = torch.tensor([[1.0, 0, 1], [1.0, 0, 0], [0.0, 0, 0], [float("nan"), 0, 0]])
    got = label_soft_targets(labels, temperature=0.5)
    # reference: vectors with an extra "no label" dim for all-zero rows (NaN counts as 0)
    vecs = np.array([[1, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1]], dtype=float)
    vecs = vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
    expected = np.stack([softmax_np(np.array([vecs[i] @ vecs[j] for j in range(4)]) / 0.5) for i in range(4)])
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)
    assert got[2, 3] == pytest.approx(got[2, 2].item())  # two unlabelled studies are alike

    img, txt = unit(4, 5, 8), unit(4, 5, 9)
    loss = clip_loss(img, txt, 3.0, soft_targets=got)
    assert loss.item() == pytest.approx(ref_clip(img, txt, 3.0, targets=expected), rel=1e-5)


def test_text_queue_adds_i2t_negatives():
    img, txt = unit(3, 4, 10), unit(3, 4, 11)
    queue = TextQueue(size=4, dim=4)
    assert queue.get() is None
    queue.enqueue(unit(3, 4, 12))
    queue.enqueue(unit(3, 4, 13))  # wraps around: 4 kept, the oldest two overwritten
    assert len(queue) == 4
    extra = queue.get()
    second, first = unit(3, 4, 13), unit(3, 4, 12)
    assert torch.equal(extra[3], second[0]) and torch.equal(extra[0], second[1]) and torch.equal(extra[1], second[2])
    assert torch.equal(extra[2], first[2])
    got = clip_loss(img, txt, 6.0, extra_txt=extra)
    assert got.item() == pytest.approx(ref_clip(img, txt, 6.0, extra=extra), rel=1e-5)
    assert got.item() > clip_loss(img, txt, 6.0).item()


# ----------------------------------------------------------------------------- distillation
def test_distill_kl_is_zero_when_matrices_match_and_ce_is_teacher_entropy():
    img, txt = unit(4, 6, 14), unit(4, 6, 15)
    kl = distill_loss(img, txt, 20.0, [img.clone()], [txt.clone()], [20.0], kind="kl")
    assert abs(kl.item()) < 1e-6
    ce = distill_loss(img, txt, 20.0, [img.clone()], [txt.clone()], [20.0], kind="ce")
    s = (20.0 * img.double() @ txt.double().T).numpy()
    ent = 0.0
    for mat in (s, s.T):
        for i in range(4):
            p = softmax_np(mat[i])
            ent += 0.5 * -(p * np.log(p)).sum() / 4
    assert ce.item() == pytest.approx(ent, rel=1e-5)


def test_distill_two_teachers_one_text_only_hand_computed():
    s_img, s_txt = unit(3, 4, 16), unit(3, 4, 17)
    t1_img, t1_txt = unit(3, 8, 18), unit(3, 8, 19)
    t2_txt = unit(3, 5, 20)  # text-only teacher
    got = distill_loss(s_img, s_txt, 10.0, [t1_img, None], [t1_txt, t2_txt], [50.0, 30.0], kind="kl")

    def mat(a, b, scale):
        return np.array([[scale * float(np.dot(a[i], b[j])) for j in range(3)] for i in range(3)])

    st = mat(s_img.double().numpy(), s_txt.double().numpy(), 10.0)
    t1 = mat(t1_img.double().numpy(), t1_txt.double().numpy(), 50.0)
    t2 = mat(t2_txt.double().numpy(), t2_txt.double().numpy(), 30.0)
    total = 0.0
    for stu, teach1, teach2 in ((st, t1, t2), (st.T, t1.T, t2.T)):
        for i in range(3):
            p = 0.5 * (softmax_np(teach1[i]) + softmax_np(teach2[i]))  # average after the softmax
            q = softmax_np(stu[i])
            total += 0.5 * sum(p[j] * math.log(p[j] / q[j]) for j in range(3)) / 3
    assert got.item() == pytest.approx(total, rel=1e-5)


# ----------------------------------------------------------------------------- Patch-IB, local
def test_local_alignment_hand_computed_and_ignores_padding():
    g = torch.Generator().manual_seed(21)
    v = torch.randn(2, 3, 4, generator=g)
    t = torch.randn(2, 3, 4, generator=g)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    got = local_alignment_loss(v, t, mask)
    vals = []
    for b in range(2):
        for k in range(3):
            if mask[b, k]:
                a, c = v[b, k].double().numpy(), t[b, k].double().numpy()
                vals.append(1 - a @ c / (np.linalg.norm(a) * np.linalg.norm(c)))
    assert got.item() == pytest.approx(float(np.mean(vals)), rel=1e-5)
    v2, t2 = v.clone(), t.clone()
    v2[~mask] = torch.randn(int((~mask).sum()), 4, generator=g) * 100
    t2[~mask] = 7.0
    assert local_alignment_loss(v2, t2, mask).item() == pytest.approx(got.item(), abs=1e-7)


def test_local_contrastive_hand_computed_ignores_padding_and_rewards_grounding():
    g = torch.Generator().manual_seed(25)
    sim = torch.rand(3, 3, 4, generator=g) * 2 - 1  # (text i, image j, token k)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False], [True, False, False, False]])
    vals = []
    for i in range(3):
        for k in range(4):
            if mask[i, k]:
                logits = sim[i, :, k].double().numpy() / 0.2
                vals.append(-(logits[i] - np.log(np.exp(logits).sum())))
    assert local_contrastive_loss(sim, mask, 0.2).item() == pytest.approx(float(np.mean(vals)), rel=1e-5)
    padded = sim.clone()
    padded[..., 3] = 5.0  # padding tokens do not count
    assert local_contrastive_loss(padded, mask, 0.2).item() == pytest.approx(
        local_contrastive_loss(sim, mask, 0.2).item(), rel=1e-6)
    # a word whose own-image region matches best scores lower than one matching every image alike,
    # which is the collapsed map that the seeds' 1 - cos form cannot tell from grounding
    grounded = torch.eye(3).unsqueeze(-1).expand(3, 3, 4)
    collapsed = torch.ones(3, 3, 4)
    assert local_contrastive_loss(grounded, mask, 0.1) < 0.01 < local_contrastive_loss(collapsed, mask, 0.1)
    assert local_contrastive_loss(collapsed, mask, 0.1).item() == pytest.approx(math.log(3), rel=1e-5)
    with pytest.raises(ValueError, match="B, B, L"):
        local_contrastive_loss(torch.zeros(2, 3, 4))


def test_word_contrast_needs_a_region_per_word_and_skips_repeated_words():
    ids = torch.tensor([[5, 6, 7], [5, 5, 7]])
    specific = torch.eye(3).unsqueeze(0).repeat(2, 1, 1)  # each word's region matches only that word
    assert word_contrastive_loss(specific, ids, None, 0.1) < 1e-3
    shared = torch.ones(2, 3, 3)  # one region for the whole report: every word matches it alike
    # row 0: 3 candidates per word; row 1: the repeated id 5 is no negative of itself
    expected = (3 * math.log(3) + 2 * math.log(2) + math.log(3)) / 6
    assert word_contrastive_loss(shared, ids, None, 0.1).item() == pytest.approx(expected, rel=1e-5)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    padded = shared.clone()
    padded[0, :, 2] = 9.0  # a padding word is no candidate
    assert word_contrastive_loss(padded, ids, mask, 0.1).item() == pytest.approx(
        (2 * math.log(2) + 2 * math.log(2) + math.log(3)) / 5, rel=1e-5)
    only_repeats = torch.tensor([[4, 4, 4], [4, 4, 4]])
    assert word_contrastive_loss(shared, only_repeats, None, 0.1).item() == 0.0  # nothing to contrast


def test_attention_entropy_penalty():
    uniform = torch.full((2, 3, 8), 1 / 8)
    peaked = torch.eye(8)[:3].unsqueeze(0).repeat(2, 1, 1)
    assert attention_entropy(uniform).item() == pytest.approx(1.0, rel=1e-5)
    assert attention_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
    mask = torch.tensor([[True, False, False], [True, True, False]])
    mixed = peaked.clone()
    mixed[0, 1:] = 1 / 8  # uniform rows only where the mask says padding
    assert attention_entropy(mixed, mask).item() == pytest.approx(0.0, abs=1e-6)
    real, syn, batch = make_case()
    real.local_attn = torch.full((4, 5, 9), 1 / 9)
    base = objective_terms(real, syn, batch, LossConfig(local_loss="cosine", w_local=0.5))["local"]
    penalised = objective_terms(real, syn, batch, LossConfig(local_loss="cosine", w_local=0.5, local_entropy=2.0))["local"]
    assert (penalised - base).item() == pytest.approx(0.5 * 2.0 * 1.0, rel=1e-5)  # w_local x weight x entropy


def test_local_align_pair_similarity_diagonal_is_forward():
    from cxrdr.train.models.heads import LocalAlign

    torch.manual_seed(3)
    head = LocalAlign(text_dim=12, patch_dim=20, embed_dim=16, heads=4)
    text, patches = torch.randn(3, 5, 12), torch.randn(3, 7, 20)
    v, t, _ = head(text, patches)
    pairs = head.pair_similarity(text, patches)
    assert pairs.shape == (3, 3, 5)
    own = F.cosine_similarity(v, t, dim=-1)
    assert torch.allclose(pairs.diagonal(0, 0, 1).T, own, atol=1e-5)
    # image j's answer to text i does not depend on the other images in the batch
    assert torch.allclose(head.pair_similarity(text[:1], patches[1:2])[0, 0], pairs[0, 1], atol=1e-5)


def test_masked_pool_consistency_and_sparsity():
    full, masked, txt = unit(3, 4, 22), unit(3, 4, 23), unit(3, 4, 24)
    expected = np.mean([(float(masked[i] @ txt[i]) - float(full[i] @ txt[i])) ** 2 for i in range(3)])
    full.requires_grad_(True)
    masked.requires_grad_(True)
    got = consistency_loss(masked, full, txt)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    got.backward()
    assert full.grad is None  # s_full is the target
    assert torch.count_nonzero(masked.grad) > 0
    assert consistency_loss(full.detach(), full.detach(), txt).item() == pytest.approx(0.0, abs=1e-12)
    z = torch.tensor([[1.0, 0.0, 0.5], [0.25, 0.25, 0.0]])
    assert sparsity_loss(z).item() == pytest.approx(2.0 / 6)


# ----------------------------------------------------------------------------- the objective


def make_case(b=4, d=6, seed=30):
    g = torch.Generator().manual_seed(seed)

    def u(*shape):
        return F.normalize(torch.randn(*shape, generator=g), dim=-1)

    scale = torch.tensor(10.0)
    real = FakeOutput(u(b, d), u(b, d), scale, mask=torch.rand(b, 9, generator=g), masked_image_emb=u(b, d),
                      local_visual=torch.randn(b, 5, d, generator=g), local_text=torch.randn(b, 5, d, generator=g),
                      text_mask=torch.rand(b, 5, generator=g) > 0.3,
                      local_pair_similarity=torch.rand(b, b, 3, generator=g) * 2 - 1,
                      local_pair_mask=torch.tensor([[True, True, False]] * b))
    syn = FakeOutput(real.image_emb, u(b, d), scale)
    batch = {
        "teacher": {"clipT": {"img": u(b, 8), "txt": u(b, 8), "syn": u(b, 8)},
                    "textT": {"img": None, "txt": u(b, 3), "syn": u(b, 3)}},
        "subject_id": ["p1", "p1", "p2", "p3"][:b], "study_id": ["s1", "s2", "s3", "s4"][:b],
        "report_text": ["a", "b", "c", "a"][:b], "caption_text": ["n", "n", "x", "y"][:b],
        "labels": (torch.rand(b, 14, generator=g) > 0.7).float(),
    }
    return real, syn, batch


def test_objective_terms_and_total():
    real, syn, batch = make_case()
    cfg = LossConfig(lambda_distill=0.6, teacher_scales={"textT": 20.0}, lambda_sparse=0.1, mu_consistency=2.0,
                     w_local=0.5, w_mask_nce=0.3)
    terms = objective_terms(real, syn, batch, cfg, step=0, total_steps=10)
    assert set(terms) == {"clip", "distill", "clip_syn", "distill_syn", "mask_nce", "sparsity", "consistency",
                          "local", "total"}
    t = batch["teacher"]
    assert terms["clip"].item() == pytest.approx(0.4 * ref_clip(real.image_emb, real.text_emb, 10.0), rel=1e-5)
    exp_distill = 0.6 * distill_loss(real.image_emb, real.text_emb, 10.0, [t["clipT"]["img"], None],
                                     [t["clipT"]["txt"], t["textT"]["txt"]], [100.0, 20.0]).item()
    assert terms["distill"].item() == pytest.approx(exp_distill, rel=1e-5)
    exp_syn = 0.6 * distill_loss(syn.image_emb, syn.text_emb, 10.0, [t["clipT"]["img"], None],
                                 [t["clipT"]["syn"], t["textT"]["syn"]], [100.0, 20.0]).item()
    assert terms["distill_syn"].item() == pytest.approx(exp_syn, rel=1e-5)
    assert terms["sparsity"].item() == pytest.approx(0.1 * real.mask.mean().item(), rel=1e-5)
    assert terms["mask_nce"].item() == pytest.approx(0.3 * ref_clip(real.masked_image_emb, real.text_emb, 10.0),
                                                     rel=1e-5)
    assert terms["local"].item() == pytest.approx(
        0.5 * local_contrastive_loss(real.local_pair_similarity, real.local_pair_mask, 0.1).item(), rel=1e-6)
    parts = sum(v.item() for k, v in terms.items() if k != "total")
    assert terms["total"].item() == pytest.approx(parts, rel=1e-6)
    # the seeds' cosine form and both together
    cos = local_alignment_loss(real.local_visual, real.local_text, real.text_mask).item()
    contrastive = local_contrastive_loss(real.local_pair_similarity, real.local_pair_mask, 0.1).item()
    for mode, expected in (("cosine", cos), ("both", cos + contrastive)):
        got = objective_terms(real, syn, batch, LossConfig(w_local=0.5, local_loss=mode))["local"].item()
        assert got == pytest.approx(0.5 * expected, rel=1e-6)
    without_pairs = FakeOutput(real.image_emb, real.text_emb, real.logit_scale, local_visual=real.local_visual,
                               local_text=real.local_text, text_mask=real.text_mask)
    with pytest.raises(ValueError, match="local_pairs=True"):
        objective_terms(without_pairs, None, batch, LossConfig(local_loss="contrastive"))
    with pytest.raises(ValueError, match="local_words=True"):  # make_case has pairs but no word similarity
        objective_terms(real, syn, batch, LossConfig(local_word_contrast=True))

    # no teacher embeddings (plain mode): lambda -> 0, pure CLIP
    plain = dict(batch, teacher={})
    terms = objective_terms(FakeOutput(real.image_emb, real.text_emb, real.logit_scale), None, plain, cfg)
    assert set(terms) == {"clip", "total"}
    assert terms["clip"].item() == pytest.approx(ref_clip(real.image_emb, real.text_emb, 10.0), rel=1e-5)


def test_objective_pair_selection_options_and_queue():
    real, syn, batch = make_case()
    base = objective_terms(real, None, batch, LossConfig(lambda_distill=0.0))["clip"]
    fn = objective_terms(real, None, batch, LossConfig(lambda_distill=0.0, fn_masking="subject"))["clip"]
    pos = np.eye(4)
    pos[0, 1] = pos[1, 0] = 1
    expected = ref_clip(real.image_emb, real.text_emb, 10.0, targets=pos / pos.sum(1, keepdims=True))
    assert fn.item() == pytest.approx(expected, rel=1e-5)
    soft = objective_terms(real, None, batch, LossConfig(lambda_distill=0.0, label_soft_targets=True))["clip"]
    assert soft.item() != pytest.approx(base.item())
    objective = Objective(LossConfig(lambda_distill=0.0, queue_size=8), embed_dim=6)
    queue = objective.queue
    first = objective(real, batch)["clip"]
    assert first.item() == pytest.approx(base.item(), rel=1e-6) and len(queue) == 4
    second = objective(real, batch, update_queue=False)["clip"]
    assert second.item() > first.item() and len(queue) == 4


def test_loss_balance_gradient_norms():
    trunk = torch.nn.Linear(3, 3, bias=False)
    x = torch.randn(2, 3)
    y = trunk(x)
    head = torch.nn.Parameter(torch.ones(3))  # a term reading only this never reaches the trunk
    terms = {"a": (y ** 2).sum(), "b": 3 * y.sum(), "c": torch.tensor(1.0), "d": (head * x).sum(),
             "total": (y ** 2).sum() + 3 * y.sum()}
    norms = loss_balance(terms, list(trunk.parameters()))
    ga = torch.autograd.grad((trunk(x) ** 2).sum(), trunk.weight)[0]
    gb = torch.autograd.grad(3 * trunk(x).sum(), trunk.weight)[0]
    assert norms["a"] == pytest.approx(ga.norm().item(), rel=1e-5)
    assert norms["b"] == pytest.approx(gb.norm().item(), rel=1e-5)
    assert sorted(norms) == ["a", "b"]  # no graph (c), no path to the trunk (d), and total: left out, not 0.0
    terms["total"].backward()  # graph kept


def test_loss_config_validation():
    assert LossConfig.from_dict({"lambda_distill": 0.5}).lambda_distill == 0.5
    with pytest.raises(ValueError, match="unknown loss option"):
        LossConfig.from_dict({"lamda": 1})
    with pytest.raises(ValueError, match="fn_mode"):
        LossConfig(fn_mode="drop")


def test_losses_stay_float32_under_autocast():
    img, txt = unit(4, 8, 40), unit(4, 8, 41)
    ref = clip_loss(img, txt, 30.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = clip_loss(img, txt, 30.0)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(ref.item(), rel=1e-6)


def test_cosine_local_align_attention_is_the_scored_similarity():
    from cxrdr.train.models.heads import CosineLocalAlign

    torch.manual_seed(4)
    head = CosineLocalAlign(text_dim=12, patch_dim=20, embed_dim=16, temperature=0.1)
    text, patches = torch.randn(3, 5, 12), torch.randn(3, 7, 20)
    v, t, attn = head(text, patches)
    t_unit, p_unit = F.normalize(head.text_proj(text), dim=-1), F.normalize(head.patch_proj(patches), dim=-1)
    assert torch.allclose(attn, (t_unit @ p_unit.transpose(1, 2) / 0.1).softmax(-1), atol=1e-6)
    assert torch.allclose(attn.argmax(-1), (t_unit @ p_unit.transpose(1, 2)).argmax(-1))  # looks where it matches
    pairs = head.pair_similarity(text, patches)
    assert torch.allclose(pairs.diagonal(0, 0, 1).T, F.cosine_similarity(v, t, dim=-1), atol=1e-5)
    assert torch.allclose(head.pair_similarity(text[:1], patches[1:2])[0, 0], pairs[0, 1], atol=1e-5)
    pmask = torch.ones(3, 7, dtype=torch.bool)
    pmask[:, 5:] = False
    assert head(text, patches, patch_mask=pmask)[2][..., 5:].abs().max() == 0
    # values: the attention stays the one computed on the patches; the region pools the values instead
    values = torch.randn(3, 7, 20)
    v2, _, attn2 = head(text, patches, values=values)
    assert torch.allclose(attn2, attn)
    assert torch.allclose(v2, attn @ F.normalize(head.patch_proj(values), dim=-1), atol=1e-6)
    pairs2 = head.pair_similarity(text, patches, values=values)
    assert torch.allclose(pairs2.diagonal(0, 0, 1).T, F.cosine_similarity(v2, t, dim=-1), atol=1e-5)
    with pytest.raises(ValueError, match="values"):
        head(text, patches, values=values[:, :5])


@pytest.mark.parametrize("with_values", [False, True])
def test_pair_similarity_gram_form_equals_the_fused_attention(with_values):
    """The two forms of the cosine local head's pair similarity (the head picks by shape: patches < dims takes
    the Gram form) agree in value and gradient, padded patches and pooled values included; bf16 autocast leaves
    the Gram form in fp32."""
    from cxrdr.train.models.heads import pooled_cosine_by_gram, pooled_cosine_by_sdpa

    g = torch.Generator().manual_seed(11)
    words = F.normalize(torch.randn(3, 4, 24, generator=g), dim=-1)
    patches = F.normalize(torch.randn(5, 9, 24, generator=g), dim=-1)
    values = F.normalize(torch.randn(5, 9, 24, generator=g), dim=-1) if with_values else None
    mask = torch.ones(5, 9, dtype=torch.bool)
    mask[1, 6:] = False
    weights = torch.randn(3, 5, 4, generator=g)
    outs, grads = [], []
    for form in (pooled_cosine_by_sdpa, pooled_cosine_by_gram):
        inputs = [x.clone().requires_grad_() for x in (words, patches) + ((values,) if with_values else ())]
        out = form(inputs[0], inputs[1], inputs[2] if with_values else None, 0.1, mask)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append([x.grad for x in inputs])
    assert outs[0].shape == (3, 5, 4)
    assert torch.allclose(outs[1], outs[0], atol=1e-5)
    for ours, reference in zip(grads[1], grads[0]):
        assert torch.allclose(ours, reference, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # it stays in fp32, as the fused kernels keep their scores
        low = pooled_cosine_by_gram(words, patches, values, 0.1, mask)
    assert low.dtype == torch.float32 and torch.allclose(low, outs[1], atol=1e-6)


@pytest.mark.parametrize("with_values, with_mask", [(False, False), (False, True), (True, True)])
def test_gram_cosine_backward_is_the_gradient_of_its_forward(with_values, with_mask):
    """The Gram form's hand-written backward (``gram_cosine``: one layout, the softmax's row sum dropped because
    it is zero here) is the gradient of its forward: torch.autograd.gradcheck in float64, padded patches and
    separate values included."""
    from cxrdr.train.models.gram_cosine import _GramPooledCosine

    g = torch.Generator().manual_seed(5)
    flat = F.normalize(torch.randn(6, 8, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    patches = F.normalize(torch.randn(3, 5, 8, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    values = None
    if with_values:
        values = F.normalize(torch.randn(3, 5, 8, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    mask = None
    if with_mask:
        mask = torch.ones(3, 5, dtype=torch.bool)
        mask[2, 3:] = False
    assert torch.autograd.gradcheck(lambda f, p, v: _GramPooledCosine.apply(f, p, v, 0.3, mask),
                                    (flat, patches, values))


def test_pair_similarity_benchmark_agrees_with_the_heads_choice_of_form():
    """benchmarks/pair_similarity.py: both forms agree, and the head takes the Gram form exactly where it counts
    fewer FLOPs: many words against few patches of many dims, not few words, nor more patches than dims."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import pair_similarity

    rows = pair_similarity.measure(batch=16, words_per_text=8, shapes=[(6, 32), (32, 6)], rounds=1)
    rows += pair_similarity.measure(batch=3, words_per_text=2, shapes=[(24, 32)], rounds=1)
    assert [r["head_takes"] for r in rows] == ["gram", "fused", "fused"]
    from cxrdr.train.models.heads import gram_form_is_cheaper

    # the GPU students' shape takes the Gram form, unless it pools separate values (2QND more for it)
    assert gram_form_is_cheaper(2048, 196, 512) and not gram_form_is_cheaper(2048, 196, 512, separate_values=True)
    for r in rows:
        assert (r["gram_gflops"] < r["fused_gflops"]) == (r["head_takes"] == "gram"), r
        assert r["max_diff"] < 1e-5 and r["gram_ms"] > 0 and r["fused_ms"] > 0
    # --group: the Gram form in groups gives the whole batch's cosines of the same pairs, with fewer FLOPs and bytes
    (grouped,) = pair_similarity.measure(batch=10, words_per_text=4, shapes=[(6, 32)], rounds=1, group=4)
    assert grouped["grouped_max_diff"] < 1e-6 and grouped["grouped_ms"] > 0
    assert grouped["grouped_gflops"] < grouped["gram_gflops"] and grouped["grouped_mb"] < grouped["gram_mb"]


def test_negated_tokens_cover_a_cue_to_the_end_of_its_sentence():
    from cxrdr.train.models.heads import negated_tokens

    # [CLS] small effusion . there is no edema or pneumothorax ; mild atelectasis . [SEP] [PAD]
    ids = torch.tensor([[1, 20, 21, 9, 30, 31, 5, 22, 32, 23, 8, 24, 25, 9, 2, 0]])
    negated = negated_tokens(ids, cue_ids=[5, 6], end_ids=[9, 8])
    expected = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert negated[0].int().tolist() == expected
    # two negated sentences in a row: the second cue's scope also ends at its sentence
    ids2 = torch.tensor([[5, 21, 9, 6, 22, 9, 23, 9]])
    assert negated_tokens(ids2, [5, 6], [9])[0].int().tolist() == [1, 1, 0, 1, 1, 0, 0, 0]


def test_cued_sentence_tokens_cover_every_word_of_a_sentence_that_states_normal_anatomy():
    from cxrdr.train.models.heads import cued_sentence_tokens

    # [CLS] heart size is normal . small effusion ; lungs are clear . [SEP]   (cue 7 last in its sentence)
    ids = torch.tensor([[1, 20, 21, 22, 7, 9, 30, 31, 8, 23, 24, 6, 9, 2, 0]])
    normal = cued_sentence_tokens(ids, cue_ids=[6, 7], end_ids=[9, 8])
    assert normal[0].int().tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert not cued_sentence_tokens(ids, cue_ids=[99], end_ids=[9, 8]).any()


def test_skip_normal_keeps_normal_statements_out_of_the_drawn_words():
    from cxrdr.train.models import build_student

    torch.manual_seed(0)
    student = build_student("tiny-B", init_weights=False)
    text = "The heart is normal. The lungs are clear. Small right effusion."
    tok = student.tokenize([text] * 2)
    images = torch.rand(2, 1, student.image_size, student.image_size)
    ids = tok["input_ids"]
    vocab = student.tokenizer.tokenizer.get_vocab()
    normal_words = {vocab[w] for w in ("heart", "lungs", "clear", "normal")}
    for skip in (False, True):
        out = student(images, ids, tok["attention_mask"], local_pairs=64, local_affirmed=True, local_skip_normal=skip)
        drawable = set(out.local_drawable_ids[out.local_drawable_ids >= 0].tolist())
        assert vocab["effusion"] in drawable
        assert (normal_words & drawable) == (set() if skip else normal_words)


def test_mask_words_term_follows_every_drawable_word_by_its_idf():
    from cxrdr.train.losses.patch_ib import MaskWordsLoss

    from tests.fakes import FakeOutput

    scores = torch.tensor([[0.2, 0.7, 0.4, 0.6]], requires_grad=True)
    attn = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]]])
    idf = torch.tensor([[2.0, 0.0, 1.0]])  # word 1 may not be drawn (or is in every report)
    out = FakeOutput(image_emb=None, text_emb=None, logit_scale=None, mask_scores=scores, local_attn=attn,
                     local_word_idf=idf)
    loss = MaskWordsLoss(0.5)(out)["mask_words"]
    target = torch.tensor([0.0, 2.0, 1.0, 0.0]) / 3
    expected = -(target * torch.logit(scores[0]).log_softmax(-1)).sum()
    assert torch.allclose(loss, 0.5 * expected)
    out.local_attn = attn.clone()
    out.local_attn[0, 1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # a zero-weight word changes nothing
    assert torch.allclose(MaskWordsLoss(0.5)(out)["mask_words"], loss)
    out.local_word_idf = None
    assert MaskWordsLoss(0.5)(out) == {}


def test_mask_follows_words_pulls_the_mask_towards_the_words_map():
    from cxrdr.train.losses.patch_ib import mask_follows_words_loss

    attn = torch.zeros(2, 3, 4)
    attn[:, :, 2] = 1.0  # every word looks at patch 2
    words = torch.tensor([[1, 1, 0], [0, 0, 0]]).bool()  # the second image has no words: left out
    logits = torch.zeros(2, 4, requires_grad=True)
    loss = mask_follows_words_loss(torch.sigmoid(logits), attn, words)
    assert loss.item() == pytest.approx(math.log(4), rel=1e-4)  # uniform mask vs a one-patch target
    loss.backward()
    assert logits.grad[0].argmin() == 2 and logits.grad[1].abs().max() == 0  # descent raises patch 2 only
    peaked = torch.tensor([[-5.0, -5.0, 5.0, -5.0], [0.0, 0.0, 0.0, 0.0]])
    assert mask_follows_words_loss(torch.sigmoid(peaked), attn, words) < loss
    # weighted words (IDF): a word of weight 0 ('the', in every report) does not move the target
    attn[0, 1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # the second word looks at patch 0
    idf = torch.tensor([[2.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    at_patch_two = torch.tensor([[-5.0, -5.0, 5.0, -5.0], [0.0] * 4])
    assert mask_follows_words_loss(torch.sigmoid(at_patch_two), attn, words, idf).item() < 0.01
    assert mask_follows_words_loss(torch.sigmoid(at_patch_two), attn, words).item() > 1.0  # unweighted: half at 0


def test_local_contrast_masks_images_whose_report_names_the_same_word():
    sim = torch.tensor([[[0.9], [0.8], [0.1]],   # text 0's word vs images 0, 1, 2
                        [[0.2], [0.9], [0.1]],
                        [[0.1], [0.1], [0.9]]])  # (B_text, B_image, L=1)
    plain = local_contrastive_loss(sim, temperature=0.1)
    shared = torch.zeros(3, 1, 3, dtype=torch.bool)
    shared[0, 0, 1] = True  # image 1's report names text 0's word too: no negative for it
    shared[0, 0, 0] = True  # the own image is always kept
    masked = local_contrastive_loss(sim, temperature=0.1, shared=shared)
    logits = sim.permute(0, 2, 1).reshape(3, 3) / 0.1
    row0 = -torch.log_softmax(logits[0, [0, 2]], 0)[0]
    rest = -torch.log_softmax(logits[1:], 1).diagonal(1)  # rows 1, 2 unchanged
    assert masked.item() == pytest.approx(((row0 + rest.sum()) / 3).item(), rel=1e-5)
    assert masked < plain


def test_local_loss_masks_shared_words_only_when_asked():
    from cxrdr.train.losses.local import LocalLoss, shared_words

    g = torch.Generator().manual_seed(5)
    sim = torch.rand(3, 3, 2, generator=g)
    pair_ids = torch.tensor([[7, 8], [7, 9], [4, 5]])  # text 0's word 7 is drawable in report 1 too
    drawable_ids = torch.tensor([[7, 8, -1], [9, 7, -1], [4, 5, 8]])
    drawable_ids[2, 2] = -1  # report 2 has word 8 only inside a negation: not drawable, no match
    shared = shared_words(pair_ids, drawable_ids)
    assert shared[0, 0].tolist() == [True, True, False] and shared[0, 1].tolist() == [True, False, False]
    out = FakeOutput(image_emb=unit(3, 4, 1), text_emb=unit(3, 4, 2), logit_scale=torch.tensor(10.0),
                     local_visual=torch.zeros(3, 2, 4), local_text=torch.zeros(3, 2, 4),
                     local_pair_similarity=sim, local_pair_mask=torch.ones(3, 2, dtype=torch.bool),
                     local_pair_ids=pair_ids, local_drawable_ids=drawable_ids)
    masked = LocalLoss(weight=1.0, mask_shared_words=True)(out)["local"]
    plain = LocalLoss(weight=1.0)(out)["local"]
    assert masked.item() == pytest.approx(local_contrastive_loss(sim, None, 0.1, shared).item(), rel=1e-6)
    assert plain.item() == pytest.approx(local_contrastive_loss(sim, None, 0.1).item(), rel=1e-6)
    assert masked.item() != pytest.approx(plain.item())


def _outside_groups(full: torch.Tensor, group: int) -> torch.Tensor:
    """The whole batch's (B, B, L) pair similarity with every image outside its text's group of ``group`` rows at
    -inf: what the grouped token-region term must equal (numpy-free, but no code under test)."""
    b = full.shape[0]
    same = torch.tensor([[i // group == j // group for j in range(b)] for i in range(b)])
    return full.masked_fill(~same.unsqueeze(-1), float("-inf"))


@pytest.mark.parametrize("group", [2, 3])
def test_grouped_token_region_term_is_the_whole_batch_one_with_other_groups_left_out(group):
    """loss.local_group_size: the pooled cosines of each text over its group's images are the whole batch's, cut
    to the group (a last, smaller group padded with -inf), and the loss on them is the whole batch's loss with the
    other groups' images taken out of each word's negatives, shared-word masking included; a group as large as the
    batch (or 0) is the whole batch."""
    from cxrdr.train.losses.local import shared_words
    from cxrdr.train.models.heads import CosineLocalAlign, grouped_pair_similarity

    torch.manual_seed(3)
    align = CosineLocalAlign(text_dim=6, patch_dim=5, embed_dim=8, temperature=0.2)
    tokens, patches = torch.randn(5, 4, 6), torch.randn(5, 9, 5)  # 5 texts x 4 words, 5 images x 9 patches
    full = align.pair_similarity(tokens, patches)
    grouped = grouped_pair_similarity(align.pair_similarity, tokens, patches, group)
    assert grouped.shape == (5, group, 4)
    for i in range(5):
        for j in range(group):
            image = i // group * group + j
            if image < 5:
                assert torch.allclose(grouped[i, j], full[i, image], atol=1e-6)
            else:
                assert torch.isinf(grouped[i, j]).all() and (grouped[i, j] < 0).all()
    for whole in (0, 5, 8):
        assert torch.equal(grouped_pair_similarity(align.pair_similarity, tokens, patches, whole), full)
    values = torch.randn(5, 9, 5)  # the pooled values (local_pool_embedded) are cut by row as the images are
    pooled = grouped_pair_similarity(align.pair_similarity, tokens, patches, group, values=values)
    whole_pooled = align.pair_similarity(tokens, patches, values=values)[group, group:2 * group]  # row `group`'s
    assert torch.allclose(pooled[group, :len(whole_pooled)], whole_pooled, atol=1e-6)  # group: images group, ...

    mask = torch.rand(5, 4) > 0.3
    mask[:, 0] = True
    expected = local_contrastive_loss(_outside_groups(full, group), mask, 0.1)
    got = local_contrastive_loss(grouped, mask, 0.1)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert got.item() != pytest.approx(local_contrastive_loss(full, mask, 0.1).item(), rel=1e-3)
    pair_ids = torch.tensor([[7, 8, 9, 1], [7, 2, 3, 4], [8, 5, 6, 1], [9, 9, 7, 2], [1, 2, 3, 4]])
    shared = shared_words(pair_ids, pair_ids)  # (B, L, B): image j's report holds word k of text i
    assert local_contrastive_loss(grouped, mask, 0.1, shared).item() == pytest.approx(
        local_contrastive_loss(_outside_groups(full, group), mask, 0.1, shared).item(), rel=1e-5)
    got.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in align.parameters())


def test_a_group_size_runs_through_the_step_and_changes_only_the_token_region_term(phantom_shards, tmp_path):
    """tiny-D at batch 4: groups of 2 change the local term alone (every other term equal), a group of the whole
    batch changes nothing; a negative size is refused naming the option."""
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer

    terms = {}
    for size in (0, 2, 4):
        cfg = TrainConfig.load(None, shards=str(phantom_shards), model="tiny-D", batch_size=4, workers=0,
                               device="cpu", steps=2, seed=0, progress=False, eval_every=0,
                               out=str(tmp_path / f"g{size}"), **{"loss.local_group_size": size})
        trainer = Trainer(cfg)
        torch.manual_seed(0)
        terms[size] = {k: v.item() for k, v in trainer.task.forward(next(trainer._batches()), 0).items()}
    assert terms[4] == terms[0]
    assert terms[2]["local"] != pytest.approx(terms[0]["local"], rel=1e-4)
    assert {k: v for k, v in terms[2].items() if k not in ("local", "total")} == pytest.approx(
        {k: v for k, v in terms[0].items() if k not in ("local", "total")})
    with pytest.raises(ValueError, match="local_group_size"):
        LossConfig(local_group_size=-1)


def test_affinity_loss_matches_the_teachers_similarities_and_is_a_weighted_term():
    from cxrdr.train.losses.distill import affinity_loss

    torch.manual_seed(0)
    img, txt = F.normalize(torch.randn(6, 8), dim=-1), F.normalize(torch.randn(6, 8), dim=-1)
    t_img, t_txt = torch.randn(6, 16), torch.randn(6, 16)  # another width: no projection needed
    assert float(affinity_loss(img, txt, [img], [txt])) == pytest.approx(0.0, abs=1e-10)  # its own geometry
    loss = affinity_loss(img, txt, [t_img], [t_txt])
    tn_img, tn_txt = F.normalize(t_img, dim=-1), F.normalize(t_txt, dim=-1)
    expected = torch.stack([F.mse_loss(txt @ txt.T, tn_txt @ tn_txt.T), F.mse_loss(img @ txt.T, tn_img @ tn_txt.T),
                            F.mse_loss(img @ img.T, tn_img @ tn_img.T)]).mean()
    assert torch.allclose(loss, expected)
    text_only = affinity_loss(img, txt, [None], [t_txt])  # a text-only teacher: text-text alone
    assert torch.allclose(text_only, F.mse_loss(txt @ txt.T, tn_txt @ tn_txt.T))
    real, syn, batch = make_case()
    base = objective_terms(real, syn, batch, LossConfig())
    weighted = objective_terms(real, syn, batch, LossConfig(w_affinity=2.0))
    assert "affinity" not in base and float(weighted["affinity"]) > 0
    assert float(weighted["total"] - base["total"]) == pytest.approx(
        float(weighted["affinity"] + weighted.get("affinity_syn", 0.0)), rel=1e-5)


def test_feature_loss_is_one_minus_cosine_to_the_teacher_and_a_weighted_term():
    from cxrdr.train.losses.distill import feature_loss

    torch.manual_seed(0)
    mapped, teacher = torch.randn(6, 16), torch.randn(6, 16)
    assert float(feature_loss([teacher * 3.0], [teacher])) == pytest.approx(0.0, abs=1e-6)  # direction only
    assert float(feature_loss([-teacher], [teacher])) == pytest.approx(2.0, abs=1e-6)
    expected = 1 - F.cosine_similarity(mapped, teacher, dim=-1).mean()
    assert torch.allclose(feature_loss([mapped], [teacher]), expected)
    with pytest.raises(ValueError, match=r"student \(6, 8\) mapped into the teacher's space"):
        feature_loss([mapped[:, :8]], [teacher])
    real, syn, batch = make_case()
    g = torch.Generator().manual_seed(1)
    # the student's embeddings in each teacher's space (what the student's teacher heads give)
    real.teacher_space = {name: {part: torch.randn(4, t["txt"].shape[1], generator=g) for part in ("img", "txt", "syn")}
                          for name, t in batch["teacher"].items()}
    base = objective_terms(real, syn, batch, LossConfig())
    weighted = objective_terms(real, syn, batch, LossConfig(w_feature=3.0))
    assert "feature" not in base and float(weighted["feature"]) > 0 and float(weighted["feature_syn"]) > 0
    assert float(weighted["total"] - base["total"]) == pytest.approx(
        float(weighted["feature"] + weighted["feature_syn"]), rel=1e-5)
    space, teachers = real.teacher_space, batch["teacher"]
    b_real = [(space["clipT"]["txt"], teachers["clipT"]["txt"]), (space["clipT"]["img"], teachers["clipT"]["img"]),
              (space["textT"]["txt"], teachers["textT"]["txt"])]  # the text-only teacher has no image target
    assert float(weighted["feature"]) == pytest.approx(3.0 * float(feature_loss(*zip(*b_real))), rel=1e-5)
    b_syn = [(space[n]["syn"], teachers[n]["syn"]) for n in ("clipT", "textT")]  # B_syn: the captions alone
    assert float(weighted["feature_syn"]) == pytest.approx(3.0 * float(feature_loss(*zip(*b_syn))), rel=1e-5)
    real.teacher_space = None  # a student without teacher heads: no term, no error
    assert "feature" not in objective_terms(real, syn, batch, LossConfig(w_feature=3.0))


def test_cosine_to_words_equals_normalising_the_pooled_vectors_first():
    """pair_similarity's cosine without a normalised copy of the (B_text, B_image, L, D) tensor gives what
    F.normalize then the dot product gave, gradients included, and 0 (not NaN) for a zero vector."""
    import torch.nn.functional as F

    from cxrdr.train.models.heads import cosine_to_words

    g = torch.Generator().manual_seed(3)
    pooled = torch.randn(3, 4, 5, 6, generator=g)
    pooled[0, 1, 2] = 0.0
    words = F.normalize(torch.randn(3, 5, 6, generator=g), dim=-1)
    a, b = pooled.clone().requires_grad_(), pooled.clone().requires_grad_()
    ours = cosine_to_words(a, words)
    reference = (F.normalize(b, dim=-1) * words.unsqueeze(1)).sum(-1)
    assert ours.shape == (3, 4, 5)
    assert torch.allclose(ours, reference, atol=1e-6)
    assert ours[0, 1, 2] == 0.0
    (ours * torch.arange(60.0).reshape(3, 4, 5)).sum().backward()
    (reference * torch.arange(60.0).reshape(3, 4, 5)).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-5)
