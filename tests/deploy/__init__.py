"""deploy/ checked against the real CLI: tests/deploy/manifests.py reads it."""
