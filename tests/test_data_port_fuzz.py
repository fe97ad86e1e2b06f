"""The data-port fuzz harness (bench/fuzz_data_port.py) in short: 8 s against a real
`elastic-emb serve` with tokens, as an outsider and as a worker. Any crash, INTERNAL
answer, outsider's change to the rows, worker's Replicate answered OK or RSS growth over
512 MiB is a finding and fails it (docs/operations.md#fuzzing-the-data-port)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np

from elastic_emb._proto import ps_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import fuzz_data_port as fuzz


def test_a_server_with_tokens_survives_outsiders_and_workers_fuzzing_its_data_port(tmp_path):
    with fuzz.fuzzed_server(tmp_path) as target:
        options = fuzz.Options(seconds=8.0, seed=51, hold_seconds=1.0, rows_every=1.0)
        tally = fuzz.run(target, options, log=lambda _: None)
        assert not tally.findings, fuzz.summary(tally, options.seconds)
        # Every family was drawn, in both phases' thousands of frames.
        assert set(tally.connections) >= set(fuzz.FAMILIES) - {"flood"}, tally.connections
        assert sum(tally.frames.values()) > 2000, tally.frames
        statuses = sum(tally.statuses.values(), start=collections.Counter())
        assert statuses[fuzz.INVALID_ARGUMENT] > 100, statuses  # (requests reached handlers)
        # The rows check can fail: an admin's import over the reference rows is seen.
        connection: list = []
        before = fuzz.reference_rows(target, connection)
        zeros = np.zeros(len(fuzz.REFERENCE_KEYS) * fuzz.REFERENCE_DIM, "<f4")
        change = ps_pb2.ImportRowsRequest(
            table=fuzz.REFERENCE_TABLE, keys=fuzz.REFERENCE_KEYS.tobytes(), values=zeros.tobytes()
        )
        target.stub.ImportRows(change, timeout=10)
        assert fuzz.reference_rows(target, connection) != before
        assert target.alive() and target.health().serving
