"""Quotas, pins and the fleet L2 eviction loop: the controller, its files, its metrics."""
