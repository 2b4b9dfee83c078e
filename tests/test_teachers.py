"""Teacher registry: spec parsing, the BiomedCLIP local-dir path (with a tiny stand-in model),
openclip/random/text/ckpt teachers, and clear, fast errors when weights are missing."""
from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cxrdr.common.shards import TEACHER_NAME_RE
from cxrdr.teachers import TeacherError, VALID_SPECS, load_teacher, load_teachers, parse_spec

BIOMEDBERT = "microsoft/BiomedNLP-BiomedBERT-base-uncased-abstract"
WORDS = ("the a no of in is and with left right lung lungs heart pleural effusion pneumothorax "
         "cardiomegaly small large mild normal opacity base clear").split()


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Each test gets its own CXRDR_CACHE (hf-configs, biomedclip lookup); MiniLM shares the real one."""
    monkeypatch.setenv("CXRDR_CACHE", str(tmp_path / "cxrdr-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _unit_norm(emb: torch.Tensor) -> bool:
    return torch.allclose(emb.norm(dim=-1), torch.ones(emb.shape[0]), atol=1e-4)


# ------------------------------------------------------------------ tiny BiomedCLIP-layout snapshot
def _tiny_bert(dir_: Path) -> None:
    from transformers import BertConfig, BertModel, BertTokenizerFast
    dir_.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz0123456789.,"]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    (dir_ / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(dir_ / "vocab.txt"), do_lower_case=True).save_pretrained(dir_)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
                        intermediate_size=128, max_position_embeddings=512)
    BertModel(config, add_pooling_layer=False).save_pretrained(dir_)


def _biomedclip_config(hf_model_name: str) -> dict:
    """BiomedCLIP's real open_clip_config.json, with a tiny timm ViT and a tiny BERT."""
    return {
        "model_cfg": {
            "embed_dim": 32,
            "vision_cfg": {"timm_model_name": "test_vit", "timm_model_pretrained": False,  # real: vit_base_patch16_224
                           "timm_pool": "", "timm_proj": "linear", "image_size": 32},  # real: 224
            "text_cfg": {"hf_model_name": hf_model_name, "hf_tokenizer_name": hf_model_name,
                         "hf_proj_type": "mlp", "hf_pooler_type": "cls_last_hidden_state_pooler",
                         "context_length": 256},
        },
        "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073],
                           "std": [0.26862954, 0.26130258, 0.27577711]},
    }


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """(A, B, bert): A names a local BERT dir; B is A's weights + tokenizer with the *hub* text
    model name exactly as the real snapshot has it (no BERT config inside: inferred offline)."""
    import open_clip
    root = tmp_path_factory.mktemp("biomedclip")
    bert = root / "tiny-bert"
    _tiny_bert(bert)
    snap_a = root / "snapshot-a"
    snap_a.mkdir()
    (snap_a / "open_clip_config.json").write_text(json.dumps(_biomedclip_config(str(bert))))
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (bert / name).exists():
            (snap_a / name).write_bytes((bert / name).read_bytes())
    torch.manual_seed(1)
    model = open_clip.create_model(f"local-dir:{snap_a}")  # random ViT + the tiny BERT's weights
    with torch.no_grad():
        model.logit_scale.fill_(4.6052)  # ~100 after exp, like a trained CLIP
    torch.save(model.state_dict(), snap_a / "open_clip_pytorch_model.bin")
    snap_b = root / "cache" / "biomedclip"
    snap_b.mkdir(parents=True)
    for item in snap_a.iterdir():
        (snap_b / item.name).write_bytes(item.read_bytes())
    (snap_b / "open_clip_config.json").write_text(json.dumps(_biomedclip_config(BIOMEDBERT)))
    return snap_a, snap_b, bert


IMAGES = torch.rand(3, 1, 32, 32, generator=torch.Generator().manual_seed(0))
TEXTS = ["small left pleural effusion", "no pneumothorax", "the heart is normal in size"]


def test_biomedclip_local_dir_exact_path(snapshots):
    snap_a, _, _ = snapshots
    teacher = load_teacher(f"biomedclip:{snap_a}")
    assert teacher.name == "biomedclip" and teacher.kind == "clip"
    assert teacher.image_size == 32 and teacher.context_length == 256 and teacher.embed_dim == 32
    assert teacher.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert teacher.logit_scale == pytest.approx(100.0, abs=0.01)
    assert teacher.notes["source"] == f"local-dir:{snap_a.resolve()}"
    img, txt = teacher.encode_images(IMAGES), teacher.encode_texts(TEXTS)
    assert img.shape == (3, 32) and txt.shape == (3, 32) and img.dtype == torch.float32
    assert _unit_norm(img) and _unit_norm(txt)
    assert torch.equal(img, teacher.encode_images(IMAGES)) and torch.equal(txt, teacher.encode_texts(TEXTS))
    again = load_teacher(f"biomedclip:{snap_a}")
    assert again.fingerprint == teacher.fingerprint
    assert torch.allclose(again.encode_images(IMAGES), img) and torch.allclose(again.encode_texts(TEXTS), txt)
    json.dumps(teacher.describe())


def test_biomedclip_model_cache_with_hub_text_name_offline(snapshots):
    """The real snapshot names BiomedBERT on the hub: offline its config is inferred from the weights."""
    snap_a, snap_b, _ = snapshots
    reference = load_teacher(f"biomedclip:{snap_a}")
    teacher = load_teacher("biomedclip", model_cache=str(snap_b.parent))
    assert teacher.notes["text_config"].startswith("inferred from weights")
    assert teacher.fingerprint == reference.fingerprint
    assert torch.allclose(teacher.encode_texts(TEXTS), reference.encode_texts(TEXTS), atol=1e-5)
    assert torch.allclose(teacher.encode_images(IMAGES), reference.encode_images(IMAGES), atol=1e-5)


def test_biomedclip_found_in_hf_cache_layout(snapshots, tmp_path):
    """--model-cache may also be a HF hub cache (what `huggingface-cli download --cache-dir` makes)."""
    _, snap_b, _ = snapshots
    repo = tmp_path / "hub" / "models--microsoft--BiomedCLIP-PubMedBERT_256-vit_base_patch16_224"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for item in snap_b.iterdir():
        (snapshot / item.name).symlink_to(item)
    teacher = load_teacher("biomedclip", model_cache=str(tmp_path / "hub"))
    assert teacher.notes["source"] == f"local-dir:{snapshot.resolve()}"
    assert _unit_norm(teacher.encode_images(IMAGES))


def test_biomedclip_missing_is_clear_and_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-hf"))
    start = time.monotonic()
    with pytest.raises(TeacherError) as err:
        load_teacher("biomedclip", model_cache=str(tmp_path / "models"))
    message = str(err.value)
    assert "\n" not in message and "looked in" in message and str(tmp_path / "models") in message
    assert "HF_HUB_OFFLINE=set" in message and "huggingface-cli download" in message
    monkeypatch.delenv("HF_HUB_OFFLINE")  # no network here: the hub probe must fail at once too
    with pytest.raises(TeacherError, match="BiomedCLIP weights not found"):
        load_teacher("biomedclip")
    assert time.monotonic() - start < 15
    with pytest.raises(TeacherError, match="not a BiomedCLIP snapshot"):
        load_teacher(f"biomedclip:{tmp_path}")


# ------------------------------------------------------------------ registry
def test_spec_grammar_and_errors(ckpt_registered):
    assert parse_spec("openclip:ViT-B-32:laion2b_s34b_b79k") == ("openclip", "ViT-B-32:laion2b_s34b_b79k", {})
    assert parse_spec("biomedclip?logit_scale=50") == ("biomedclip", "", {"logit_scale": "50"})
    with pytest.raises(TeacherError) as err:
        load_teacher("clip:foo")
    assert all(spec in str(err.value) for spec in VALID_SPECS)
    with pytest.raises(TeacherError, match="needs an argument"):
        load_teacher("ckpt")
    with pytest.raises(TeacherError, match="only one is random:tiny"):
        load_teacher("random:huge")
    with pytest.raises(TeacherError, match="share the name"):
        load_teachers("random:tiny,random:tiny")
    with pytest.raises(TeacherError, match="checkpoint file not found"):
        load_teacher("ckpt:/nonexistent/model.pt")


def test_random_tiny_fast_and_deterministic():
    a, b = load_teachers("random:tiny, random:tiny?name=random-tiny-2&logit_scale=100")
    assert a.name == "random-tiny" and b.name == "random-tiny-2" and b.logit_scale == 100.0
    assert a.notes["test_only"] is True and a.describe()["test_only"] is True
    assert a.image_size == 64 and 64 <= a.embed_dim <= 128 and a.fingerprint == b.fingerprint
    images = torch.rand(8, 1, 64, 64)
    img = a.encode_images(images)
    assert img.shape == (8, a.embed_dim) and _unit_norm(img) and torch.equal(img, b.encode_images(images))
    assert _unit_norm(a.encode_texts(["a", "left pleural effusion"]))
    # on_device: the same rows, left where the teacher runs (the build copies a batch's rows back at once)
    kept = a.encode_images(images, on_device=True)
    assert kept.device == torch.device(a.device) and torch.equal(kept, img)
    texts = ["a", "left pleural effusion"]
    assert torch.equal(a.encode_texts(texts, on_device=True), a.encode_texts(texts))


def test_openclip_teachers_embed_patches_with_the_shared_patch_convolution():
    """teacher_from_model swaps open_clip's conv1 for a PatchConv2d (one matrix product on a GPU) holding the same
    parameters: the fingerprint and the CPU embeddings are the unswapped model's."""
    from cxrdr.common.patch_conv import PatchConv2d
    from cxrdr.teachers.base import weights_fingerprint
    from cxrdr.teachers.random_tiny import build_tiny_clip

    teacher = load_teacher("random:tiny")
    plain, _ = build_tiny_clip()
    assert type(teacher.model.visual.conv1) is PatchConv2d and type(plain.visual.conv1) is torch.nn.Conv2d
    assert teacher.fingerprint == weights_fingerprint(plain.eval())
    pixels = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(teacher.model.encode_image(pixels), plain.encode_image(pixels))


def test_openclip_random_arch_and_weights_file(tmp_path):
    teacher = load_teacher("openclip:ViT-S-32-alt")
    assert teacher.name == "openclip-vit-s-32-alt" and teacher.notes["random_init"]
    assert teacher.image_size == 224 and teacher.context_length == 77
    path = tmp_path / "weights.pt"
    torch.save(teacher.model.state_dict(), path)
    from_file = load_teacher(f"openclip:ViT-S-32-alt:{path}")
    assert from_file.fingerprint == teacher.fingerprint and from_file.notes["pretrained"] == str(path)
    with pytest.raises(TeacherError, match="neither a weights file nor a pretrained tag"):
        load_teacher("openclip:ViT-S-32-alt:nope")
    with pytest.raises(TeacherError, match="unknown open_clip architecture"):
        load_teacher("openclip:ViT-Q-99")


def test_openclip_pretrained_tag_offline_fails_fast():
    start = time.monotonic()
    with pytest.raises(TeacherError, match="could not load open_clip weights"):
        load_teacher("openclip:ViT-B-32:laion2b_s34b_b79k")
    assert time.monotonic() - start < 20


def test_text_minilm_packaged_weights():
    teacher = load_teacher("text:minilm")
    assert teacher.name == "minilm" and teacher.kind == "text" and teacher.image_size is None
    assert teacher.embed_dim == 384 and teacher.context_length == 256 and not teacher.has_images
    emb = teacher.encode_texts(["pleural effusion", "fluid in the pleural space", "fractured femur"])
    assert _unit_norm(emb)
    sims = emb @ emb.T
    assert sims[0, 1] > sims[0, 2] + 0.1
    with pytest.raises(TypeError, match="text-only"):
        teacher.encode_images(torch.rand(1, 1, 32, 32))


def test_minilm_missing_package_message(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(TeacherError, match=r"pip install cxrdr\[offline\]"):
        load_teacher("text:minilm")


def test_text_path_teacher(snapshots, tmp_path):
    _, _, bert = snapshots
    teacher = load_teacher(f"text:{bert}")
    assert teacher.name == "text-tiny-bert" and TEACHER_NAME_RE.match(teacher.name)
    assert teacher.embed_dim == 64 and _unit_norm(teacher.encode_texts(TEXTS))
    with pytest.raises(TeacherError, match="no local text model"):
        load_teacher(f"text:{tmp_path / 'missing'}")


def test_text_teacher_groups_by_length_and_keeps_order(snapshots):
    """Texts go through in groups of similar length (less padding); each row is the text's own
    embedding, as if it had been encoded alone, in the order given."""
    from cxrdr.teachers import text as text_teachers

    _, _, bert = snapshots
    teacher = load_teacher(f"text:{bert}")
    texts = [" ".join(WORDS[: 1 + (7 * i) % len(WORDS)]) for i in range(text_teachers.LENGTH_GROUP + 9)]
    widths = []  # the padded length of each forward
    hook = teacher.model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    together = teacher.encode_texts(texts)
    hook.remove()
    lengths = sorted(len(ids) for ids in teacher.tokenizer(texts)["input_ids"])
    group = text_teachers.LENGTH_GROUP
    assert widths == [lengths[min(start + group, len(texts)) - 1] for start in range(0, len(texts), group)]
    assert widths[0] < widths[-1]  # the short texts are not padded to the longest
    alone = torch.cat([teacher.encode_texts([t]) for t in texts])
    assert together.shape == (len(texts), teacher.embed_dim)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(teacher.encode_texts(texts[::-1]), together.flip(0), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ ckpt
class _StandInStudent(torch.nn.Module):
    """What cxrdr.train.checkpoint.load_checkpoint returns, reduced to the contract the ckpt teacher relies on."""

    def __init__(self):
        super().__init__()
        self.image_size, self.embed_dim, self.context_length = 32, 16, 64
        self.config = SimpleNamespace(variant="A")
        self.image = torch.nn.Linear(32 * 32, 16)
        self.text = torch.nn.Embedding(128, 16)
        self.logit_scale = torch.nn.Parameter(torch.tensor(5.0))  # exp > 100 -> clamped
        self.seen_images = None

    def encode_image(self, images):
        self.seen_images = images
        return torch.nn.functional.normalize(self.image(images.flatten(1)), dim=-1)

    def tokenize(self, texts):
        ids = torch.tensor([[min(ord(c), 127) for c in t[:8].ljust(8)] for t in texts])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def encode_text(self, input_ids, attention_mask):
        return torch.nn.functional.normalize(self.text(input_ids).mean(1), dim=-1)


@pytest.fixture
def ckpt_registered(monkeypatch):
    """``ckpt`` registered programmatically: the entry point needs cxrdr installed from this tree."""
    import cxrdr.teachers as teachers
    from cxrdr.train.ckpt_teacher import load_ckpt_teacher

    monkeypatch.setitem(teachers._REGISTERED, "ckpt", load_ckpt_teacher)


def test_ckpt_teacher_with_stand_in(tmp_path, monkeypatch, ckpt_registered):
    path = tmp_path / "best.pt"
    path.write_bytes(b"stand-in")
    monkeypatch.setattr("cxrdr.train.ckpt_teacher.load_checkpoint", lambda p, device="cpu": _StandInStudent())
    teacher = load_teacher(f"ckpt:{path}")
    assert teacher.name == "ckpt-best" and teacher.logit_scale == 100.0 and teacher.image_size == 32
    assert teacher.mean == (0.0, 0.0, 0.0) and teacher.notes["variant"] == "A"
    images = torch.rand(2, 1, 32, 32)
    assert _unit_norm(teacher.encode_images(images))
    assert torch.equal(teacher.model.seen_images, images)  # raw [0, 1] grayscale, not renormalised
    assert teacher.encode_texts(TEXTS).shape == (3, 16)


def test_ckpt_teacher_real_checkpoint(tmp_path, ckpt_registered):
    from cxrdr.train.checkpoint import save_checkpoint
    from cxrdr.train.models import build_student
    student = build_student({"variant": "A", "image_tower": "vit_micro", "image_size": 32,
                             "text_tower": "tiny", "embed_dim": 32})
    path = tmp_path / "run1.pt"
    save_checkpoint(path, student)
    teacher = load_teacher(f"ckpt:{path}")
    assert teacher.name == "ckpt-run1" and teacher.embed_dim == 32 and teacher.image_size == 32
    img = teacher.encode_images(torch.rand(2, 1, 32, 32))
    assert img.shape == (2, 32) and _unit_norm(img) and _unit_norm(teacher.encode_texts(TEXTS))
    assert teacher.logit_scale <= 100.0


# ------------------------------------------------------------------ plug-ins
def _install_plugin(tmp_path, monkeypatch, kind: str, target: str) -> None:
    """A distribution declaring ``kind`` in the cxrdr.teachers entry-point group, put on sys.path."""
    info = tmp_path / "site" / "cxrdr_plugin_test-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cxrdr-plugin-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[cxrdr.teachers]\n{kind} = {target}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_entry_point_plugin_is_found_and_listed(tmp_path, monkeypatch):
    import cxrdr.teachers as teachers

    _install_plugin(tmp_path, monkeypatch, "ckpttest", "cxrdr.train.ckpt_teacher:load_ckpt_teacher")
    assert "ckpttest" in teachers.known_kinds()
    assert teachers._loader("ckpttest").__module__ == "cxrdr.train.ckpt_teacher"
    with pytest.raises(TeacherError, match="checkpoint file not found"):
        load_teacher("ckpttest:/nonexistent/model.pt")
    with pytest.raises(TeacherError, match="needs an argument"):
        load_teacher("ckpttest")
    with pytest.raises(TeacherError) as err:
        load_teacher("nosuchkind:x")
    message = str(err.value)
    assert "\n" not in message and "ckpttest:ARG" in message and all(spec in message for spec in VALID_SPECS)


def test_register_teacher_programmatic(monkeypatch):
    import cxrdr.teachers as teachers

    monkeypatch.setattr(teachers, "_REGISTERED", {})
    seen = {}

    def loader(arg, spec, device="cpu", model_cache=None, options=None):
        seen.update(arg=arg, options=options)
        return load_teacher("random:tiny")

    teachers.register_teacher("Mine", loader)
    teacher = load_teacher("mine:abc?name=mine-1")
    assert seen == {"arg": "abc", "options": {"name": "mine-1"}} and teacher.name == "mine-1"
    assert "mine" in teachers.known_kinds()


def test_teacher_registry_does_not_import_stage_2():
    import subprocess
    import sys

    code = ("import sys, cxrdr.teachers as t; t.known_kinds(); "
            "print([m for m in sys.modules if m.startswith('cxrdr.train')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_teachers_run_in_bf16_autocast_on_cuda_and_in_fp32_on_cpu():
    """The build's GPU teacher forward autocasts to bf16 (DESIGN: the teacher runs in bf16); on the CPU
    nothing is autocast, so CPU builds stay fp32."""
    import dataclasses
    import warnings

    teacher = load_teacher("random:tiny", device="cpu")
    on_cpu = teacher._autocast()
    assert on_cpu.device == "cpu" and not on_cpu._enabled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA torch disables the context but keeps its dtype
        on_cuda = dataclasses.replace(teacher, device="cuda:0")._autocast()
    assert on_cuda.device == "cuda" and on_cuda.fast_dtype == torch.bfloat16
    assert on_cuda._enabled == torch.cuda.is_available()
