"""Fleet evaluation: `kvatlas bench fleet` (workload, fleet runner, churn, report)."""
