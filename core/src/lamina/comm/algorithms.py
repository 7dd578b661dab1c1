"""The all-reduce algorithms of :mod:`lamina.comm.cost`, run on torch.distributed groups.

:class:`AlgorithmGroups` builds, once and on every rank, the process groups the
algorithms need for one group of ranks laid out on hosts (:class:`HostLayout`):

- ``flat``: the group itself (its backend's own all-reduce);
- ``ordered``: the same ranks renumbered in topology order (each host's ranks in a
  row), so the backend's ring crosses each host's uplink once. torch's ``new_group``
  numbers ranks in ascending order, so on gloo this is a ``ProcessGroupGloo`` built over
  a prefix of the job's store with the ranks renumbered; NCCL already orders its rings
  by topology, so there ``ordered`` is ``flat``;
- ``hierarchical`` and ``pipelined``: one group per host (``intra``) and one per local
  index across the hosts (``inter``), built with ``torch.distributed.new_group`` by every
  rank of the job.

:meth:`AlgorithmGroups.all_reduce` sums a 1-D tensor in place over the group with the
named algorithm and returns a work to ``wait()`` on. On gloo the phases of the
hierarchical algorithms wait for each other on the host, so they run on one worker
thread (which keeps every rank's issue order the same); on device backends they are
issued in stream order from the caller. Inside a host, gloo reduce-scatters with an
``all_to_all`` and a local sum and gathers with one broadcast per rank (the faster forms
measured in :mod:`lamina.runtime.primitives`); other backends use their native ops.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lamina.comm.cost import ALGORITHMS, unavailable_algorithms
from lamina.comm.layout import HostLayout
from lamina.trace.recorder import lamina_internal
from lamina.works import AllWorks, SerialWorker, ThreadWork

#: A compressed in-place sum of chunk ``k``'s shard over the inter-host group.
InterSum = Callable[[int, torch.Tensor, dist.ProcessGroup | None], None]
#: Store prefix of the renumbered ring groups.
ORDERED_PREFIX = "lamina/ordered-ring"
_ORDERED_COUNT = [0]


class AlgorithmGroups:
    """The process groups of every algorithm for the ranks of ``layout``, which must be
    the whole job when the hierarchical groups are wanted (``new_group`` is called by
    every rank of the job). ``flat`` is the group's own process group (None: the job's
    default group). Only the groups of the ``needed`` algorithms are built (they are built
    in the same order on every rank). :attr:`unavailable` says, per algorithm that cannot
    run, why."""

    def __init__(
        self,
        layout: HostLayout,
        rank: int,
        *,
        flat: dist.ProcessGroup | None = None,
        pg_backend: str = "gloo",
        whole_job: bool = True,
        needed: Iterable[str] = ALGORITHMS,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.flat = flat
        self.pg_backend = pg_backend
        self.unavailable = unavailable_algorithms(layout, pg_backend, whole_job)
        self.intra: dist.ProcessGroup | None = None
        self.inter: dist.ProcessGroup | None = None
        self.ordered: Any = None
        self.worker: SerialWorker | None = None
        wanted = set(needed)
        if "ordered" in wanted and "ordered" not in self.unavailable:
            self._build_ordered()
        if wanted & {"hierarchical", "pipelined"} and "hierarchical" not in self.unavailable:
            self._build_hierarchy()

    # -- construction ----------------------------------------------------------------------
    def _build_ordered(self) -> None:
        order = self.layout.ring_order()
        if order == self.layout.rank_order():
            return  # the ranks are already in topology order: the flat ring is that ring
        _ORDERED_COUNT[0] += 1
        store = c10d.PrefixStore(
            f"{ORDERED_PREFIX}/{_ORDERED_COUNT[0]}/{'-'.join(map(str, order))}/",
            c10d._get_default_store(),
        )
        timeout = datetime.timedelta(minutes=30)
        if self.rank in order:
            self.ordered = dist.ProcessGroupGloo(store, order.index(self.rank), len(order), timeout)

    def _build_hierarchy(self) -> None:
        for ranks in self.layout.local_groups():
            group = dist.new_group(list(ranks))
            if self.rank in ranks:
                self.intra = group
        for ranks in self.layout.cross_groups():
            group = dist.new_group(list(ranks))
            if self.rank in ranks:
                self.inter = group
        if self.pg_backend == "gloo":
            self.worker = SerialWorker("lamina-collectives")

    def available(self) -> tuple[str, ...]:
        """The algorithms that can run on this group."""
        return tuple(a for a in ALGORITHMS if a not in self.unavailable)

    def close(self) -> None:
        """Stop the worker thread (the groups go with the job)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    # -- running ---------------------------------------------------------------------------
    def all_reduce(
        self,
        algorithm: str,
        tensor: torch.Tensor,
        chunks: int = 1,
        inter_sum: InterSum | None = None,
    ) -> Any:
        """Sum the 1-D contiguous ``tensor`` in place over the group with ``algorithm``
        (``chunks`` pipeline stages for ``pipelined``); returns a work to wait on.
        ``inter_sum(k, shard, group)``, when given, sums chunk ``k``'s shard over the
        inter-host group in place (a compressed sum) instead of its all-reduce."""
        if algorithm in self.unavailable:
            raise ValueError(
                f"algorithm {algorithm!r} cannot run here: {self.unavailable[algorithm]}"
            )
        if algorithm == "flat" or self.layout.size == 1:
            return dist.all_reduce(tensor, group=self.flat, async_op=True)
        if algorithm == "ordered":
            if self.layout.ring_order() == self.layout.rank_order():
                return dist.all_reduce(tensor, group=self.flat, async_op=True)
            if self.ordered is None:
                raise ValueError("the ordered ring was not built: pass it in needed=")
            return self.ordered.allreduce([tensor])
        if algorithm not in ("hierarchical", "pipelined"):
            raise ValueError(f"unknown algorithm {algorithm!r}; choose from {list(ALGORITHMS)}")
        if self.intra is None or self.inter is None:
            raise ValueError(f"the groups of {algorithm!r} were not built: pass it in needed=")
        stages = max(1, chunks) if algorithm == "pipelined" else 1

        def run() -> AllWorks:
            with lamina_internal(), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return self._hierarchical(tensor, stages, inter_sum)

        if self.worker is None:
            return run()

        def run_and_wait() -> None:
            run().wait()

        work: ThreadWork = self.worker.submit(run_and_wait)
        return work

    def _hierarchical(
        self, tensor: torch.Tensor, chunks: int, inter_sum: InterSum | None = None
    ) -> AllWorks:
        """The three phases on ``chunks`` pieces, software-pipelined: at tick ``t`` the
        intra-host all-gather of chunk ``t-2``, the inter-host all-reduce of chunk
        ``t-1`` and the intra-host reduce-scatter of chunk ``t`` are in flight."""
        local = self.layout.per_host
        piece = -(-tensor.numel() // (chunks * local)) * local
        padded = tensor
        if piece * chunks != tensor.numel():  # equal shards: pad a copy, copy back after
            padded = torch.zeros(piece * chunks, dtype=tensor.dtype, device=tensor.device)
            padded[: tensor.numel()].copy_(tensor)
        parts = [padded.narrow(0, k * piece, piece) for k in range(chunks)]
        scattered: list[Callable[[], torch.Tensor] | None] = [None] * chunks
        reduced: list[tuple[Any, torch.Tensor] | None] = [None] * chunks
        gathered: list[Any] = []
        for tick in range(chunks + 2):
            done = tick - 2
            if 0 <= done < chunks:
                work, shard = reduced[done]  # type: ignore[misc]
                work.wait()
                gathered.append(self.gather_in_host(parts[done], shard))
            mid = tick - 1
            if 0 <= mid < chunks:
                shard = scattered[mid]()  # type: ignore[misc]
                if inter_sum is None:
                    work = dist.all_reduce(shard, group=self.inter, async_op=True)
                else:
                    inter_sum(mid, shard, self.inter)
                    work = AllWorks([])
                reduced[mid] = (work, shard)
            if tick < chunks:
                scattered[tick] = self.scatter_in_host(parts[tick])
        result = AllWorks(gathered)
        if padded is not tensor:
            result.wait()
            tensor.copy_(padded[: tensor.numel()])
        return result

    def _local_index(self) -> int:
        return self.layout.hosts[self.layout.host_of(self.rank)].index(self.rank)

    def scatter_in_host(self, part: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start the intra-host reduce-scatter of ``part``; the returned function waits
        and gives this rank's summed slot."""
        local = self.layout.per_host
        size = part.numel() // local
        if self.pg_backend == "gloo":
            received = torch.empty_like(part)
            work = dist.all_to_all_single(received, part, group=self.intra, async_op=True)

            def summed() -> torch.Tensor:
                work.wait()  # type: ignore[union-attr]
                return received.view(local, size).sum(0)

            return summed
        out = torch.empty(size, dtype=part.dtype, device=part.device)
        native = dist.reduce_scatter_tensor(out, part, group=self.intra, async_op=True)

        def native_out() -> torch.Tensor:
            native.wait()  # type: ignore[union-attr]
            return out

        return native_out

    def gather_in_host(self, part: torch.Tensor, shard: torch.Tensor) -> Any:
        """Start the intra-host all-gather of every rank's ``shard`` into ``part``."""
        local = self.layout.per_host
        if self.pg_backend == "gloo":
            slots = part.view(local, -1)
            slots[self._local_index()].copy_(shard)
            members = self.layout.hosts[self.layout.host_of(self.rank)]
            return AllWorks(
                [
                    dist.broadcast(slot, members[k], group=self.intra, async_op=True)
                    for k, slot in enumerate(slots)
                ]
            )
        return dist.all_gather_into_tensor(part, shard, group=self.intra, async_op=True)
