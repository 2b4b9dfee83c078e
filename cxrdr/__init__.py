"""cxrdr: dataset reinforcement (stage 1) and a Patch-IB student trained from it (stage 2)."""
