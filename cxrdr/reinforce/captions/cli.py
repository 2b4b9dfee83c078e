"""``reinforce captions``: print the triples and synthetic captions of the first studies of a source."""
from __future__ import annotations

import itertools
import json
from typing import Annotated, Optional

import typer


def cli_captions(
    source: Annotated[str, typer.Option("--source", "-s", help="Source spec: phantom[:N], mimic:PATH.jsonl, "
                                        "iu-xray:DIR, nih-bbox:PATH.jsonl, jsonl:PATH or csv:PATH.")] = "phantom:8",
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="Number of studies to print.")] = 5,
    n_captions: Annotated[int, typer.Option("--n-captions", "-S", min=1,
                                            help="Captions per study (S).")] = 5,
    seed: Annotated[int, typer.Option("--seed", help="Caption seed (also the phantom seed).")] = 0,
    caption_sources: Annotated[str, typer.Option("--caption-sources",
                                                 help="Comma-separated caption sources: rdf,report.")] = "rdf,report",
    image_root: Annotated[Optional[str], typer.Option("--image-root", help="Folder that image paths are "
                                                      "relative to (mimic, jsonl/csv; iu-xray: Open-i PNGs).")] = None,
    scene_graphs: Annotated[Optional[str], typer.Option("--scene-graphs",
                                                        help="mimic: Chest ImaGenome scene graphs (JSON file "
                                                             "or folder).")] = None,
    option: Annotated[Optional[list[str]], typer.Option("--option", "-o", help="Other source option KEY=VALUE, "
                                                        "repeatable (col_report=notes, labels_format=list, "
                                                        "min_report_chars=30, frontal_only=true, ...).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per study instead of text.")] = False,
) -> None:
    """Print, per study, its id, triples and synthetic captions (RDF templates + report sentences).

    Text only: images are never decoded, so text-only sources (iu-xray without --image-root)
    work. Skipped records of the studies read are summarised on stderr.
    """
    from cxrdr.reinforce.captions import make_captions
    from cxrdr.common.errors import UserError
    from cxrdr.reinforce.sources import open_source, parse_source_options

    sources = tuple(s.strip() for s in caption_sources.split(",") if s.strip())
    try:
        options = parse_source_options(option)
        options.update({k: v for k, v in (("image_root", image_root), ("scene_graphs", scene_graphs))
                        if v is not None})
        if source.strip().lower().startswith("phantom"):
            options.setdefault("seed", seed)
        src = open_source(source, **options)
        records = list(itertools.islice(iter(src), limit))
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    for rec in records:
        try:
            captions = make_captions(rec, n=n_captions, seed=seed, sources=sources)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        if as_json:
            typer.echo(json.dumps({"id": rec.id, "split": rec.split, "triples": [list(t) for t in rec.triples],
                                   "labels": rec.labels, "captions": [c.to_json() for c in captions]}))
            continue
        typer.echo(f"== {rec.id} ({rec.split}) ==")
        positives = [name for name, v in (rec.labels or {}).items() if v == 1]
        typer.echo(f"labels: {', '.join(positives) or '-'}")
        typer.echo("triples:" if rec.triples else "triples: (none)")
        for s, p, o in rec.triples:
            typer.echo(f"  ({s}, {p}, {o})")
        typer.echo("captions:")
        for cap in captions:
            typer.echo(f"  [{cap.source}] {cap.text}")
    if len(getattr(src, "skipped", [])):
        typer.echo(src.skipped.summary(limit=10), err=True)
