"""The bytes behind tokens. A byte-level BPE tokenizer (GPT-2's scheme: Llama 3, Qwen, the demo's) splits a
character of several bytes over tokens, and a model may write bytes that are no UTF-8 at all: decoding each
token alone gives U+FFFD for both. ``byte_pieces`` gives each token's bytes, so a viewer can join a split
character and show broken bytes as they are (``relayrl show``)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_of() -> dict[str, int]:
    """GPT-2's map from the printable character standing for each byte in a token's text back to the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _byte_level(tok) -> bool:
    backend = getattr(tok, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def byte_pieces(tok, ids: list[int]) -> list[bytes] | None:
    """Each token's bytes, or None where the tokenizer is not byte-level. An added token (``<|im_end|>``),
    whose text is not in the byte alphabet, is its text in UTF-8."""
    if tok is None or not _byte_level(tok):
        return None
    byte_of, out = _byte_of(), []
    for piece in tok.convert_ids_to_tokens(list(ids)):
        piece = piece or ""
        out.append(bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode("utf-8"))
    return out
