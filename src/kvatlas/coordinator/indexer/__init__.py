"""The Mooncake KV Indexer RFC API, answered as NVIDIA Dynamo's standalone indexer does:
its routes and the workers registered through it."""
