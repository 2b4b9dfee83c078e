"""Studies that build shards (stage 1) and train students on them (stage 2): the only place both meet."""
