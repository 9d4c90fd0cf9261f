"""The RelayDecode (RLD) role policy: land P's KV over UCX and decode at once (see policy)."""

from pdd.relay_decode.policy import RelayDecodeRole

__all__ = ["RelayDecodeRole"]
