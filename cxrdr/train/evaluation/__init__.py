"""Evaluation of a cxrdr student (or any CLIP-like model): retrieval, linear probe, zero-shot,
localisation, mask faithfulness, embedding geometry and efficiency, with tables and plots.

Metric functions are pure (arrays in, dicts out) and live one family per module; ``runner``
collects embeddings/heatmaps from shards and calls them; ``report`` writes the outputs.
"""
from cxrdr.train.evaluation.retrieval import retrieval_metrics

__all__ = ["retrieval_metrics", "evaluate"]


def evaluate(*args, **kwargs):
    """See :func:`cxrdr.train.evaluation.runner.evaluate` (imported lazily: it pulls in torch models)."""
    from cxrdr.train.evaluation.runner import evaluate as _evaluate

    return _evaluate(*args, **kwargs)
