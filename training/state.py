"""Saving and restoring a training state (named pytrees of arrays plus JSON metadata) with
orbax-checkpoint, apart from any run-directory layout (training/run_dir.py names the steps).

Format: one directory per step, `<root>/step_00000100/`, written by orbax's `CheckpointManager`:
one item per pytree (e.g. `params/`, `opt_state/`, `rng/`: tensorstore OCDBT, every process
writing the shards it holds), `meta/` (the caller's JSON) and, once orbax has finalized the step,
`sha256.json` (the SHA-256 of every file, written by process 0) so a damaged file is detected.

- Asynchronous: `Writer.save` returns once the arrays are copied off the devices (the time the
  caller is blocked, returned); the files are written in the background while training goes on.
  The next save (or `close`) waits for the previous one to finish.
- Atomic: orbax writes into `<name>.orbax-checkpoint-tmp` and renames it when every process has
  finished (its finalization), so a crash never leaves a partial step under its real name; the
  temporary directory is not a checkpoint (run_dir's listing ignores it) and orbax removes it the
  next time a writer opens the directory.
- Keep-K: orbax deletes all but the newest `keep` steps after each save.
- Restoring reads into templates of `jax.ShapeDtypeStruct` leaves that carry their target
  shardings: each process reads only the shards its devices hold, on any mesh and any number of
  processes (nothing is gathered on one host).
"""

import contextlib
import errno
import hashlib
import json
import logging
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from jaxtyping import PyTree

from training.checkpoint_metadata import META_FILE, check_step_metadata, read_checksums

STEP_PREFIX, STEP_DIGITS = "step", 8
META, SHA256 = "meta", "sha256.json"
LEGACY_STATE = "state.eqx"  # the Equinox-format checkpoints written before orbax


class CorruptState(ValueError):
    """A state directory that cannot be read back as it was written."""


class UncheckedState(UserWarning):
    """A finalized step read without its SHA-256 record."""


class MismatchedState(ValueError):
    """A state directory intact, but holding other arrays than the template asks for."""


STEP_METADATA = "_CHECKPOINT_METADATA"


class _ItemMetadataNote(logging.Filter):
    """Drops orbax's "Metadata file does not exist" for an item directory of a finalized step:
    reading one item with a plain Checkpointer, orbax looks for the step's metadata file in the
    item's directory, where it never is (it sits one level up, `check_complete` reads it), and
    warns on every resume. A missing file anywhere else still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "Metadata file does not exist: %s" or not record.args:
            return True
        path = Path(str(record.args[0]))
        return not (path.name == STEP_METADATA and (path.parent.parent / STEP_METADATA).is_file())


def _ocp():
    # Imported on first use: orbax brings in tensorstore and asyncio machinery that most
    # commands (inference, the plan printer) never need.
    import orbax.checkpoint as ocp

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _ItemMetadataNote) for f in absl.filters):
        absl.addFilter(_ItemMetadataNote())
    return ocp


def checkpoint_files(directory: Path) -> list[Path]:
    """A step directory's files (every level), not counting its SHA-256 record."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != SHA256)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_checksums(directory: Path) -> None:
    sums = {str(p.relative_to(directory)): _sha256(p) for p in checkpoint_files(directory)}
    tmp = directory / f".{SHA256}.tmp"
    tmp.write_text(json.dumps(sums, indent=0))
    tmp.rename(directory / SHA256)


class Writer:
    """Writes steps under `root` with orbax (asynchronously unless `asynchronous=False`) and
    keeps the newest `keep` (0: all). Every process of a multi-process run makes one and calls
    `save` with the same step."""

    def __init__(self, root: str | Path, *, keep: int, asynchronous: bool = True):
        ocp = _ocp()
        self.root = Path(root).absolute()  # orbax refuses relative paths
        # orbax's manager reads the metadata of every step under the root (at the first save):
        # a malformed one is named now, before anything is written or deleted.
        for step in sorted(self.root.glob(f"{STEP_PREFIX}_*/{STEP_METADATA}")):
            if step.parent.name[len(STEP_PREFIX) + 1 :].isdigit():  # not a temporary directory
                check_step_metadata(step)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep > 0 else None,
            step_name_format=ocp.step.standard_name_format(
                step_prefix=STEP_PREFIX, step_format_fixed_length=STEP_DIGITS
            ),
            enable_async_checkpointing=asynchronous,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.root, options=options)
        self._checksum: threading.Thread | None = None
        self._failed: Exception | None = None

    def path(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}_{step:0{STEP_DIGITS}d}"

    def save(self, step: int, trees: Mapping[str, PyTree], meta: dict[str, Any]) -> float:
        """Start writing `trees` (item name -> pytree of arrays) and `meta` (JSON-ready) as
        step `step`. Returns the seconds the caller was blocked: waiting for the previous save,
        and copying the arrays off the devices (they may be donated or changed after this)."""
        ocp = _ocp()
        start = time.perf_counter()
        self._finish_previous()
        # orbax refuses a tree without arrays (an optimizer without state): nothing to write,
        # and `restore_state` gives such a template back as it is.
        items = {
            name: ocp.args.StandardSave(tree)
            for name, tree in trees.items()
            if jax.tree.leaves(tree)
        }
        items[META] = ocp.args.JsonSave(meta)
        with self._disk_errors():
            self._manager.save(step, args=ocp.args.Composite(**items))
        # The checksums need the finalized files: a thread waits for them and hashes them
        # while the caller trains on (only process 0 writes; every process waits).
        path = self.path(step)

        def finalize():
            try:
                self._manager.wait_until_finished()
                if jax.process_index() == 0:
                    _write_checksums(path)
            except Exception as error:  # raised to the caller by the next save or close
                self._failed = error

        self._checksum = threading.Thread(target=finalize, name=f"checksum-{step}")
        self._checksum.start()
        return time.perf_counter() - start

    def _finish_previous(self) -> None:
        if self._checksum is not None:
            self._checksum.join()
            self._checksum = None
        failed, self._failed = self._failed, None
        with self._disk_errors():
            if failed is not None:
                raise failed  # the background write's (or checksum's) error
            self._manager.wait_until_finished()

    @contextlib.contextmanager
    def _disk_errors(self):
        """A full disk, wherever in orbax or tensorstore it shows, as an error that says what
        to do (the step's temporary directory is removed when a writer next opens the run)."""
        try:
            yield
        except Exception as error:
            if getattr(error, "errno", None) != errno.ENOSPC and "No space left" not in str(error):
                raise
            raise OSError(
                errno.ENOSPC,
                f"no space left on the disk holding {self.root} while writing a checkpoint; "
                "free some space (or lower --keep) and resume from the last complete checkpoint",
            ) from error

    def close(self) -> float:
        """Wait for the last save to be finalized; the seconds waited."""
        start = time.perf_counter()
        try:
            self._finish_previous()
        finally:
            self._manager.close()
        return time.perf_counter() - start

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_complete(directory: str | Path) -> None:
    """A CorruptState unless `directory` is a finalized orbax step whose files match the
    SHA-256 recorded after it was written (a step finalized just before a crash may lack the
    record: then orbax's own metadata is all that is checked)."""
    directory = Path(directory)
    if (directory / LEGACY_STATE).exists():
        raise CorruptState(f"{directory}: an Equinox-format checkpoint ({LEGACY_STATE})")
    if not (directory / STEP_METADATA).is_file() or not (directory / META).is_dir():
        raise CorruptState(
            f"{directory}: not a finalized orbax checkpoint (no _CHECKPOINT_METADATA or {META}/)"
        )
    try:
        check_step_metadata(directory / STEP_METADATA)
    except ValueError as error:
        raise CorruptState(str(error)) from error
    record = directory / SHA256
    if not record.exists():
        # Refusing would strand a run whose crash came between orbax's finalization and the
        # record; reading on without a word would hide a deleted record. So: said, loudly.
        warnings.warn(
            f"{directory} has no {SHA256}: its files cannot be checked against their SHA-256 and "
            "are read unchecked (a crash just after the step was written leaves it so; so does "
            "a deleted record). Resume from an earlier step if this one may be damaged.",
            UncheckedState,
            stacklevel=2,
        )
        return
    files = [str(p.relative_to(directory)) for p in checkpoint_files(directory)]
    try:
        expected = read_checksums(record, files)
    except ValueError as error:
        raise CorruptState(str(error)) from error
    for name, digest in expected.items():
        if _sha256(directory / name) != digest:
            raise CorruptState(f"{directory}: {name} does not match its SHA-256")


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The metadata of a state directory, after `check_complete`."""
    check_complete(directory)
    ocp = _ocp()
    try:
        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
            meta = reader.restore(Path(directory).absolute() / META)
    except Exception as error:
        raise CorruptState(f"{directory}: unreadable {META}: {error}") from error
    if not isinstance(meta, dict):
        raise CorruptState(
            f"{Path(directory) / META_FILE} holds a JSON {type(meta).__name__}, not an object"
        )
    return meta


def restore_state(directory: str | Path, templates: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """The items named in `templates` (a subset of those saved is fine) read from `directory`
    into their templates' structure, each leaf a `jax.ShapeDtypeStruct` with the sharding it
    is restored into. Shapes, dtypes and tree structure must match what was saved."""
    ocp = _ocp()
    directory = Path(directory).absolute()
    restored = {}
    for name, template in templates.items():
        if not jax.tree.leaves(template):
            restored[name] = template
            continue
        try:
            with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as reader:
                saved = reader.metadata(directory / name).item_metadata
                _check_shapes(name, template, _by_name(saved))
                restored[name] = _into_template(
                    template,
                    reader.restore(
                        directory / name,
                        args=ocp.args.StandardRestore(_as_saved(template, saved)),
                    ),
                )
        except MismatchedState:
            raise
        except Exception as error:
            raise CorruptState(f"{directory}: cannot read {name}/: {error}") from error
    return restored


def _as_saved(template: PyTree, saved: PyTree) -> PyTree:
    """The template's leaves arranged in the saved tree's structure. The two hold the same
    arrays (`_check_shapes`) but may differ in empty entries: a field added to a module since
    the checkpoint was written (`Transformer.mtp`, None in a model without it) is no array, yet
    orbax refuses a template whose structure names it."""
    want = _by_name(template)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(saved), [want[path] for path in _by_name(saved)]
    )


def _into_template(template: PyTree, restored: PyTree) -> PyTree:
    """The restored arrays (in the saved structure) put back into the template's structure."""
    by_path = _by_name(restored)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(template), [by_path[path] for path in _by_name(template)]
    )


def saved_arrays(directory: str | Path, name: str) -> dict[str, Any]:
    """The arrays of item `name` as saved (orbax's metadata: `.shape`, `.dtype`), by path."""
    ocp = _ocp()
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as reader:
        return _by_name(reader.metadata(Path(directory).absolute() / name).item_metadata)


def _check_shapes(name: str, template: PyTree, have: dict[str, Any]) -> None:
    """Each saved array has its template's shape and dtype (orbax would read a shape mismatch
    as padding or truncation): the first difference, named by its path."""
    want = _by_name(template)
    if len(want) != len(have):
        raise MismatchedState(f"{name}/ holds {len(have)} arrays where {len(want)} are expected")
    for path, leaf in want.items():
        found = have.get(path)
        if found is None:
            raise MismatchedState(f"{name}/ has no array {path}")
        if tuple(found.shape) != tuple(leaf.shape) or found.dtype != leaf.dtype:
            raise MismatchedState(
                f"{name}/{path} is {found.dtype}{list(found.shape)}, "
                f"expected {leaf.dtype}{list(leaf.shape)}"
            )


def _by_name(tree: PyTree) -> dict[str, Any]:
    """Leaves by their path as orbax names them (`0.mu.embed.weight`): a module's attributes
    and a dict's keys alike, so a template and the saved metadata compare."""

    def name(key) -> str:
        for field in ("name", "key", "idx"):
            if hasattr(key, field):
                return str(getattr(key, field))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(name(k) for k in path): leaf for path, leaf in leaves}
