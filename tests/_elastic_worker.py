"""An elastic PS worker for the tests: pushes a constant gradient to one key, step by step.

Usage: python _elastic_worker.py COORDINATOR MODE WORKER STEPS GRADIENT [STALENESS]
Table "e": SGD(1.0), zeros, dim 1. Each step pulls key 0 and pushes GRADIENT
to it; "pushed N" is printed once step N's push is acknowledged. STEPS 0: run
until killed. Leaves cleanly (ee.shutdown) after the last step.
"""

import sys

import numpy as np

import elastic_emb as ee

coordinator, mode, worker, steps, gradient = sys.argv[1:6]
staleness = int(sys.argv[6]) if len(sys.argv) > 6 else None
ee.init(coordinator=coordinator, mode=mode, worker_index=int(worker), num_workers=1,
        staleness=staleness)  # fmt: skip
table = ee.Table(1, optimizer=ee.optimizers.SGD(1.0), initializer="zeros", name="e")
keys = np.array([0], np.int64)
step = 0
while int(steps) == 0 or step < int(steps):
    table.pull(keys)
    table.push(keys, np.full((1, 1), float(gradient), np.float32))
    step += 1
    print(f"pushed {step}", flush=True)
ee.shutdown()
