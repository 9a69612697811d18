"""Rank 0's stdout/stderr, line by line, to the driver's log over the driver channel
(wire/frames.py): a tee that never blocks or breaks the training process. The last lines are
also kept, for the job's result when the channel is off or unreachable. Stdlib only."""
from __future__ import annotations

import collections
import io
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, TextIO

from sparkdl.executor.channel_client import ChannelClient


class LineForwarder(io.TextIOBase):
    """Writes through to the original stream and sends each complete line to the driver."""

    def __init__(self, original: TextIO, client: ChannelClient | None, name: str, *, max_line: int = 2000,
                 tail: collections.deque[str] | None = None) -> None:
        super().__init__()
        self._original, self._client, self._name, self._max = original, client, name, max_line
        self._tail = tail if tail is not None else collections.deque(maxlen=0)
        self._buf, self._extra, self._done = "", 0, False  # _extra: chars cut from the current line
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        self._original.write(s)
        with self._lock:
            *lines, rest = s.split("\n")
            for line in lines:
                self._append(line)
                self._emit()
            self._append(rest)
        return len(s)

    def _append(self, text: str) -> None:
        """Keep at most max_line chars: a progress bar without newlines must not grow memory."""
        room = max(0, self._max - len(self._buf))
        self._buf += text[:room]
        self._extra += max(0, len(text) - room)

    def _emit(self) -> None:
        line = self._buf.removesuffix("\r")
        if self._extra:
            line += f" ... [cut: {self._extra} more chars]"
        self._buf, self._extra = "", 0
        if not self._done:
            self._tail.append(line)
            if self._client is not None:
                self._client.send("log", stream=self._name, line=line)

    def flush(self) -> None:
        self._original.flush()

    def close(self) -> None:
        """Send the unfinished last line; the original stream stays open (we do not own it)."""
        with self._lock:
            if (self._buf or self._extra) and not self._done:
                self._emit()
            self._done = True
        self.flush()

    @property
    def closed(self) -> bool:  # type: ignore[override]
        return False  # late writers (a logging handler that kept a reference) still reach the original

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._original, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._original.isatty()

    def fileno(self) -> int:  # faulthandler and subprocess ask for it
        return self._original.fileno()


@contextmanager
def forward_output(client: ChannelClient | None, *, streams: tuple[str, ...] = ("stdout", "stderr"),
                   tail_lines: int = 200) -> Iterator[collections.deque[str]]:
    """Tee sys.stdout/sys.stderr to the driver (when there is a client) for the duration of the
    block, always restoring them; yields the last `tail_lines` lines, complete once the block ends."""
    unknown = set(streams) - {"stdout", "stderr"}
    if unknown:
        raise ValueError(f"forward_output: streams must be 'stdout'/'stderr', got {sorted(unknown)}")
    originals = {name: getattr(sys, name) for name in streams}
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    forwarders = {name: LineForwarder(orig, client, name, tail=tail) for name, orig in originals.items()}
    for name, fw in forwarders.items():
        setattr(sys, name, fw)
    try:
        yield tail
    finally:
        for name, orig in originals.items():
            setattr(sys, name, orig)
        for fw in forwarders.values():
            fw.close()
