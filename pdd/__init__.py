"""pdd: Prefill - RelayDecode - MainDecode serving across two datacenters."""

__version__ = "0.1.0"
