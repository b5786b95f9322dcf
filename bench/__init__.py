"""kvatlas benchmarks: `make bench` runs them all; each module also runs on its own."""
