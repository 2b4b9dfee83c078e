"""What a partial efficiency report says of itself (``partial.py`` writes it, scripts/headline.py shows it), without
torch: the headline script renders a committed partial report and imports nothing of the training side."""
from __future__ import annotations


def seeds_by_arm(seeds: dict[str, list[int]]) -> str:
    """``plain seeds 10, 11; reinforced seeds none``: each arm's seeds, in the dict's order."""
    return "; ".join(f"{arm} seeds {', '.join(map(str, s)) or 'none'}" for arm, s in seeds.items())


def partial_caveat(left: dict[str, list[int]]) -> str:
    """What the partial figures may be read as: with runs left they rest on fewer seeds than the recipe names;
    with every run finished only the step benchmark's figures (step costs, the timed-only arms) are missing."""
    if left:
        return "Figures over fewer seeds than the recipe names: not the recipe's result."
    return ("Every run's figures are final (all the recipe's seeds); the step costs and the timed-only arms wait "
            "for the step benchmark.")
