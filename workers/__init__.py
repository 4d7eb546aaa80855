"""The GPU worker runtime: resident models, pre-filled prefix caches, TTFT probes.

Pure Python over torch and transformers; nothing here imports Celery, so every piece
can be driven from a test or a benchmark with a model and no broker.
"""

import os

# torch's CPU threads (GNU OpenMP) spin 300,000 times at each barrier before they sleep.
# Beside a neighbour's CPU load that spinning fights the thread it waits for: a 135 M
# model's warm TTFT went 3-3.6x slower with one busy process beside it, against 1.8x with
# a spin of 1,000. A spin of 10,000 made an idle Sapphire Rapids' bf16 one-row step 15.2 ms
# against 29.0 at 1,000, but on a Zen 4 a neighbour then slowed warmups past the warm
# factor (the neighbour test failed 3 runs of 3; 3,000: 1 of 2; 1,000 passed 3 of 3), and
# its idle step was no faster (19.2-21.4 ms against 14.4-17.3 at 1,000). A warm verdict
# that holds beside a neighbour comes first. Set before torch is first imported; an
# operator's own value wins (an idle, dedicated node may raise it).
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
