"""What both stages share: the shard contract, augmentation replay, config IO, errors, locks."""
