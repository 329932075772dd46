"""Processes that calibrate together (``torchrun … qtool calibrate``): the process group and the one way ranks talk.

:func:`from_environment` joins the process group that ``torchrun`` (or any launcher setting ``WORLD_SIZE``,
``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) describes; without one it returns a :class:`Group` of one process
whose collectives hand back the caller's own value, so calibration has one code path.

Every exchange is a *step*: all ranks call the same collectives in the same order. A step first all-gathers a
status (ok, or a failure's exit code and message) and only then moves data, so a rank that fails anywhere
(bad data in its shard, a recipe its model does not fit, an out-of-memory error) tells the others at their next
step (:meth:`Group.abort`), and every rank stops: the failing rank with its own one-line error, the others
quietly (:class:`PeerFailed`) with the same exit code. A rank that vanishes (killed, crashed) or stops answering
for longer than the timeout (``QTOOL_DIST_TIMEOUT`` seconds, default 600) ends the others' collectives with
:class:`PeerLost` (exit code 4).

All of qtool's traffic goes through a gloo group on host memory, even where the default group is NCCL:
statistics are combined in a fixed order on rank 0 (gather, then fold in rank order), so reruns give the same
bytes, which an all-reduce does not promise.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from .errors import QtoolError, UsageError, cut

__all__ = ["Group", "PeerFailed", "PeerLost", "from_environment", "shard_bounds", "assign", "ENV_TIMEOUT",
           "DEFAULT_TIMEOUT_S"]

ENV_TIMEOUT = "QTOOL_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
# after calibration, the other ranks wait while rank 0 writes (an export can take an hour on a large model)
FINISH_TIMEOUT_S = 24 * 3600.0


class PeerFailed(QtoolError):
    """Another rank failed; this rank stops with the same exit code and prints nothing (the failing rank already
    said why)."""

    quiet = True

    def __init__(self, rank: int, exit_code: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.exit_code = exit_code


class PeerLost(QtoolError):
    """Another rank stopped answering (killed, crashed, out of memory, or slower than the timeout)."""

    exit_code = 4


def _timeout_s() -> float:
    text = os.environ.get(ENV_TIMEOUT, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 10**7:
        raise UsageError(f"{ENV_TIMEOUT}={text!r}: give the seconds a rank waits for the others, above 0 and below "
                         "10000000 (about 115 days; e.g. 600)")
    return value


def shard_bounds(n: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Rank ``rank``'s contiguous slice ``[start, stop)`` of ``n`` items: the slices of ranks 0, 1, ... follow each
    other, so folding per-rank statistics in rank order sees the items in their global order."""
    return n * rank // world_size, n * (rank + 1) // world_size


def assign(sizes: Sequence[int], world_size: int) -> List[int]:
    """The owner rank of each item: largest first, each to the least loaded rank (ties to the lower rank), so
    every rank computes the same assignment from the same sizes."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += int(sizes[i])
    return owner


_OK = "ok"


class Group:
    """A set of ranks calibrating together. The base class is the one-process world: ``rank`` 0 of 1, and each
    collective returns the caller's own value."""

    rank = 0
    world_size = 1
    backend: Optional[str] = None
    timeout_s = DEFAULT_TIMEOUT_S

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_gather(self, value: Any) -> List[Any]:
        """One step: every rank's ``value``, in rank order, on every rank."""
        return [value]

    def gather(self, value: Any) -> Optional[List[Any]]:
        """One step: every rank's ``value`` in rank order on rank 0; None elsewhere."""
        return [value]

    def windows(self, items: Sequence[Any], per_rank: int) -> Iterator[List[Any]]:
        """``items`` in order, ``per_rank`` per rank at a time (all at once in one process): work split over the
        ranks a window at a time, so a window's results are what is in flight at once."""
        size = len(items) if not self.distributed else per_rank * self.world_size
        for i in range(0, len(items), max(size, 1)):
            yield list(items[i:i + size])

    def owned(self, owners: Sequence[int]) -> List[int]:
        """Indices of the items this rank owns (``owners`` from :func:`assign`)."""
        return [i for i, r in enumerate(owners) if r == self.rank]

    def abort(self, error: BaseException) -> BaseException:
        """Tell the others this rank failed (at their next step); returns the error this rank should raise: its
        own (marked with ``dist_rank``), or a quiet :class:`PeerFailed` where a lower rank failed at the same
        step and speaks for all. In one process: ``error`` itself."""
        return error

    def broadcast(self, value: Any) -> Any:
        """One step: rank 0's ``value`` on every rank (the others pass anything; only rank 0's is sent)."""
        return value

    def calibrated(self, last: bool = True) -> None:
        """A step every rank takes when its calibration is done, before rank 0 writes. ``last``: the others then
        wait for rank 0 at :meth:`finish` (a failure while rank 0 writes reaches them there); not ``last``: they
        meet rank 0 again at an ordinary step (a size-budget search reads what it wrote), where it reaches them."""

    def finish(self) -> None:
        """Last step: ranks other than 0 wait here while rank 0 writes, then all leave with rank 0's status."""

    def close(self) -> None:
        pass


def _describe(error: BaseException) -> Tuple[int, str]:
    if isinstance(error, QtoolError):
        return error.exit_code, str(error)
    if isinstance(error, KeyboardInterrupt):
        return 130, "interrupted"
    if isinstance(error, OSError):  # a full disk, a read-only directory: the environment, as in one process
        where = f"{error.filename}: " if error.filename else ""
        return 2, f"{where}{error.strerror or error}"
    first = str(error).splitlines()[0] if str(error) else ""
    return 3, f"internal error: {type(error).__name__}: {first}"


class _TorchGroup(Group):
    def __init__(self, rank: int, world_size: int, backend: str, timeout_s: float, own_default: bool):
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        self._own_default = own_default
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._finish_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FINISH_TIMEOUT_S))
        self._failed = False
        self._finishing = False

    def _collective(self, fn: Callable[[], Any], what: str, outcome: str = "nothing was written"):
        try:
            return fn()
        except (RuntimeError, ConnectionError, OSError) as e:  # gloo: a closed connection or a timeout
            self._failed = True
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            lost = PeerLost(f"lost contact with the other ranks while {what} (a rank was killed, ran out of "
                            f"memory, or was slower than {ENV_TIMEOUT}={self.timeout_s:g} s): {cut(first, 160)}; "
                            f"{outcome}")
            lost.dist_rank = self.rank  # every surviving rank says it: it cannot know which of them speaks
            lost.outcome = outcome  # (the CLI's line says what a --sequential run kept in its place)
            raise lost from None

    def _status(self, status, group=None, what: str = "exchanging statistics",
                outcome: str = "nothing was written") -> None:
        out: List[Any] = [None] * self.world_size
        self._collective(lambda: self._dist.all_gather_object(out, status, group=group or self._group), what,
                         outcome)
        for r, s in enumerate(out):
            if s != _OK and r != self.rank:
                self._failed = True
                raise PeerFailed(r, s[0], s[1])

    def all_gather(self, value: Any) -> List[Any]:
        self._status(_OK)
        out: List[Any] = [None] * self.world_size
        self._collective(lambda: self._dist.all_gather_object(out, value, group=self._group),
                         "exchanging statistics")
        return out

    def gather(self, value: Any) -> Optional[List[Any]]:
        self._status(_OK)
        out: Optional[List[Any]] = [None] * self.world_size if self.is_root else None
        self._collective(lambda: self._dist.gather_object(value, out, dst=self._global(0), group=self._group),
                         "gathering statistics")
        return out

    def _global(self, rank: int) -> int:
        return self._dist.get_global_rank(self._group, rank)

    def abort(self, error: BaseException) -> BaseException:
        if self._failed or isinstance(error, (PeerFailed, PeerLost)):
            return error
        self._failed = True
        status = _describe(error)
        out: List[Any] = [None] * self.world_size
        group = self._finish_group if self._finishing else self._group
        try:  # the others are at (or will reach) a status exchange: this is what they receive there
            self._collective(lambda: self._dist.all_gather_object(out, status, group=group), "reporting a failure")
        except PeerLost:
            out = [status if r == self.rank else _OK for r in range(self.world_size)]
        lowest = next(r for r, s in enumerate(out) if s != _OK)
        if lowest != self.rank:
            return PeerFailed(lowest, out[lowest][0], out[lowest][1])
        try:
            error.dist_rank = self.rank
        except AttributeError:  # pragma: no cover - exceptions with __slots__
            pass
        return error

    def broadcast(self, value: Any) -> Any:
        self._status(_OK)
        box = [value if self.is_root else None]
        self._collective(lambda: self._dist.broadcast_object_list(box, src=self._global(0), group=self._group),
                         "receiving rank 0's files")
        return box[0]

    def calibrated(self, last: bool = True) -> None:
        self._status(_OK)
        self._finishing = last

    def finish(self) -> None:
        if self.is_root:  # (it has written the output, whole, before this last exchange)
            self._status(_OK, self._finish_group, "telling them the output is written",
                         "the output was written whole before this")
        else:
            self._status(_OK, self._finish_group, "waiting for rank 0 to write the output")

    def close(self) -> None:
        if self._own_default and self._dist.is_initialized():
            try:
                self._dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass


def _said_here(error: UsageError) -> UsageError:
    """An error of this process's own launch (torchrun sets every variable it reads): said by this rank, whatever
    its rank, rather than left to a rank 0 that may not exist."""
    if "RANK" in os.environ:  # (without one, this process is rank 0 to the CLI, which says it)
        error.dist_rank = os.environ["RANK"]
    return error


def from_environment(device: str = "cpu") -> Group:
    """The process group the environment describes (``WORLD_SIZE`` > 1), joined; else the one-process
    :class:`Group`. The default group uses NCCL when ``device`` is CUDA and gloo otherwise; an already
    initialized default group (a caller's own) is used as it is."""
    world = os.environ.get("WORLD_SIZE", "1")
    try:
        world_size = int(world)
    except ValueError:
        raise UsageError(f"WORLD_SIZE={world!r} is not a number of processes") from None
    if world_size < 1:
        raise UsageError(f"WORLD_SIZE={world!r} is not a number of processes (1 or more)")
    if world_size == 1:
        return Group()
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise UsageError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    timeout_s = _timeout_s()
    own = not dist.is_initialized()
    if own:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise _said_here(UsageError(f"WORLD_SIZE={world_size} but {', '.join(missing)} is not set: launch with "
                                        "torchrun (docs/distributed.md)"))
        rank = os.environ["RANK"]
        if not (rank.strip().isdigit() and int(rank) < world_size):  # (else every rank waits for one never coming)
            raise _said_here(UsageError(f"RANK={rank!r} is not a rank of WORLD_SIZE={world_size} (0 to "
                                        f"{world_size - 1})"))
        cuda = str(device).startswith("cuda")
        backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
        if cuda:
            if not torch.cuda.is_available():
                raise UsageError("--device cuda but torch sees no CUDA device on this machine")
            # one GPU per local rank; more ranks than GPUs share them round-robin (qtool's traffic is on gloo,
            # so NCCL never builds a communicator across two ranks of one GPU, which it refuses)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        try:
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError, OSError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise PeerLost(f"could not join the process group ({cut(first, 160)}); check MASTER_ADDR/MASTER_PORT and "
                           "that every rank was started") from None
    backend = dist.get_backend()
    return _TorchGroup(dist.get_rank(), dist.get_world_size(), backend, timeout_s, own)
