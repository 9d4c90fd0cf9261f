"""A byte-per-token codec for exact unit tests of text handling (no model files).

Token ids 0..255 are single bytes; 256 is a special ``<eos>`` token that decoding with
``skip_special_tokens`` drops. Decoding an incomplete UTF-8 sequence yields U+FFFD, as
byte-level tokenizers do.
"""

from __future__ import annotations

from collections.abc import Sequence

EOS = 256


def toy_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class ToyCodec:
    vocab_size = 257

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out = []
        buf = bytearray()
        for t in ids:
            if t == EOS:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append("<eos>")
            else:
                buf.append(t)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        return b"<eos>" if token_id == EOS else bytes([token_id])

    def token_text(self, token_id: int) -> str:
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))
