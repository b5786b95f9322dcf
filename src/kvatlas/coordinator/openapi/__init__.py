"""The OpenAPI 3 document of the coordinator API, generated from the msgspec shapes."""
