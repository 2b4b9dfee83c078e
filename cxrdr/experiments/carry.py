"""Finished runs carried from one GPU lease to the next: ``python -m cxrdr.experiments.carry pack|unpack``.

A lent GPU comes for 15 minutes a session and its disk is wiped when it goes back (docs/gpu.md), and the efficiency
recipe may not finish inside one lease. What a lease finished, every run trained *and* evaluated, comes back as a
small archive (``pack``): each such run folder's text files (config.yaml, summary.json, metrics.jsonl, its
evaluation's JSON and Markdown), without checkpoints or plots. The next lease unpacks it into its recipe folder before
its chunks (``unpack``, scripts/device_lease.sh). Each carried run folder then holds ``carried.json``, which stands
for the checkpoint the earlier machine kept: the run counts as finished when its saved config is the recipe's
(``runs.run_state``), and its evaluation is reused when its request is the recipe's, never redone (there are no
weights to redo it from; ``runs.evaluate_run`` says so should the request differ). Everything else (shards, the
teacher, runs not carried) the next lease makes again from the same recipe and seeds; so a carried reinforced run
distilled from the earlier lease's teacher, trained alike but not bit for bit (that lease's files keep its figures).

Only run folders (``<experiment>/runs/<arm>/seed-<n>/``) travel, each complete or not at all; an archive member
anywhere else, or not a plain file, is refused by name, and members are read and written as bytes, never extracted
(no link, device or mode from an archive reaches the disk), into a folder beside the run's that is renamed into
place whole. A run this machine holds weights for stays as it is.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path

from cxrdr.common.atomic import replacing

CARRIED = "carried.json"       # in a carried run folder: where it came from
MANIFEST = "carried-runs.json"  # at the archive's root: its runs and label
KEPT_SUFFIXES = (".json", ".jsonl", ".yaml", ".md")
RUN_PATTERN = re.compile(r"([^/]+/runs/[^/]+/seed-\d+)/")  # a run folder, then a path in it


class CarryError(ValueError):
    """An archive that is not one ``pack`` wrote, or a member that would land outside a run folder."""


def run_folders(recipe_out: Path) -> list[Path]:
    """Every run folder of the recipe's experiments, in name order."""
    return sorted(p for p in Path(recipe_out).glob("*/runs/*/seed-*") if p.is_dir())


def is_carried(run_dir: Path) -> bool:
    return (Path(run_dir) / CARRIED).is_file()


def carried_from(run_dir: Path) -> dict | None:
    """What ``carried.json`` says of the run (the label and packing time of the archive that first carried it: the
    lease that trained it), else None."""
    path = Path(run_dir) / CARRIED
    return json.loads(path.read_text()) if path.is_file() else None


def carried_note(records: dict[str, list[dict]]) -> str | None:
    """The results' line on carried runs (``records``: arm -> its runs' records, each with ``carried``), else None."""
    leases: dict[str, list[str]] = {}
    for arm, runs in records.items():
        for record in runs:
            if record.get("carried"):
                leases.setdefault(str(record["carried"].get("from")), []).append(f"{arm} seed {record['seed']}")
    if not leases:
        return None
    where = "; ".join(f"{', '.join(names)} from {lease!r}" for lease, names in leases.items())
    return (f"**Carried runs** (trained and evaluated on an earlier GPU lease, the shards and the teacher made again "
            f"here from the same recipe and seeds): {where}.")


def _evaluations(run_dir: Path) -> list[Path]:
    return [d for d in sorted(run_dir.glob("eval-*"))
            if (d / "eval.json").is_file() and (d / "eval_request.json").is_file()]


def finished_run(run_dir: Path) -> bool:
    """Trained (summary and config written) and evaluated after its last checkpoint, or itself carried."""
    run_dir = Path(run_dir)
    if not all((run_dir / f).is_file() for f in ("summary.json", "config.yaml")):
        return False
    evaluations = _evaluations(run_dir)
    if not evaluations:
        return False
    if is_carried(run_dir):
        return True
    ckpt = run_dir / "last.pt"
    return ckpt.is_file() and all((d / "eval.json").stat().st_mtime >= ckpt.stat().st_mtime for d in evaluations)


def _kept_files(run_dir: Path) -> list[Path]:
    return [f for f in sorted(run_dir.rglob("*")) if f.is_file() and f.suffix in KEPT_SUFFIXES]


def pack_runs(recipe_out: Path, archive: Path, label: str) -> list[str]:
    """Write ``archive`` (tar.gz) with every finished run under ``recipe_out``; returns their relative folders
    (none: no archive is written)."""
    recipe_out = Path(recipe_out)
    runs = [r for r in run_folders(recipe_out) if finished_run(r)]
    names = [r.relative_to(recipe_out).as_posix() for r in runs]
    if not names:
        return names
    manifest = {"label": label, "packed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": names}
    # renamed into place whole: a lease's limit that kills the packing leaves no truncated archive under its name
    with replacing(archive) as partial, tarfile.open(partial, "w:gz") as tar:
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
        for run in runs:
            for path in _kept_files(run):
                tar.add(path, arcname=path.relative_to(recipe_out).as_posix(), recursive=False)
    return names


def _run_of(member: tarfile.TarInfo, runs: set[str]) -> str:
    """The run folder a member belongs to; refuses anything else (links, '..', other folders; an absolute name does
    not match RUN_PATTERN, whose first part has no '/')."""
    match = RUN_PATTERN.match(member.name)
    if not member.isfile() or ".." in Path(member.name).parts or match is None or match.group(1) not in runs:
        raise CarryError(f"{member.name!r} is not a file of a packed run folder {sorted(runs)}")
    return match.group(1)


def unpack_runs(archive: Path, recipe_out: Path) -> list[str]:
    """Put the archive's runs into ``recipe_out``, each marked carried; returns the runs carried in. A run folder
    holding a checkpoint here is left as it is; any other folder of a carried run is replaced whole."""
    recipe_out = Path(recipe_out)
    with tarfile.open(archive, "r:gz") as tar:
        try:
            manifest = json.load(tar.extractfile(MANIFEST))
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise CarryError(f"{archive}: no {MANIFEST} (not written by `carry pack`): {err}") from err
        runs = set(manifest.get("runs") or [])
        odd = [run for run in runs if not RUN_PATTERN.fullmatch(run + "/") or ".." in Path(run).parts]
        if odd:
            raise CarryError(f"{archive}: {odd[0]!r} is not a run folder (<experiment>/runs/<arm>/seed-<n>)")
        members: dict[str, list[tarfile.TarInfo]] = {run: [] for run in runs}
        for member in tar.getmembers():
            if member.name != MANIFEST:
                members[_run_of(member, runs)].append(member)
        carried = []
        for run in sorted(runs):
            target = recipe_out / run
            if (target / "last.pt").is_file():
                continue  # this machine's own run
            # unpacked beside its place and renamed into it whole: a command killed meanwhile leaves the run
            # absent (trained again) or complete, never a summary.json without the evaluations it came with
            staging = target.with_name(f".{target.name}.unpacking")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            for member in members[run]:
                path = staging / Path(member.name).relative_to(run)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(tar.extractfile(member).read())
            if not (staging / CARRIED).is_file():  # a run carried more than once keeps the lease that trained it
                (staging / CARRIED).write_text(json.dumps({"from": manifest.get("label"),
                                                           "packed": manifest.get("packed")}, indent=1))
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staging, target)
            carried.append(run)
    return carried


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cxrdr.experiments.carry", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pack = sub.add_parser("pack", help="archive the finished runs of a recipe folder")
    pack.add_argument("recipe_out", type=Path)
    pack.add_argument("archive", type=Path)
    pack.add_argument("--label", default="", help="where and when these runs ran (kept in each carried.json)")
    unpack = sub.add_parser("unpack", help="carry an archive's runs into a recipe folder")
    unpack.add_argument("archive", type=Path)
    unpack.add_argument("recipe_out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            names = pack_runs(args.recipe_out, args.archive, args.label)
            print(f"[carry] packed {len(names)} finished run(s) into {args.archive}: {', '.join(names)}" if names
                  else f"[carry] no run of {args.recipe_out} is trained and evaluated yet: no {args.archive}")
        else:
            names = unpack_runs(args.archive, args.recipe_out)
            print(f"[carry] carried {len(names)} run(s) into {args.recipe_out}: {', '.join(names) or 'none'}")
    except (CarryError, OSError, tarfile.TarError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
