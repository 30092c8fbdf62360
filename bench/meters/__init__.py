"""One part measured alone: the control plane's Redis and instructions per image (`plane*`, `instructions*`,
`round_trips/`, `redis_counts`), the GPU worker against the device (`feed`), post-processing's worst cases
(`nms`), the decode floor (`floor`) and the device profile's (`bound`); a value's walk through the product's files
(`walks`). Imports only the stack wing."""
