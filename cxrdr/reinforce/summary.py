"""The text ``reinforce build`` prints about a merged build."""
from __future__ import annotations


def throughput_text(dataset: dict) -> str:
    """The build's samples/s and where its time went, in a line."""
    b = dataset.get("build") or {}
    split = b.get("time_split_seconds", {})
    return (f"throughput {b.get('samples_per_second')} samples/s over {b.get('pipeline_seconds')} s "
            f"({b.get('wall_seconds')} s with setup); time split (s): "
            + ", ".join(f"{k} {v}" for k, v in split.items()))


def summary_text(dataset: dict) -> str:
    lines = [f"{dataset['total_samples']} samples in {len(dataset['shards'])} shards {dataset['counts']}",
             throughput_text(dataset),
             "bytes/sample: " + ", ".join(f"{k} {v:.0f}" for k, v in dataset["bytes_per_sample"].items())]
    if dataset.get("int8_max_abs_error"):
        lines.append(f"int8 max abs error: {dataset['int8_max_abs_error']}; "
                     f"min cosine to float32: {dataset.get('int8_min_cosine')}")
    captioner = dataset.get("captioner")
    if captioner:
        bank = captioner.get("bank") or {}
        lines.append(f"captions: {captioner['caption_source']} per view by {captioner['spec']} (teacher "
                     f"{captioner['teacher']}" + (f", bank of {bank['sentences']} sentences in {bank['dir']}/)"
                                                  if bank else ")"))
    src = dataset["skipped"]["source"]
    bld = dataset["skipped"]["build"]
    lines.append(f"skipped by source: {src.get('count', 0)} {src.get('by_reason', {})}; "
                 f"skipped by build: {bld['count']} {bld['by_reason']}")
    lines += [f"  {e['id']}: {e['reason']}" for e in (src.get("records", []) + bld["records"])[:20]]
    return "\n".join(lines)
