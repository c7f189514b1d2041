"""Atomic, verified checkpoints of an agent's adapter and round state (design principle 5).

Layout under the store's directory::

    round-000123/adapter.safetensors   the adapter tensors (safetensors, never pickle)
    round-000123/state.json            round, JSON state, SHA-256 of adapter and state
    round-000123/<name>.safetensors    optional extra tensor sets (e.g. ``peer_slot``)
    LATEST                             "round-000123": the last checkpoint saved

A save is crash-safe at every instant (kill -9 included):

1. both files are written into a fresh temporary directory ``.tmp-round-000123-*`` and
   fsynced, then the directory itself is fsynced;
2. the temporary directory is renamed to ``round-000123`` (atomic) and the parent
   directory fsynced: this rename is the commit point;
3. ``LATEST`` is replaced atomically (write ``LATEST.tmp``, fsync, rename, fsync parent);
4. checkpoints beyond the newest ``keep`` are removed (renamed to ``.del-*`` first, so a
   half-deleted directory never looks like a checkpoint).

Re-saving an existing round first moves the old directory to ``.old-round-…``; a crash
between the two renames is repaired on load by moving it back.

:meth:`CheckpointStore.load_latest` cleans what a crash leaves (``.tmp-*``, ``.del-*``,
``LATEST.tmp``), then returns the newest checkpoint that verifies (both SHA-256s in
``state.json`` match, the tensors parse). A checkpoint that fails verification is moved
aside to ``.corrupt-round-…`` (kept for inspection, the newest ``keep`` of them) and the next
older one is tried. "Newest" is by round number; ``LATEST`` is a pointer for people and
tools and is never trusted over verified content.

Extra tensor sets (``save(..., extra={name: tensors})``, e.g. the agent's peer slot)
are committed with the checkpoint (same temporary directory, same rename) and listed in
``state.json`` with their size and SHA-256, but verified on their own: a damaged extra file
is renamed aside inside its checkpoint (``<name>.safetensors.corrupt-<ns>``), logged, and
left out of :attr:`Checkpoint.extras` (named in :attr:`Checkpoint.damaged`), while the
adapter and state of the same checkpoint still load. What an extra set holds is its
owner's to check (:meth:`CheckpointStore.quarantine_extra` sets one aside after a check
the store cannot do, such as shapes against the model).

One store, one writer: two processes must not share a directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import safetensors.torch
import structlog
import torch

__all__ = [
    "ADAPTER_FILE",
    "LATEST_FILE",
    "STATE_FILE",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
]

ADAPTER_FILE: Final = "adapter.safetensors"
STATE_FILE: Final = "state.json"
LATEST_FILE: Final = "LATEST"
_FORMAT: Final = "peerlm.checkpoint"
_VERSION: Final = 1
_ROUND_DIR: Final = re.compile(r"round-([0-9]{6,12})")
_OLD_DIR: Final = re.compile(r"\.old-(round-[0-9]{6,12})-[0-9a-f]+")
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
_EXTRA_NAME: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")
_MAX_ROUND: Final = 10**12 - 1


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete or corrupt; the message says what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint."""

    round: int
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    path: Path
    #: The extra tensor sets that verified, by name (``save(..., extra=...)``).
    extras: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: Extra sets the record lists that did not verify (set aside, or missing).
    damaged: tuple[str, ...] = ()


def _round_name(round_: int) -> str:
    return f"round-{round_:06d}"


def _extra_file(name: str) -> str:
    return f"{name}.safetensors"


def _cpu_tensors(adapter: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in adapter.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"adapter entry {name!r} is not a named tensor")
        # clone: safetensors refuses tensors that share storage (tied weights, views).
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
    return tensors


def _canonical(state: Any) -> str:
    """The JSON text the state's hash covers; raises ValueError/TypeError if not JSON-able."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)


# The file-system steps of a save, as functions of their own so that tests can simulate a
# crash between any two of them.


def _write_durable(path: Path, data: bytes, *, exclusive: bool = True) -> None:
    """Write ``data`` to ``path`` and fsync it (0600: adapters derive from private data)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename(src: Path, dst: Path) -> None:
    # os.rename, not os.replace: a directory must never silently replace another one.
    os.rename(src, dst)


def _replace(src: Path, dst: Path) -> None:
    os.replace(src, dst)


class CheckpointStore:
    """Saves and restores ``(round, adapter tensors, JSON state)`` under ``directory``."""

    def __init__(self, directory: Path | str, keep: int = 3, *, log: Any = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._log: Any = log if log is not None else structlog.get_logger("peerlm.agent.checkpoint")
        # The daemon saves from a worker thread; keep two calls in one process from
        # interleaving their renames.
        self._lock = threading.Lock()

    # -- saving -----------------------------------------------------------------------------

    def save(
        self,
        round_: int,
        adapter: Mapping[str, torch.Tensor],
        state: Mapping[str, Any],
        *,
        extra: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    ) -> Path:
        """Write checkpoint ``round_`` atomically and durably; returns its directory.

        ``extra``: further tensor sets by name (lower-case letters, digits, ``_``), each
        written as ``<name>.safetensors`` in the same commit and verified on its own at load
        (module docstring). Raises ``ValueError``/``TypeError`` before touching the disk if
        the round is out of range, a name is not allowed, a tensor is not a tensor, or the
        state is not JSON (NaN included).
        """
        if not 0 <= round_ <= _MAX_ROUND:
            raise ValueError(f"round must be in 0..{_MAX_ROUND}, got {round_}")
        tensors = _cpu_tensors(adapter)
        meta = {"format": _FORMAT, "round": str(round_)}
        extra_blobs: dict[str, bytes] = {}
        for extra_name, extra_tensors in (extra or {}).items():
            if not _EXTRA_NAME.fullmatch(extra_name) or extra_name == "adapter":
                raise ValueError(f"extra tensor set name {extra_name!r} is not allowed")
            extra_blobs[extra_name] = safetensors.torch.save(
                _cpu_tensors(extra_tensors), metadata=meta
            )
        canonical = _canonical(dict(state))
        blob = safetensors.torch.save(tensors, metadata=meta)
        record = {
            "format": _FORMAT,
            "version": _VERSION,
            "round": round_,
            "saved_at": time.time(),
            "adapter_file": ADAPTER_FILE,
            "adapter_bytes": len(blob),
            "adapter_sha256": hashlib.sha256(blob).hexdigest(),
            "state_sha256": hashlib.sha256(canonical.encode("utf-8")).hexdigest(),
            "state": json.loads(canonical),
        }
        if extra_blobs:
            record["extra"] = {
                n: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                for n, b in extra_blobs.items()
            }
        state_bytes = json.dumps(record, sort_keys=True, indent=1, allow_nan=False).encode()
        name = _round_name(round_)
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            final = self._commit(name, blob, state_bytes, extra_blobs)
            self._write_latest(name)
            self._prune(keep_name=name)
        self._log.info("checkpoint_saved", round=round_, path=str(final), bytes=len(blob))
        return final

    def _commit(
        self, name: str, blob: bytes, state_bytes: bytes, extra: Mapping[str, bytes]
    ) -> Path:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.directory))
        final = self.directory / name
        old: Path | None = None
        try:
            _write_durable(tmp / ADAPTER_FILE, blob)
            for extra_name, extra_blob in extra.items():
                _write_durable(tmp / _extra_file(extra_name), extra_blob)
            _write_durable(tmp / STATE_FILE, state_bytes)
            _fsync_dir(tmp)
            if final.exists():
                old = self.directory / f".old-{name}-{uuid.uuid4().hex}"
                _rename(final, old)
            _rename(tmp, final)
            _fsync_dir(self.directory)
        except Exception:
            # An orderly failure (disk full, permissions): undo. A crash skips this, and
            # load_latest() repairs the same states.
            if old is not None and not final.exists():
                os.rename(old, final)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _write_latest(self, name: str) -> None:
        tmp = self.directory / f"{LATEST_FILE}.tmp"
        _write_durable(tmp, f"{name}\n".encode(), exclusive=False)
        _replace(tmp, self.directory / LATEST_FILE)
        _fsync_dir(self.directory)

    def _prune(self, *, keep_name: str) -> None:
        complete = sorted(self._complete(), reverse=True)
        keep = {path.name for _, path in complete[: self.keep]} | {keep_name}
        for _, path in complete:
            if path.name not in keep:
                self._discard(path)
        corrupt = sorted(p for p in self.directory.glob(".corrupt-round-*") if p.is_dir())
        for path in corrupt[: -self.keep]:
            self._discard(path)

    def _discard(self, path: Path) -> None:
        # Rename first: a half-deleted directory must not look like a checkpoint.
        doomed = self.directory / f".del-{path.name}-{uuid.uuid4().hex}"
        _rename(path, doomed)
        _fsync_dir(self.directory)
        shutil.rmtree(doomed, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------

    def rounds(self) -> list[int]:
        """Rounds that have a committed checkpoint directory (not yet verified), ascending."""
        return sorted(r for r, _ in self._complete())

    def load(self, round_: int) -> Checkpoint:
        """Load and verify checkpoint ``round_``; raises :class:`CheckpointError`."""
        path = self.directory / _round_name(round_)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint for round {round_} in {self.directory}")
        return self._verify(path, round_)

    def roll_back(self, round_: int) -> Checkpoint:
        """Make checkpoint ``round_`` the newest: verify it, discard every newer one, point
        ``latest`` at it; the checkpoint. Raises :class:`CheckpointError` (nothing changed)
        if it is missing or does not verify. The newer ones go oldest first, so a crash
        part-way leaves the newest (the state before the roll-back: it did not happen) or
        none of them (it did), never a state in between."""
        with self._lock:
            checkpoint = self.load(round_)
            newer = [path for r, path in self._complete() if r > round_]
            for path in sorted(newer):
                self._discard(path)
            self._write_latest(_round_name(round_))
        self._log.info("checkpoint_rolled_back", round=round_, discarded=len(newer))
        return checkpoint

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, or None; repairs what a crash left behind."""
        if not self.directory.is_dir():
            return None
        with self._lock:
            self._recover()
            pointer = self._read_latest()
            for round_, path in sorted(self._complete(), reverse=True):
                try:
                    checkpoint = self._verify(path, round_)
                except CheckpointError as err:
                    self._quarantine(path, str(err))
                    continue
                if pointer is not None and pointer != path.name:
                    self._log.warning(
                        "checkpoint_pointer_mismatch",
                        latest_file=pointer,
                        loaded=path.name,
                    )
                return checkpoint
        return None

    def _complete(self) -> list[tuple[int, Path]]:
        found: list[tuple[int, Path]] = []
        for path in self.directory.iterdir():
            match = _ROUND_DIR.fullmatch(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return found

    def _read_latest(self) -> str | None:
        try:
            return (self.directory / LATEST_FILE).read_text().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def _recover(self) -> None:
        """Remove temporary and half-deleted directories; restore an interrupted re-save."""
        changed = False
        for path in list(self.directory.iterdir()):
            name = path.name
            if name.startswith((".tmp-", ".del-")):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                changed = True
            elif name == f"{LATEST_FILE}.tmp":
                path.unlink(missing_ok=True)
                changed = True
            elif match := _OLD_DIR.fullmatch(name):
                target = self.directory / match.group(1)
                if target.exists():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.rename(path, target)
                changed = True
        if changed:
            _fsync_dir(self.directory)
            self._log.info("checkpoint_recovered", directory=str(self.directory))

    def _quarantine(self, path: Path, reason: str) -> None:
        aside = self.directory / f".corrupt-{path.name}-{time.time_ns()}"
        self._log.warning("checkpoint_corrupt", path=str(path), reason=reason, moved_to=aside.name)
        os.rename(path, aside)
        _fsync_dir(self.directory)

    def _verify(self, path: Path, round_: int) -> Checkpoint:
        try:
            record = json.loads((path / STATE_FILE).read_bytes())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
            raise CheckpointError(f"{path / STATE_FILE} unreadable: {err}") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{path / STATE_FILE} is not a JSON object")
        if record.get("format") != _FORMAT or record.get("version") != _VERSION:
            raise CheckpointError(f"{path / STATE_FILE} is not a version-{_VERSION} checkpoint")
        if record.get("round") != round_:
            raise CheckpointError(f"{path} holds round {record.get('round')!r}, not {round_}")
        adapter_sha, state_sha = record.get("adapter_sha256"), record.get("state_sha256")
        state = record.get("state")
        if not (
            isinstance(adapter_sha, str)
            and _HEX64.fullmatch(adapter_sha)
            and isinstance(state_sha, str)
            and _HEX64.fullmatch(state_sha)
            and isinstance(state, dict)
        ):
            raise CheckpointError(f"{path / STATE_FILE} lacks hashes or state")
        if hashlib.sha256(_canonical(state).encode("utf-8")).hexdigest() != state_sha:
            raise CheckpointError(f"{path / STATE_FILE}: state does not match its SHA-256")
        try:
            blob = (path / ADAPTER_FILE).read_bytes()
        except OSError as err:
            raise CheckpointError(f"{path / ADAPTER_FILE} unreadable: {err}") from None
        if record.get("adapter_bytes") != len(blob):
            raise CheckpointError(
                f"{path / ADAPTER_FILE} has {len(blob)} bytes, "
                f"expected {record.get('adapter_bytes')}"
            )
        if hashlib.sha256(blob).hexdigest() != adapter_sha:
            raise CheckpointError(f"{path / ADAPTER_FILE} does not match its SHA-256")
        try:
            tensors = safetensors.torch.load(blob)
        except Exception as err:  # the hash matched, so this is a writer bug; still refuse
            raise CheckpointError(f"{path / ADAPTER_FILE} does not parse: {err}") from None
        extras: dict[str, dict[str, torch.Tensor]] = {}
        damaged: list[str] = []
        listed = record.get("extra", {})
        for extra_name, entry in listed.items() if isinstance(listed, dict) else ():
            try:
                extras[extra_name] = self._verify_extra(path, extra_name, entry)
            except CheckpointError as err:
                damaged.append(str(extra_name))
                self._set_extra_aside(path, str(extra_name), str(err))
        return Checkpoint(
            round=round_,
            tensors=dict(tensors),
            state=state,
            path=path,
            extras=extras,
            damaged=tuple(damaged),
        )

    @staticmethod
    def _verify_extra(path: Path, name: Any, entry: Any) -> dict[str, torch.Tensor]:
        """One extra tensor set of checkpoint ``path``; raises :class:`CheckpointError`."""
        if not (isinstance(name, str) and _EXTRA_NAME.fullmatch(name) and name != "adapter"):
            raise CheckpointError(f"{path / STATE_FILE} lists an extra set named {name!r}")
        file = path / _extra_file(name)
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        if not (isinstance(sha, str) and _HEX64.fullmatch(sha)):
            raise CheckpointError(f"{path / STATE_FILE} lacks the hash of {file.name}")
        try:
            blob = file.read_bytes()
        except OSError as err:
            raise CheckpointError(f"{file} unreadable: {err}") from None
        if entry.get("bytes") != len(blob) or hashlib.sha256(blob).hexdigest() != sha:
            raise CheckpointError(f"{file} does not match its size and SHA-256")
        try:
            return dict(safetensors.torch.load(blob))
        except Exception as err:  # the hash matched: a writer bug; still refuse
            raise CheckpointError(f"{file} does not parse: {err}") from None

    def _set_extra_aside(self, path: Path, name: str, reason: str) -> None:
        file = path / _extra_file(name) if _EXTRA_NAME.fullmatch(name) else None
        aside = None
        if file is not None and file.is_file():
            aside = file.with_name(f"{file.name}.corrupt-{time.time_ns()}")
            os.rename(file, aside)
            _fsync_dir(path)
        self._log.warning(
            "checkpoint_extra_damaged",
            path=str(path),
            name=name,
            reason=reason,
            moved_to=None if aside is None else aside.name,
        )

    def quarantine_extra(self, checkpoint: Checkpoint, name: str, reason: str) -> None:
        """Set extra set ``name`` of ``checkpoint`` aside (renamed, logged) after a check
        the store cannot make itself (its owner's: shapes against the model, ...); the
        checkpoint's adapter and state stay as they are."""
        with self._lock:
            self._set_extra_aside(checkpoint.path, name, reason)
