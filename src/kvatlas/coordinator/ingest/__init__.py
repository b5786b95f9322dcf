"""How events and membership requests reach the fleet state: directly, or through the
Kafka topic (its consumer, the replicated membership and their wiring)."""
