"""One lab with 20% loss: the WAN drops about that fraction of packets, in each direction."""

from __future__ import annotations

import socket
import time

import pytest

from tests.lab.support import needs_lab, running_lab

pytestmark = [pytest.mark.lab, needs_lab]

LOSS = 0.2
DATAGRAMS = 2000  # 2000 x 60 B on the wire: far below the 1 MB queue, so only loss drops
# Paced, 10 a millisecond: a burst arrives 5 ms later as a burst, and a receiving host whose
# cores are busy (softirqs deferred) drops past its 1000-packet backlog, which is not the link.
BURST, BURST_GAP_S = 10, 0.001
SO_RCVBUFFORCE = 33  # Linux; root may exceed net.core.rmem_max


@pytest.fixture(scope="module")
def lab():
    with running_lab(
        prefix="pdtloss", subnet="10.77.1.16/28", delay_ms=5, loss=LOSS, queue_bytes=1 << 20
    ) as lab:
        yield lab


def _fraction_lost(lab, src: str, dst: str) -> float:
    dst_ip = lab.status().dc(dst).wan_ip
    with lab.enter(dst):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with lab.enter(src):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        rx.bind((dst_ip, 0))
        for seq in range(DATAGRAMS):
            tx.sendto(seq.to_bytes(4, "big") + bytes(28), rx.getsockname())
            if seq % BURST == BURST - 1:
                time.sleep(BURST_GAP_S)
        # Everything that survives lands 5 ms later; 0.5 s of silence means the rest is lost.
        rx.settimeout(0.5)
        got: set[int] = set()
        while True:
            try:
                got.add(int.from_bytes(rx.recv(64)[:4], "big"))
            except TimeoutError:
                break
    assert got <= set(range(DATAGRAMS))
    return 1 - len(got) / DATAGRAMS


@pytest.mark.parametrize(("src", "dst"), [("dc-a", "dc-b"), ("dc-b", "dc-a")])
def test_link_drops_the_configured_fraction(lab, src, dst):
    lost = _fraction_lost(lab, src, dst)
    # Binomial(2000, 0.2): standard deviation 0.009, so +-0.05 is more than 5 sigma.
    assert 0.15 <= lost <= 0.25, lost


def test_status_reports_the_loss(lab):
    st = lab.status()
    assert (st.state, st.loss, st.queue_bytes) == ("up", LOSS, 1 << 20)
