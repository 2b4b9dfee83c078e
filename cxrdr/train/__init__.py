"""cxrdr stage 2: stream reinforced shards into a Patch-IB student; evaluate it.

Load a trained student with `cxrdr.train.checkpoint.load_checkpoint` (kept out of this package's
import so that importing a light submodule does not load the model code).
"""
__version__ = "0.1.0"
