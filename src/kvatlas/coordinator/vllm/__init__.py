"""The device tier: vLLM engines' KV events (`--vllm-kv-events`), their ingest and
`POST /directory/device-lookup`."""
