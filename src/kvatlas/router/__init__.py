"""kvatlas router: the KV-aware OpenAI front door in front of a fleet's engines."""
