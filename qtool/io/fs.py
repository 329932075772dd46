"""Atomic outputs and file hashing."""

from __future__ import annotations

import contextlib
import ctypes
import decimal
import errno
import glob
import hashlib
import os
import re
import secrets
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

from ..choices import check_flag
from ..errors import UsageError

__all__ = ["atomic_output_dir", "atomic_file", "scratch_dir_beside", "sha256_file", "sampled_sha256",
           "check_apart_from_inputs", "check_output_dir", "check_output_file", "parse_size",
           "write_text_atomic", "remove_stale_temporaries", "remove_orphans", "writer_tag"]


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str, what: str, unlimited: bool = True) -> Optional[int]:
    """'5GB', '500MB', '2GiB', '123' (bytes) -> bytes; '0' or 'none' -> None (no limit; refused unless
    ``unlimited``). Units as Hugging Face's ``max_shard_size``: KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2."""
    hint = " (0 or none: no limit)" if unlimited else ""
    t = text.strip().upper().replace(" ", "")
    if t in ("0", "NONE") and unlimited:
        return None
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:  # (in decimal: 0.03207424GB is 32074240 bytes, where float arithmetic gave one byte less)
        value = decimal.Decimal(num)
        if value.is_finite() and not -30 < value.adjusted() < 30:  # (1e1000000GB: past any size, and past what
            value = decimal.Decimal(-1)                              # decimal's context multiplies)
    except decimal.InvalidOperation:
        value = decimal.Decimal(-1)
    if unit not in _UNITS or not value.is_finite() or value < 0 or value * _UNITS[unit] > 2 ** 63:
        raise UsageError(f"{what}: {text!r} is not a size like 5GB, 500MB or 2GiB{hint}")
    if value == 0:
        if not unlimited:
            raise UsageError(f"{what}: {text!r} is not a size above zero, like 5GB, 500MB or 2GiB")
        return None
    return max(1, int(value * _UNITS[unit]))


_ENTRIES_LOOKED_AT = 100_000  # entries of an input directory searched for links (a data tree may be huge)


def _existing_inputs(out: Path, inputs: Sequence[Tuple[str, Optional[str]]]):
    """``(what, path, its real path, out's real path)`` of each input that exists, and of each link inside an
    input directory (a Hugging Face cache snapshot's files are links into its ``blobs``: replacing a directory a
    link points into deletes that input's file as surely as replacing the input's own directory)."""
    target = Path(os.path.realpath(out))
    walked = set()
    for what, path in inputs:
        if path is None or not Path(path).exists():
            continue
        real = Path(os.path.realpath(path))
        yield what, path, real, target
        if os.path.islink(path):  # the link as named is an input too: an --out holding it would delete it
            named = os.path.abspath(path)
            yield what, path, Path(os.path.realpath(os.path.dirname(named))) / os.path.basename(named), target
        if real.is_dir() and real not in walked:
            walked.add(real)
            for link in _links_under(real, _ENTRIES_LOOKED_AT):
                yield what, os.path.join(path, link.relative_to(real)), Path(os.path.realpath(link)), target


def _links_under(directory: Path, at_most: int):
    """The links in ``directory``'s tree, among its first ``at_most`` entries."""
    seen = 0
    for root, dirs, files in os.walk(directory):  # (links to directories are listed in dirs, not followed)
        for name in dirs + files:
            seen += 1
            if seen > at_most:
                return
            if os.path.islink(os.path.join(root, name)):
                yield Path(root) / name


def _refuse_inside(out: Path, flag: str, what: str, path: str, src: Path, target: Path) -> None:
    if src.is_dir() and src in target.parents:
        raise UsageError(f"{out}: {flag} is inside the {what} directory {path}; write outputs elsewhere")


def _refuse_literal_home(out: Path, flag: str) -> None:
    """An output path that starts with a literal ``~`` (quoted, so no shell expanded it): written as it stands it
    makes a directory named ``~`` here, which a later ``rm -rf ~`` meant for it would not remove."""
    first = Path(out).parts[0] if Path(out).parts else ""
    if not first.startswith("~") or Path(first).exists():
        return
    if first != "~":  # (~user: a home only where that user exists; ~out is a name like any other)
        import pwd

        try:
            pwd.getpwnam(first[1:])
        except KeyError:
            return
    try:
        meant = f": write the path out ({Path(out).expanduser()})"
    except RuntimeError:  # (no home directory to name)
        meant = ": write the path out"
    raise UsageError(f"{out}: {flag} starts with a literal {first} (a shell expands it only unquoted), which would "
                     f"make a {'directory' if Path(out).parent != Path('.') or flag == '--out' else 'file'} named "
                     f"{first} here{meant}")


def check_output_dir(out: Path, overwrite: bool, inputs: Sequence[Tuple[str, Optional[str]]] = ()) -> None:
    """Refuse an --out that is a file, or an existing directory without --overwrite, before any work; and an --out
    that is, holds or lies inside one of ``inputs`` (``(what, path)`` pairs: the checkpoint, the recipe, the data,
    the encodings), which replacing --out would delete or writing into it would change; and the working directory
    or one holding it (an empty --out, an unset shell variable, reads as ".")."""
    check_flag("overwrite", overwrite)  # (overwrite="false" replaced an existing directory)
    _refuse_literal_home(out, "--out")
    here = Path.cwd()
    if out.exists() and (out.resolve() == here or out.resolve() in here.parents):
        raise UsageError(f"{str(out) or '.'}: --out {'is' if out.resolve() == here else 'holds'} the working "
                         "directory, which replacing it would delete (an empty --out means '.'): choose another")
    check_apart_from_inputs(out, "--out", inputs)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: --out is an existing file, not a directory")
    if os.path.lexists(out) and not overwrite:  # (a link to nothing too: the run would end refused)
        raise UsageError(f"{out}: already exists{'' if out.exists() else ' (a link to nothing)'}; pass --overwrite "
                         "to replace it")
    if out.is_dir() and not out.is_symlink() and os.path.ismount(out):  # (found after the work, as "busy")
        raise UsageError(f"{out}: --out is a mount point, which qtool cannot replace (it publishes a finished output "
                         "in one rename); give a directory inside it")
    parent = out.parent if str(out.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{parent}: parent of --out is not a directory")


def check_apart_from_inputs(directory: Path, flag: str, inputs: Sequence[Tuple[str, Optional[str]]]) -> None:
    """Refuse a directory qtool replaces or removes (``flag`` says which) that is, holds or lies inside one of
    ``inputs`` (``(what, path)`` pairs)."""
    for what, path, src, target in _existing_inputs(directory, inputs):
        if target == src or target in src.parents:
            raise UsageError(f"{directory}: {flag} {'is' if target == src else 'contains'} the {what} {path}; "
                             f"replacing it would delete an input: choose another --out")
        _refuse_inside(directory, flag, what, path, src, target)


def check_output_file(out: Path, inputs: Sequence[Tuple[str, Optional[str]]], overwrite: Optional[bool] = None,
                      flag: str = "--out") -> None:
    """Refuse, before any work, a file output that is one of ``inputs`` (``(what, path)`` pairs) or lies inside an
    input directory (writing it would replace or change an input), a directory, a file in a missing directory,
    and, where ``overwrite`` is False, an existing file."""
    if overwrite is not None:
        check_flag("overwrite", overwrite)
    _refuse_literal_home(out, flag)
    for what, path, src, target in _existing_inputs(out, inputs):
        if target == src:
            raise UsageError(f"{out}: {flag} is the {what} {path}; writing it would replace an input: choose another "
                             "file")
        _refuse_inside(out, flag, what, path, src, target)
    if out.is_dir():
        raise UsageError(f"{out}: {flag} is a directory; give a file name")
    if out.exists() and not out.is_file():  # (the file is written beside it and renamed over it: /dev/null would go)
        raise UsageError(f"{out}: {flag} is not a regular file (a device, a pipe or a socket), which writing the "
                         "output would replace; give a file name")
    if overwrite is False and out.exists():
        raise UsageError(f"{out}: exists; pass --overwrite to replace it")
    parent = out.parent if str(out.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{parent}: parent of {flag} is not a directory")
    if not parent.is_dir():
        raise UsageError(f"{parent}: no such directory for {flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{parent}: cannot write {flag} {out.name} there (not writable)")


_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
_TEMP_NAME = re.compile(r"\.tmp-(?P<host>[A-Za-z0-9._-]+)-(?P<pid>\d+)-[^/]*$")


def _temp_prefix(name: str) -> str:
    """Temporary names carry the writer's host and pid, so that a later run can tell whether their writer is gone
    (SIGKILL leaves them behind) and remove them."""
    return f".{_temp_stem(name)}.tmp-{writer_tag()}-"


_STEM_BYTES = 150  # of a temporary's name, which must stay within 255 bytes with the host, pid and random tail


def _temp_stem(name: str) -> str:
    """``name``, or for a long one its start and a hash of the whole (a legal 250-byte --out name was refused
    with "File name too long": its temporary's name went past 255 bytes)."""
    if len(name.encode("utf-8", "surrogateescape")) <= _STEM_BYTES:
        return name
    head = name
    while len(head.encode("utf-8", "surrogateescape")) > _STEM_BYTES - 17:
        head = head[:-1]
    return f"{head}~{hashlib.sha256(name.encode('utf-8', 'surrogateescape')).hexdigest()[:16]}"


def _writer_is_gone(host: str, pid: int) -> bool:
    if host != _HOST:
        return False  # another machine's run (a shared filesystem): we cannot tell, so we leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def writer_tag() -> str:
    """``HOST-PID`` of this process, as the names of what it writes on the way carry it (see :func:`remove_orphans`)."""
    return f"{_HOST}-{os.getpid()}"


def scratch_dir_beside(out: Path) -> "tempfile.TemporaryDirectory":
    """A temporary directory beside ``out``, named as its temporaries are (the writer's host and pid): one that
    SIGKILL left behind is removed by the next run writing ``out``."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")  # (where remove_stale_temporaries(out) looks)
    return tempfile.TemporaryDirectory(prefix=_temp_prefix(out.name), dir=parent if parent.is_dir() else None)


def remove_stale_temporaries(target: Path) -> List[Path]:
    """Remove the temporary files and directories beside ``target`` that a killed run writing it left behind
    (their writer, named in their name, no longer runs on this host). Returns what was removed."""
    parent = target.parent if str(target.parent) else Path(".")
    return remove_orphans(parent, f".{glob.escape(_temp_stem(target.name))}.tmp-*", _TEMP_NAME)


def remove_orphans(parent: Path, pattern: str, name: "re.Pattern[str]") -> List[Path]:
    """Remove the files and directories in ``parent`` matching the glob ``pattern`` whose name (``name``'s ``host``
    and ``pid`` groups, a :func:`writer_tag`) says a process of this host made them that no longer runs (SIGKILL
    leaves them behind). Returns what was removed."""
    removed: List[Path] = []
    try:
        candidates = list(parent.glob(pattern))
    except OSError:
        return removed
    for p in candidates:
        m = name.search(p.name)
        if m is None or not _writer_is_gone(m["host"], int(m["pid"])):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
        removed.append(p)
    return removed


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2(2); False where the C library or the filesystem lacks it (then the caller falls back)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), ctypes.c_uint(flags)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


# the outputs this process has put in place (a command's --out directory or file), so that an interrupt arriving
# after them does not claim that nothing was written; the CLI forgets them at the start of each command
_PUBLISHED: List[Path] = []


def published() -> List[Path]:
    """The outputs put in place since :func:`forget_published`, in order."""
    return list(_PUBLISHED)


def forget_published() -> None:
    _PUBLISHED.clear()
    _RESUMABLE.clear()


@contextlib.contextmanager
def _publishing(tmp: Path, out: Path) -> Iterator[None]:
    """Around the rename of ``tmp`` to ``out``: :func:`published` lists ``out`` once it holds ``tmp`` (the same
    device and inode), also where an interrupt lands as the rename returns (it said "nothing was written" of an
    output in place)."""
    st = os.lstat(tmp)
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            now = os.lstat(out)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # (the rename had happened)
                _PUBLISHED.append(out)
        raise
    _PUBLISHED.append(out)


_RESUMABLE: List[Path] = []  # the state directories of --sequential runs that hold finished blocks now


def resumable(directory: Optional[Path] = None, kept: bool = True) -> List[Path]:
    """The resumable states kept now (what an interrupt leaves besides the outputs); with ``directory``, record it
    as kept (``kept``) or gone first."""
    if directory is not None:
        if directory in _RESUMABLE:
            _RESUMABLE.remove(directory)
        if kept:
            _RESUMABLE.append(directory)
    return list(_RESUMABLE)


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` to ``out``. A new ``out`` appears in one rename, never over a directory another
    process created meanwhile unless ``overwrite``; an existing ``out`` is swapped with ``tmp`` in one atomic
    exchange, so ``out`` is never missing, and two concurrent runs both succeed (the last one's output stays)."""
    try:
        with _publishing(tmp, out):
            if not _renameat2(tmp, out, _RENAME_NOREPLACE):
                if out.exists():
                    raise FileExistsError(errno.EEXIST, "exists", str(out))
                os.rename(tmp, out)
        return
    except FileExistsError:
        if not overwrite:
            raise UsageError(f"{out}: was created by another process while this run was writing; nothing was "
                             "written (pass --overwrite to replace it)") from None
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: became a file while this run was writing; nothing was written")
    with _publishing(tmp, out):
        if not _renameat2(tmp, out, _RENAME_EXCHANGE):
            old = Path(tempfile.mkdtemp(prefix=_temp_prefix(out.name), dir=tmp.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            tmp = old
    # after the exchange ``tmp`` holds the previous output: a directory, or the symbolic link --out was (the link
    # itself goes; what it pointed to is never touched)
    if tmp.is_symlink():
        with contextlib.suppress(OSError):
            tmp.unlink()
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def _name_the_output(e: BaseException, out: Path) -> None:
    """A write that failed without naming a file (a full disk, a file-size limit: the error of a write() call) is
    told as the output's (the error line said "File too large" and no more)."""
    if isinstance(e, OSError) and not e.filename:
        e.filename = str(out)


@contextlib.contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``out``; on success it becomes ``out`` in one rename (or one atomic
    exchange with an existing ``out``).

    On any failure (or interrupt) the temporary directory is removed and ``out`` is left as it was. What a killed
    run left beside ``out`` is removed first.
    """
    out = Path(out)
    check_output_dir(out, overwrite)
    parent = out.parent if str(out.parent) else Path(".")
    made = [d for d in (parent, *parent.parents) if not d.exists()]  # (removed again on failure: nothing written)
    named: List[Path] = []
    try:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(out)
            tmp = new_temporary(parent, _temp_prefix(out.name), named, directory=True)
        except OSError as e:
            raise UsageError(f"{out}: cannot create output directory: {e.strerror or e}") from None
        yield tmp
        _publish(tmp, out, overwrite)
    except BaseException as e:
        for t in named:
            shutil.rmtree(t, ignore_errors=True)
        _remove_empty(made)
        _name_the_output(e, out)
        raise


def new_temporary(parent: Path, prefix: str, named: List[Path], directory: bool,
                  private: bool = False) -> Path:
    """A new empty directory (or file) ``parent/prefix<random>``, made as mkdir (open) would make it (the umask
    applies; ``private``: for this user alone). Its name goes into ``named`` before it exists, so the caller's
    cleanup knows it whenever an interrupt lands (with mkdtemp, one as it returned left the temporary behind)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        named.append(path)
        try:
            if directory:
                os.mkdir(path, 0o700 if private else 0o777)
            else:
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                os.close(os.open(path, flags, 0o600 if private else 0o666))
            return path
        except FileExistsError:  # (another temporary of this process, by the name's chance)
            named.remove(path)
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(parent / prefix))


def _remove_empty(directories: Sequence[Path]) -> None:
    """Remove the directories an output made on its way (innermost first), where they are still empty."""
    for d in directories:
        try:
            d.rmdir()
        except OSError:  # (not empty: another run's, or something put there meanwhile)
            return


@contextlib.contextmanager
def atomic_file(path: Path, output: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on success it replaces ``path`` in one rename, on failure it
    is removed. What a killed run left beside ``path`` is removed first. ``output``: a file the command was asked
    to write (:func:`published` lists it once in place), not state kept on the way."""
    path = Path(path)
    remove_stale_temporaries(path)
    named: List[Path] = []
    try:
        tmp = new_temporary(path.parent.resolve(), _temp_prefix(path.name), named, directory=False)
        yield tmp
        with _publishing(tmp, path) if output else contextlib.nullcontext():
            os.replace(tmp, path)
    except BaseException as e:
        _name_the_output(e, path)
        for t in named:
            t.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, output: bool = False) -> None:
    """Write a small text file whole or not at all (``output``: as :func:`atomic_file`)."""
    with atomic_file(path, output) as tmp:
        tmp.write_text(text, encoding="utf-8")


def sampled_sha256(files: Sequence[Path], sample: int = 1 << 20) -> str:
    """SHA-256 of what ``files`` hold, sampled: each file's name, size, and its first, middle and last ``sample``
    bytes (the whole of a file up to three samples long). Cheap on a model of many GB, and different for two
    fine-tunes of one model (their weights differ everywhere); not a proof of equal bytes."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with open(f, "rb") as fh:
            for at in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                fh.seek(at)
                h.update(fh.read(sample))
    return h.hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
