"""The Prefill (P) role policy: stage the prompt KV, send it to RLD and MD (see policy)."""

from pdd.prefill.policy import PrefillRole

__all__ = ["PrefillRole"]
