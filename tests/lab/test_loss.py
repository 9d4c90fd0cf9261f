"""One lab with 20% loss: the WAN drops about that fraction of packets, in each direction."""

from __future__ import annotations

import pytest

from pdd.lab.measure import datagrams_lost
from tests.lab.support import needs_lab, running_lab

pytestmark = [pytest.mark.lab, needs_lab]

LOSS = 0.2
DATAGRAMS = 2000  # 2000 x 60 B on the wire: far below the 1 MB queue, so only loss drops


@pytest.fixture(scope="module")
def lab():
    with running_lab(
        prefix="pdtloss", subnet="10.77.1.16/28", delay_ms=5, loss=LOSS, queue_bytes=1 << 20
    ) as lab:
        yield lab


@pytest.mark.parametrize(("src", "dst"), [("dc-a", "dc-b"), ("dc-b", "dc-a")])
def test_link_drops_the_configured_fraction(lab, src, dst):
    st = lab.status()
    lost = datagrams_lost(st.dc(src).netns, st.dc(dst).netns, st.dc(dst).wan_ip, DATAGRAMS)
    # Binomial(2000, 0.2): standard deviation 0.009, so +-0.05 is more than 5 sigma.
    assert 0.15 <= lost <= 0.25, lost


def test_status_reports_the_loss(lab):
    st = lab.status()
    assert (st.state, st.loss, st.queue_bytes) == ("up", LOSS, 1 << 20)
