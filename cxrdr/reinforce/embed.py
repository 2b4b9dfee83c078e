"""Teacher forwards of a batch of prepared records: every teacher's img, syn and txt rows."""
from __future__ import annotations

import torch


def _forward(fn, inputs, chunk: int = 512):
    outs = [fn(inputs[i:i + chunk]) for i in range(0, len(inputs), chunk)]
    return torch.cat(outs).numpy() if outs else None


def embed_batch(teachers, samples: list[dict], images: bool, crops: dict | None = None) -> list[dict]:
    """Teacher forwards for a batch: per sample {teacher: {'img': (K,D), 'syn': (S,D), 'txt': (D,)}}.

    ``crops``: the samples' crops already concatenated per teacher size ({size: (B*K, 1, S, S)},
    from :func:`collate_prepared`); default: each sample's own ``sample["crops"][size]`` (K, 1, S, S).
    """
    out = [{} for _ in samples]
    if not samples:
        return out
    n_syn = len(samples[0]["texts"]) - 1
    texts = [s["texts"][0] for s in samples] + [t for s in samples for t in s["texts"][1:]]
    for teacher in teachers:
        if images and teacher.has_images:
            if crops is not None:
                x = crops[teacher.image_size]
            else:
                x = torch.cat([s["crops"][teacher.image_size] for s in samples])
            img = _forward(teacher.encode_images, x)
            img = img.reshape(len(samples), x.shape[0] // len(samples), -1)
        txt_all = _forward(teacher.encode_texts, texts)
        txt, syn = txt_all[:len(samples)], txt_all[len(samples):].reshape(len(samples), n_syn, -1)
        for i in range(len(samples)):
            parts = {"syn": syn[i], "txt": txt[i]}
            if images and teacher.has_images:
                parts["img"] = img[i]
            out[i][teacher.name] = parts
    return out
