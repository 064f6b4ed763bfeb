"""Host syncs per round, in the engine core and in the draft worker (no Ray: both run as
plain objects in this process, on the demo pair).

Every read of a device value by Python stops the host until the device has caught up
(specdec.host_syncs). A round may read the committed tokens (the floor: they are
streamed), and the draft its drafts; nothing per row or per draft step. Bounds: at most 2
reads per greedy round and 4 per sampled one (T = 1, top-p 0.9, seeded), at batch 1 and
32, with the shipped confidence stop. Each count must also be at least 1, so a counter
that saw nothing fails. The counts are an accelerator's: on a CPU the draft also reads,
after each step, whether the confidence stop has ended every row (free there), which
these runs turn off.
"""

from dataclasses import asdict
from pathlib import Path

import pytest

from bench.syncs import SETTINGS, CountingCore, core_config, run
from deployments.config import ModelSpec
from deployments.messages import (
    DraftItem,
    DraftPush,
    DraftRestart,
    DraftRoundMessage,
    DraftWorkerConfig,
    RoundFeedback,
    decode,
    encode,
)
from deployments.workers.draft_worker import DraftWorker
from specdec.host_syncs import HostSyncCounter

MODELS = Path(__file__).resolve().parents[2] / "models"
BOUND = {"greedy": 2, "sampled": 4}
K = 4


@pytest.mark.parametrize("batch", [1, 32])
def test_engine_core_rounds_read_the_device_a_constant_number_of_times(batch):
    """The core with its draft colocated: drafting and verification in one loop thread."""
    core = CountingCore(core_config(batch))
    cursor = 0
    try:
        for name, params in SETTINGS.items():
            core.rounds.clear()
            cursor = run(core, batch, params, K, cursor)
            full = [c for b, c in core.rounds if b == batch]
            assert len(full) >= 3, name
            worst = max(full, key=lambda c: c.total)
            assert 1 <= worst.total <= BOUND[name], (name, dict(worst.by_site))
    finally:
        core.stop()


class CountingDraftWorker(DraftWorker):
    """The draft worker, counting the host reads of each round message it drafts for."""

    def __init__(self, config: DraftWorkerConfig):
        self.counts: list[HostSyncCounter] = []
        super().__init__(config)
        self.drafter.proposer.stop_early = False  # an accelerator's path (bench.syncs)

    def _draft_now(self, core, msg, route):
        with HostSyncCounter() as counter:
            out = super()._draft_now(core, msg, route)
        self.counts.append(counter)
        return out


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_draft_worker_rounds_read_the_device_a_constant_number_of_times(batch, name):
    """The actor shape's draft: round messages in, drafts (and sampled rows' q, encoded
    for the wire) out, as the compiled-graph transport calls it."""
    spec = ModelSpec(  # eager, as bench.syncs.core_config says why
        model=str(MODELS / "demo-draft"), num_threads=1, execution_mode="eager"
    ).model_dump()
    worker = CountingDraftWorker(
        DraftWorkerConfig(spec, batch, 0, False, transport="compiled_graph", min_confidence=0.5)
    )
    params = asdict(SETTINGS[name])
    prompts = {f"req-{i}": [5 + i, 40 + i, 7, 11 + (i % 5)] for i in range(batch)}
    lengths = {sid: len(p) for sid, p in prompts.items()}
    items = [DraftItem(sid, 0, [], K, DraftRestart(p, [], params)) for sid, p in prompts.items()]
    for no in range(6):
        msg = DraftRoundMessage(no, no == 0, no + 1, items, [], RoundFeedback(None, 0.01, 0))
        push = decode(DraftPush, worker.step(encode(msg)))
        assert len(push.drafts) == batch and all(d.token_ids for d in push.drafts)
        assert all((d.q is None) == (name == "greedy") for d in push.drafts)
        # The round commits the first two drafts and a token of its own.
        items = []
        for d in push.drafts:
            new = [*d.token_ids[:2], 9]
            items.append(DraftItem(d.seq_id, lengths[d.seq_id], new, K))
            lengths[d.seq_id] += len(new)
    assert len(worker.counts) == 6
    worst = max(worker.counts, key=lambda c: c.total)
    assert 1 <= worst.total <= BOUND[name], dict(worst.by_site)
