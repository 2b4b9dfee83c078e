"""cxrdr stage 1: dataset reinforcement (sources, captions, augmentations, teachers, shards)."""
__version__ = "0.1.0"
