"""The pure core the coordinator owns: the key directory, membership, placements, quotas,
capacity, blend and the device tier's block table. No I/O, no clocks (the contract in
pyproject.toml holds it)."""
