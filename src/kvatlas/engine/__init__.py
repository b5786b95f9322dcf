"""kvatlas.engine: the reference engine (SmolLM2 on the CPU behind an OpenAI API).

One user of ``kvatlas.connector``: it asks its local cache server before prefilling and
stores what it computed. This package imports torch; nothing outside it may.
"""
