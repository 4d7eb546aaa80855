"""The GPU worker runtime: resident models, pre-filled prefix caches, TTFT probes.

Pure Python over torch and transformers; nothing here imports Celery, so every piece
can be driven from a test or a benchmark with a model and no broker.
"""

import os

# torch's CPU threads (GNU OpenMP) spin 300,000 times at each barrier before they sleep.
# Beside a neighbour's CPU load that spinning fights the thread it waits for: a 135 M
# model's warm TTFT went 3-3.6x slower with one busy process beside it, against 1.8x with
# a spin of 1,000. Too short a spin costs a wake-up (tens of microseconds on a VM) at each
# of a step's parallel regions: the real model's bf16 one-row step (about 400 regions) took
# 29.0 ms at 1,000, 19.9 at 2,000, 16.6 at 5,000, 15.2 at 10,000 and 16.1 at 300,000;
# beside a busy process, 35-42 ms at any of them. Set before torch is first imported; an
# operator's own value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
