"""The MainDecode (MD) role policy: the Decode-side RadixCache, WAN landing, decode (see policy)."""

from pdd.main_decode.policy import MainDecodeRole

__all__ = ["MainDecodeRole"]
