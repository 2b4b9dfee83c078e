"""cxrdr stage 2: stream reinforced shards into a Patch-IB student; evaluation and experiments."""
__version__ = "0.1.0"


def load_checkpoint(path, device="cpu"):
    """Load a `train run` checkpoint as a model that embeds images and texts (eval mode)."""
    # Imported on call: importing the package (e.g. for `train --help`) must not load torch/timm/transformers.
    from cxrdr.train.checkpoint import load_checkpoint as _load

    return _load(path, device=device)
