"""TCP transport for the WAN (P -> MainDecode): parallel streams, pipelined chunks, optional
mutual TLS, live link estimates.

Owns one `Listener` (when built with receiver hooks) and one `PeerLink` per destination,
created on first send and replaced when it breaks. Threads: the reaper, the listener and one
per accepted stream (receiving), the plan's streams per peer link (sending: `wan_streams`,
more on a path whose bandwidth-delay product needs them). `close()` fails what
is open, shuts every socket down and joins every thread.
"""

from __future__ import annotations

import logging
import threading
import time

from pdd.transfer.api import LinkEstimate, PeerAddress
from pdd.transfer.base import BaseTransport
from pdd.transfer.estimate import idle_restarts_window, plan_flow, socket_inflight_limit
from pdd.transfer.ledger import OutRecord
from pdd.transfer.tcp_io import client_tls, server_tls
from pdd.transfer.tcp_recv import Listener
from pdd.transfer.tcp_send import PeerLink
from pdd.transfer.ucx_auth import kv_token
from pdd.transfer.wire import CancelReason

log = logging.getLogger(__name__)


class TcpTransport(BaseTransport):
    kind = "tcp"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token = kv_token()  # fleet credential: senders prove it, receivers require it
        self.refused = 0  # connections closed: no proof, or the receiver was full
        self.server_tls = server_tls(self.config)
        self.client_tls = client_tls(self.config)
        self.socket_bytes = socket_inflight_limit()  # what one socket can keep in flight here
        self._links: dict[str, PeerLink] = {}
        self._dead: list[PeerLink] = []
        self._links_lock = threading.Lock()
        self._listener: Listener | None = None
        self._warned_idle = False

    @property
    def address(self) -> PeerAddress:
        if self._listener is None:
            return PeerAddress(host=self.config.listen_host, port=0)
        return PeerAddress(host=self._listener.host, port=self._listener.port, probes=True)

    def _start_io(self) -> None:
        if self.inbound is not None:
            self._listener = Listener(self)
            self._listener.start()

    def _close_io(self) -> None:
        with self._links_lock:
            links = list(self._links.values()) + self._dead
            self._links, self._dead = {}, []
        for link in links:
            link.close()
        if self._listener is not None:
            self._listener.close()

    def _io_threads(self) -> list[threading.Thread]:
        with self._links_lock:
            links = list(self._links.values()) + self._dead
        threads = [t for link in links for t in link.threads()]
        if self._listener is not None:
            threads += self._listener.threads()
        return threads

    def _link(self, peer: PeerAddress) -> PeerLink:
        """The live link to `peer` (endpoints are cached per peer; a broken one is replaced)."""
        key = peer.key()
        with self._links_lock:
            link = self._links.get(key)
            if link is not None and link.broken is None:
                return link
            old, link = link, PeerLink(self, peer)
            if old is not None:  # keep what we learned about the path
                self._dead.append(old)
                link.estimator = old.estimator
            self._links[key] = link
        link.start()
        return link

    def _retire_moved(self, peer: PeerAddress) -> None:
        """A live link under ``peer.key()`` to another host:port (a worker id now served from
        another address) is failed now, before this send opens: its transfers were headed to
        the old address, and nothing new may go there."""
        with self._links_lock:
            old = self._links.get(peer.key())
            if old is None or (old.peer.host, old.peer.port) == (peer.host, peer.port):
                return
            del self._links[peer.key()]
            self._dead.append(old)
        old.fail(f"receiver {peer.key()} moved to {peer.host}:{peer.port}")

    def _chunk_bytes(self, peer: PeerAddress) -> int:
        with self._links_lock:
            link = self._links.get(peer.key())
        if link is None:
            return plan_flow(None, self.config, self.socket_bytes).chunk_bytes
        return link.replan(time.monotonic()).chunk_bytes

    def _submit(self, peer: PeerAddress, record: OutRecord) -> None:
        self._link(peer).submit(record)

    def _send_cancel(self, peer_key: str, transfer_id: int, reason: CancelReason) -> None:
        with self._links_lock:
            link = self._links.get(peer_key)
        if link is not None and link.broken is None:
            link.cancel(transfer_id, reason)

    def _tick(self, now: float) -> None:
        super()._tick(now)
        self._join_dead_links()

    def _join_dead_links(self) -> None:
        with self._links_lock:
            done = [link for link in self._dead if not any(t.is_alive() for t in link.threads())]
            self._dead = [link for link in self._dead if link not in done]
        for link in done:
            link.close()

    def warm(self, peer: PeerAddress) -> bool:
        if not self._started or self._closed:
            return False
        if not self._warned_idle and idle_restarts_window():
            self._warned_idle = True
            log.warning("net.ipv4.tcp_slow_start_after_idle is 1: a KV link that sat idle "
                        "longer than its RTO ramps up from 10 segments again, warm-up or not; "
                        "set it to 0 on hosts that send KV over a WAN")  # fmt: skip
        self._retire_moved(peer)
        return self._link(peer).warm(self.config.warmup_bytes)

    def warming(self, peer: PeerAddress) -> bool:
        with self._links_lock:
            link = self._links.get(peer.key())
        return link is not None and link.warming

    def link_estimate(self, peer: PeerAddress) -> LinkEstimate | None:
        with self._links_lock:
            link = self._links.get(peer.key())
        return link.estimator.estimate() if link is not None else None

    def link_estimates(self) -> dict[str, LinkEstimate]:
        """Every peer's estimate, for export (router snapshot, metrics, bench JSON)."""
        with self._links_lock:
            links = dict(self._links)
        out = {}
        for key, link in links.items():
            est = link.estimator.estimate()
            if est is not None:
                out[key] = est
        return out
