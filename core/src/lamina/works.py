"""Several asynchronous collective works waited for as one (shared by ``comm`` and
``memory``, which may not import each other)."""

from __future__ import annotations

from typing import Any

import torch


class AllWorks:
    """Waits for every work it holds (``None`` entries are skipped)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self) -> bool:
        """Wait for every work."""
        for work in self.works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """A future that completes when every work has (for the trace recorder)."""
        return torch.futures.collect_all([w.get_future() for w in self.works])
