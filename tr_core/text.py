"""Token ids to text for events: cached single-token pieces, and incremental decoding of the answer."""

from __future__ import annotations

import weakref

from transformers import PreTrainedTokenizerBase

# Each tokenizer's single-token pieces, shared by every request of the process (at most one string per vocabulary
# entry): a step's tree names its nodes by dictionary lookups, not by decoding the tokens a request sees first.
_PIECES: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[int, str]]" = weakref.WeakKeyDictionary()


def piece_cache(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """The process-wide cache of ``tokenizer``'s single-token pieces (id -> ``tokenizer.decode([id])``, or its
    bytes where that is not whole UTF-8: ``shown_piece``)."""
    try:
        return _PIECES.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: a cache of its own
        return {}


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, SmolLM2's): the character each byte is written as in a token's string,
    back to the byte. Printable Latin-1 bytes stand for themselves; the other 68 are written as the characters from
    U+0100 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in table.values():
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer: PreTrainedTokenizerBase, token: int) -> bytes | None:
    """The bytes a token stands for, from its vocabulary string: byte-level BPE (``"ðŁ"`` -> ``b"\\xf0\\x9f"``) or
    SentencePiece's byte fallback (``"<0xF0>"``); ``None`` where neither applies."""
    name = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(name, str) or not name:
        return None
    if len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
        try:
            return bytes([int(name[3:5], 16)])
        except ValueError:
            return None
    if all(ch in _BYTE_LEVEL for ch in name):
        return bytes(_BYTE_LEVEL[ch] for ch in name)
    return None


def shown_piece(tokenizer: PreTrainedTokenizerBase, token: int, text: str) -> str:
    """A single token's text as the page shows it: its text where that is whole UTF-8, else its bytes, e.g.
    ``"⟨F0 9F⟩"`` for the first half of an emoji (never U+FFFD, the replacement character decoding gives); the
    whole characters around those bytes are kept: ``" ⟨F0 9F⟩"``."""
    if "\ufffd" not in text:
        return text
    raw = token_bytes(tokenizer, token)
    if raw is None:
        return text
    out, i = [], 0
    while i < len(raw):  # whole characters as text, each run of bytes that is not one as ⟨..⟩
        for n in (1, 2, 3, 4):
            try:
                out.append(raw[i:i + n].decode("utf-8"))
                i += n
                break
            except UnicodeDecodeError:
                continue
        else:
            j = i + 1
            while j < len(raw) and not _starts_character(raw[j:]):
                j += 1
            out.append("⟨" + " ".join(f"{b:02X}" for b in raw[i:j]) + "⟩")
            i = j
    return "".join(out)


def _starts_character(raw: bytes) -> bool:
    return any(_decodes(raw[:n]) for n in (1, 2, 3, 4))


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return bool(raw)
    except UnicodeDecodeError:
        return False


class TokenText:
    """Per-request text state. ``pieces`` decodes single tokens (cached per tokenizer, process-wide); ``append``
    returns the text that new tokens add to the answer, holding back an incomplete multi-byte character until the
    tokens that finish it (and leaving it out where the answer ends before them)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._piece_cache = piece_cache(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0  # ids before this are already turned into text
        self._read = 0

    def pieces(self, ids: list[int]) -> list[str]:
        cache = self._piece_cache
        try:
            return [cache[i] for i in ids]
        except KeyError:  # tokens this process has not named yet
            missing = [i for i in set(ids) if i not in cache]
            for i, s in zip(missing, self.tokenizer.batch_decode([[i] for i in missing])):
                cache[i] = shown_piece(self.tokenizer, i, s)  # a token that is not whole UTF-8: its bytes
            return [cache[i] for i in ids]

    def append(self, ids: list[int], final: bool = False) -> str:
        self._ids.extend(ids)
        # Decode a short window (ids already shown + new ones) and return what the new ones add: decoding tokens
        # one by one would lose the spaces and multi-byte characters that depend on their neighbours.
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix:self._read])
        after = decode(self._ids[self._prefix:])
        if after.endswith("\ufffd"):
            if not final:
                return ""
            # the answer ends inside a character (the token budget cut its bytes): what is shown of it is only the
            # replacement character, so it is left out, as a character still to come is while streaming
            after = after.rstrip("\ufffd")
        if len(after) <= len(before) and not final:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]
