"""The GPU worker runtime: resident models, pre-filled prefix caches, TTFT probes.

Pure Python over torch and transformers; nothing here imports Celery, so every piece
can be driven from a test or a benchmark with a model and no broker.
"""

import os

# torch's CPU threads (GNU OpenMP) spin 300,000 times at each barrier before they sleep.
# Beside a neighbour's CPU load that spinning fights the thread it waits for: a 135 M
# model's warm TTFT went 3-3.6x slower with one busy process beside it, against 1.8x with
# a spin of 1,000 (and as fast when idle). Set before torch is first imported; an
# operator's own value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
