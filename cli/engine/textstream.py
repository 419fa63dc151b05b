"""Turn token pieces (bytes) into printable text: UTF-8 safe, with stop strings held back.

A token's bytes may end in the middle of a UTF-8 character (Chinese, emoji), and a stop string may
arrive split over several tokens ("\\n" then "\\n"). Text is released only when it can no longer
become part of a stop string, so a stop string is never printed, and the earliest match in the text
wins whatever order the stop strings were given in.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""
        self.matched_stop: str | None = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show."""
        if self.matched_stop is not None:
            return ""
        self._held += self._decoder.decode(piece)
        return self._release()

    def finish(self) -> str:
        """End of generation: flush an incomplete character and whatever was held back."""
        if self.matched_stop is not None:
            return ""
        self._held += self._decoder.decode(b"", final=True)
        released = self._release()
        if self.matched_stop is not None:
            return released
        rest, self._held = self._held, ""
        return released + rest

    def _release(self) -> str:
        held = self._held
        # The earliest match; on a tie the longer stop string, which explains more of the text.
        matches = [(held.find(stop), -len(stop), stop) for stop in self._stop if stop in held]
        if matches:
            index, _, self.matched_stop = min(matches)
            self._held = ""
            return held[:index]
        cut = len(held) - self._longest_partial_suffix()
        self._held = held[cut:]
        return held[:cut]

    def _longest_partial_suffix(self) -> int:
        """Length of the longest end of the held text that some stop string starts with."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:size]):
                    longest = size
                    break
        return longest
