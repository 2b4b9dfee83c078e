"""The Patch-IB student (ladder A-E): config, towers, heads, and the model itself."""
from cxrdr.train.models.config import StudentConfig, available_configs
from cxrdr.train.models.heads import LocalAlign, MaskHead, MaskHeadTopK, Projection
from cxrdr.train.models.student import PatchIBStudent, StudentOutput, build_student
from cxrdr.train.models.text_towers import TextTokenizer, build_tokenizer
from cxrdr.train.models.token_dropping import TokenDroppingViT

__all__ = ["StudentConfig", "available_configs", "build_student", "PatchIBStudent", "StudentOutput",
           "MaskHead", "MaskHeadTopK", "LocalAlign", "Projection", "TokenDroppingViT", "TextTokenizer",
           "build_tokenizer"]
