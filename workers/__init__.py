"""The GPU worker runtime: resident models, pre-filled prefix caches, TTFT probes.

Pure Python over torch and transformers; nothing here imports Celery, so every piece
can be driven from a test or a benchmark with a model and no broker.
"""
