"""Print, for a `reinforce build --captioner retrieval:...` folder of data with known findings (phantom),
the fraction of retrieved sentences asserting a finding the image has vs the bank's base rate (JSON).

    python scripts/retrieval_grounding.py SHARDS [--split val]
"""
from __future__ import annotations

import argparse
import json

from cxrdr.reinforce.captioners.grounding import shard_grounding

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards")
    parser.add_argument("--split", default=None)
    args = parser.parse_args()
    print(json.dumps(shard_grounding(args.shards, args.split), indent=1))
