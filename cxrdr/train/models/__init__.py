"""The Patch-IB student (ladder A-E): config, towers, heads, the model itself, and its factory."""
from cxrdr.train.models.config import StudentConfig, available_configs
from cxrdr.train.models.factory import build_image_tower, build_student, create_student
from cxrdr.train.models.heads import LocalAlign, MaskHead, MaskHeadTopK, Projection
from cxrdr.train.models.registry import register_tower
from cxrdr.train.models.student import PatchIBStudent, StudentOutput
from cxrdr.train.models.text_towers import TextTokenizer, build_tokenizer
from cxrdr.train.models.timm_adapter import TimmImageTower  # registers cxrdr_image_tower with timm
from cxrdr.train.models.token_dropping import TokenDroppingViT
from cxrdr.train.models import openclip_paths

openclip_paths.install()  # exports that moved load: their tower paths resolve against their folder

__all__ = ["StudentConfig", "available_configs", "build_image_tower", "build_student", "create_student",
           "PatchIBStudent", "StudentOutput", "MaskHead", "MaskHeadTopK", "LocalAlign", "Projection",
           "TokenDroppingViT", "TextTokenizer", "TimmImageTower", "build_tokenizer", "register_tower"]
