"""Train with open_clip's own trainer (``open_clip_train``) on cxrdr shards, whatever the webdataset version.

cxrdr shards are WebDataset tars (``.tar.gz`` by default: webdataset's tar expander opens gzip
streams itself) with an image member (``jpg``/``png``) and a text member
(``txt``, the report), which is all ``open_clip_train --dataset-type webdataset`` reads. Since
webdataset 0.2.96 the tar expander ends every shard with a marker dict that has no ``fname``
(``{}`` in 1.x); open_clip_train's own ``group_by_keys_nothrow`` (used for training, not eval)
reads ``filesample["fname"]`` unconditionally and dies with ``KeyError: 'fname'`` on it
(webdataset issue #384, open_clip issue #935). :func:`patch_open_clip_train` wraps that function so
the markers are dropped before grouping. cxrdr keys are unique within a shard folder, so a sample
never straddles two shards and dropping the marker loses nothing; with webdataset < 0.2.96 there
are no markers and the wrapper changes nothing.

    python -m cxrdr.train.openclip_train --dataset-type webdataset --train-data 'shards/shard-{000000..000009}.tar.gz' \\
        --train-num-samples N --model ViT-S-32 ...      # same flags as python -m open_clip_train.main
"""
from __future__ import annotations

import sys


def _without_shard_markers(data):
    """Drop webdataset's end-of-shard markers (dicts without 'fname') from a tar-member stream."""
    for item in data:
        if isinstance(item, dict) and "fname" not in item:
            continue
        yield item


def patch_open_clip_train() -> None:
    """Make ``open_clip_train.data`` tolerate webdataset's end-of-shard markers (idempotent)."""
    import open_clip_train.data as data

    original = data.group_by_keys_nothrow
    if getattr(original, "cxrdr_patched", False):
        return

    def group_by_keys_nothrow(files, *args, **kwargs):
        return original(_without_shard_markers(files), *args, **kwargs)

    group_by_keys_nothrow.cxrdr_patched = True
    group_by_keys_nothrow.original = original
    # tarfile_to_samples_nothrow looks the name up in the module at call time, so this takes effect.
    data.group_by_keys_nothrow = group_by_keys_nothrow


def main(argv: list[str] | None = None) -> None:
    patch_open_clip_train()
    from open_clip_train.main import main as open_clip_main

    open_clip_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
