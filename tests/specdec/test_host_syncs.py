"""The host-read counter (specdec.host_syncs) sees every way Python reads a tensor value,
names the line, and ignores work that stays on the device. On a meta tensor a move to the
host counts as one (its source is not the host)."""

import contextlib

import torch

from specdec.host_syncs import HostSyncCounter


def test_reads_are_counted_by_kind_and_line():
    x = torch.arange(6.0)
    with HostSyncCounter() as counter:
        y = (x * 2 + 1).softmax(-1)  # device work: no read
        x.sum().item()
        x.tolist()
        if (x > 3).any():
            pass
        int(x[1])
        float(x[2])
        x.numpy()
        x.to("cpu")  # already on the host: no copy
    assert y.shape == (6,)
    assert dict(counter.by_kind) == {
        "item": 1,
        "tolist": 1,
        "bool": 1,
        "int": 1,
        "float": 1,
        "numpy": 1,
    }
    assert counter.total == 6
    here = "tests/specdec/test_host_syncs.py:"
    assert all(site.startswith(here) for site in counter.by_site), counter.by_site
    assert len(counter.by_site) == 6


def test_a_move_from_a_device_counts():
    x = torch.empty(4, device="meta")
    with HostSyncCounter() as counter:
        # meta tensors have no data to copy; the call is what counts
        with contextlib.suppress(NotImplementedError, RuntimeError):
            x.to("cpu")
        x.to("meta")
    assert dict(counter.by_kind) == {"to_host": 1}
