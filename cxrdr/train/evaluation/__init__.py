"""Evaluation of a cxrdr student (or any CLIP-like model): retrieval, linear probe, zero-shot,
localisation, mask faithfulness, embedding geometry and efficiency, with tables and plots.

Metric functions are pure (arrays in, dicts out) and live one family per module; ``runner``
collects embeddings/heatmaps from shards and calls them; ``report`` writes the outputs.
"""
from cxrdr.train.evaluation.retrieval import retrieval_metrics

__all__ = ["retrieval_metrics"]  # `evaluate` lives in .runner (it loads the model code)
