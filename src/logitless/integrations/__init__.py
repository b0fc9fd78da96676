"""Integrations with model libraries: call their backbone, then logitless' head.

Nothing here patches model code. Each integration is imported on its own
(``from logitless.integrations import hf``) and imports nothing heavy at import time.
"""
