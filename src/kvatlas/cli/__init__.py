"""Command-line entry points: argument parsing only; each calls a composition root."""
