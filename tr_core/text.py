"""Token ids to text for events: cached single-token pieces, and incremental decoding of the answer."""

from __future__ import annotations

import weakref

from transformers import PreTrainedTokenizerBase

# Each tokenizer's single-token pieces, shared by every request of the process (at most one string per vocabulary
# entry): a step's tree names its nodes by dictionary lookups, not by decoding the tokens a request sees first.
_PIECES: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[int, str]]" = weakref.WeakKeyDictionary()


def piece_cache(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """The process-wide cache of ``tokenizer``'s single-token pieces (id -> ``tokenizer.decode([id])``)."""
    try:
        return _PIECES.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: a cache of its own
        return {}


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
                cache[i] = s
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
