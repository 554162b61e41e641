"""The requests waiting to be admitted, in order, with their tokens counted as they come and go
(the serving loop's admission reads the count each iteration; a sum over a long queue would
cost what the queue's length does)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from .request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self.num_tokens = 0  # of the requests in it (a waiting request has none computed)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, position: int) -> Request:
        return self._queue[position]

    def append(self, req: Request) -> None:
        self._queue.append(req)
        self.num_tokens += req.num_tokens

    def appendleft(self, req: Request) -> None:
        self._queue.appendleft(req)
        self.num_tokens += req.num_tokens

    def remove(self, req: Request) -> None:
        self._queue.remove(req)
        self.num_tokens -= req.num_tokens

    def take(self, position: int) -> Request:
        """Remove and return the request at `position`."""
        req = self._queue[position]
        if position:
            del self._queue[position]
        else:
            self._queue.popleft()
        self.num_tokens -= req.num_tokens
        return req

    def sort(self, key: Callable) -> None:
        self._queue = deque(sorted(self._queue, key=key))
