"""Hidden-state storage and transport: the sample wire format, the offline shard store, Mooncake streaming."""
