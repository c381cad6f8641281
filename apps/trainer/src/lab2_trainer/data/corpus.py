"""Token streams for training and validation: where they come from, how they are split, and
the compressors' figures on the validation split. Batches are cut from them by
:mod:`lab2_trainer.data.batches`.

Four sources:

* the default corpus: the running interpreter's standard-library ``.py`` sources as bytes
  (vocabulary 256), split into train and validation *by file* with a hash of each file's
  path, so the split never changes with the order files are found in; the two token
  arrays are cached on disk after the first read, with their CRC-32s (a cache that does
  not match them is rebuilt, with a note);
* ``--data python-env``: every ``.py`` source of the running environment, the standard
  library and each site-packages folder on ``sys.path`` (about 130 MB where torch is
  installed), each content once, for training; its validation split *is* the default
  corpus's, and no file with the content of one of its files is trained on, so the two
  corpora's validation losses are the same measurement. The training array is streamed to
  the cache (checksummed as the default corpus's) and memory-mapped from there: a long run
  holds no copy of it in memory;
* ``--data PATH`` naming a text file or a directory of text files (bytes, split by file
  the same way; a single file is split 95/5 by position);
* ``--data PATH`` naming a token array: a ``.npy`` file or a raw ``.bin`` of uint16
  (memory-mapped), split 95/5 by position, or a directory holding ``train.*`` and
  ``val.*`` arrays.

``--stdlib-share S`` mixes the default corpus's training split into another byte corpus's:
each training window comes from it with probability S. With ``python-env``, whose
validation split is the standard library's, it weights the training data toward the kind
of text the run is measured on; the validation split is always ``--data``'s own.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from lab2_trainer.config import UsageError, stdlib_share_problem
from lab2_trainer.runtime.paths import open_regular
from lab2_trainer.runtime.run_folder import atomic_write

VAL_PERCENT = 5  # share of files (or of tokens, for single files) held out for validation
TOKEN_ARRAY_SUFFIXES = (".npy", ".bin")


class DataError(UsageError, ValueError):
    """The data cannot be read or cannot feed the requested batches."""


@dataclass
class Corpus:
    """Train and validation token arrays plus a description of where they came from.

    Attributes:
        train: 1-D integer array (often a memory map).
        val: 1-D integer array.
        vocab_size: number of token ids; every token is below it.
        source: human-readable origin (a path, or "stdlib:<path>").
        is_bytes: tokens are raw bytes, so samples can be decoded as text.
        mix: training streams mixed into ``train``, ``(tokens, share)`` pairs: each window
            is drawn from one with probability ``share`` (``--stdlib-share``).
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str
    is_bytes: bool
    mix: tuple[tuple[np.ndarray, float], ...] = ()

    def identity(self) -> dict:
        """What a checkpoint records to recognise this data on resume (a mix's shares and
        sizes too; without one, the same record as before mixes existed)."""
        out = {
            "source": self.source,
            "vocab_size": self.vocab_size,
            "train_tokens": int(len(self.train)),
            "val_tokens": int(len(self.val)),
        }
        if self.mix:
            out["mix"] = [[float(share), int(len(tokens))] for tokens, share in self.mix]
        return out

    def describe(self) -> str:
        """Where the training windows come from, for the run's summary."""
        if not self.mix:
            return self.source
        rest = 1 - sum(share for _, share in self.mix)
        return f"{self.source} ({rest:.0%} of windows) + " + " + ".join(
            f"{len(tokens):,} standard-library train tokens ({share:.0%})"
            for tokens, share in self.mix)


def is_val_file(relative_path: str) -> bool:
    """Whether a file belongs to the validation split: a fixed hash of its relative path."""
    digest = hashlib.sha1(relative_path.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < VAL_PERCENT


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path, pattern: str) -> list[Path]:
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob(pattern) if p.is_file() and not skip.intersection(p.parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _split_files(root: Path, files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        (val_parts if is_val_file(rel) else train_parts).append(path.read_bytes())
    train = np.frombuffer(b"".join(train_parts), dtype=np.uint8)
    val = np.frombuffer(b"".join(val_parts), dtype=np.uint8)
    return train, val


def cache_dir() -> Path:
    """Where corpus token arrays are cached: ``$LAB2_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/lab2-trainer``, else ``~/.cache/lab2-trainer``."""
    if os.environ.get("LAB2_CACHE_DIR"):
        return Path(os.environ["LAB2_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lab2-trainer"


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, array))


def load_stdlib_corpus(*, use_cache: bool = True, root: Path | None = None) -> Corpus:
    """The standard library's ``.py`` files as bytes, split by file; cached after one read.

    Args:
        use_cache: read and write the cached arrays (several ranks may build it at once:
            every write is atomic and the content is the same).
        root: the folder read (None: :func:`stdlib_root`; tests pass a small one).
    """
    root = stdlib_root() if root is None else root
    if not root.is_dir():
        raise DataError(f"standard library directory not found: {root}")
    key = hashlib.sha1(f"{root}|{sys.version}|{VAL_PERCENT}|v1".encode()).hexdigest()[:16]
    folder = cache_dir() / f"stdlib-{key}"
    train_path, val_path = folder / "train.npy", folder / "val.npy"
    source = f"stdlib:{root}"
    if use_cache and train_path.is_file() and val_path.is_file():
        damage = _cache_damage(folder, (train_path, val_path))
        if damage is None:
            try:
                train = np.load(train_path, mmap_mode="r")
                val = np.load(val_path, mmap_mode="r")
                return Corpus(train, val, 256, source, is_bytes=True)
            except (OSError, ValueError):
                damage = "it cannot be read"
        if damage != "unsealed":
            print(f"lab2-train: note: the corpus cache {folder} is damaged ({damage}); "
                  "rebuilding it", file=sys.stderr, flush=True)
    train, val = _split_files(root, _source_files(root, "*.py"))
    if use_cache:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _save_npy_atomic(train_path, train)
            _save_npy_atomic(val_path, val)
            # Written last: a cache is used only once its checksums are there and match.
            sums = {p.name: _file_crc(p) for p in (train_path, val_path)}
            atomic_write(folder / CACHE_CHECKSUMS, lambda f: f.write(json.dumps(sums).encode()))
        except OSError:
            pass  # an unwritable cache only costs a re-read next time
    return Corpus(train, val, 256, source, is_bytes=True)


#: The corpus cache's checksums (CRC-32 of each file, as checkpoints check their tensors).
CACHE_CHECKSUMS = "checksums.json"


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _cache_damage(folder: Path, files: tuple[Path, ...]) -> str | None:
    """What is wrong with a cache (None: its files match their checksums); "unsealed" when
    it has no checksums (written by an older version, or interrupted): rebuilt quietly."""
    try:
        sums = json.loads((folder / CACHE_CHECKSUMS).read_text())
    except FileNotFoundError:
        return "unsealed"
    except (OSError, ValueError):
        return f"{CACHE_CHECKSUMS} cannot be read"
    for path in files:
        try:
            if not isinstance(sums, dict) or sums.get(path.name) != _file_crc(path):
                return f"{path.name} does not match its checksum"
        except OSError as exc:
            return f"{path.name} cannot be read: {exc.strerror or exc}"
    return None


# ----------------------------------------------------------------------- python-env
#: ``--data python-env``: every Python source of the running environment (a name, not a
#: path: a folder of that name is ``--data ./python-env``).
PYTHON_ENV = "python-env"
#: Larger source files are skipped by the python-env build: generated tables and bundled
#: data, not code anyone wrote (a few dozen of the ~50,000 files of an environment with torch).
MAX_SOURCE_BYTES = 1 << 20
#: The most training bytes the python-env build writes; the files beyond are skipped and
#: counted (an environment with torch holds about 130 MB).
MAX_ENV_BYTES = 4 << 30
#: Seconds between the progress lines of a python-env build.
PROGRESS_EVERY_S = 5.0
#: Folders never entered by the python-env build: bytecode, and environments nested in a
#: root (a virtual environment's site-packages inside the standard library's folder).
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})


def site_packages_dirs() -> list[Path]:
    """The site-packages (and dist-packages) folders on ``sys.path``, in its order, each
    once."""
    found: list[Path] = []
    for entry in sys.path:
        p = Path(entry or ".")
        if p.name in ("site-packages", "dist-packages") and p.is_dir():
            p = p.resolve()
            if p not in found:
                found.append(p)
    return found


def environment_roots() -> tuple[Path, list[Path]]:
    """Where ``--data python-env`` reads: (the standard library, the site-packages folders
    on ``sys.path``)."""
    return stdlib_root(), site_packages_dirs()


@dataclass
class EnvBuild:
    """What a python-env build read and what it left out (files, except ``bytes``)."""

    files: int = 0
    """Files written to the training array."""
    bytes: int = 0
    """Their bytes: the training tokens."""
    duplicates: int = 0
    """Files whose content an earlier file already had."""
    held_out: int = 0
    """Files with the content of a validation file (the validation files themselves too)."""
    too_large: int = 0
    """Files over :data:`MAX_SOURCE_BYTES`."""
    unreadable: int = 0
    """Files that could not be read: no permission, broken links, FIFOs and devices."""
    over_limit: int = 0
    """Files past :data:`MAX_ENV_BYTES` of training bytes."""

    def text(self) -> str:
        skipped = [f"{n:,} {what}" for n, what in (
            (self.duplicates, "duplicates"), (self.held_out, "copies of validation files"),
            (self.too_large, f"over {MAX_SOURCE_BYTES >> 10:,} KiB"),
            (self.unreadable, "unreadable"), (self.over_limit, "past the size limit")) if n]
        return (f"{self.files:,} files, {self.bytes / 1e6:,.1f} MB for training"
                + (f" (left out: {', '.join(skipped)})" if skipped else ""))


def _python_files(root: Path) -> Iterator[Path]:
    """Every ``*.py`` name under ``root``, sorted by relative path within each folder, the
    folder's files before its subfolders; links to folders are not followed."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(folder) / name


def _read_source(path: Path, build: EnvBuild) -> bytes | None:
    """A source file's bytes, or None (counted in ``build``) when it is too large or cannot
    be read; never opens anything but a regular file."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            build.unreadable += 1
            return None
        if info.st_size > MAX_SOURCE_BYTES:
            build.too_large += 1
            return None
        with open_regular(path) as f:
            data = f.read(MAX_SOURCE_BYTES + 1)
    except OSError:
        build.unreadable += 1
        return None
    if len(data) > MAX_SOURCE_BYTES:  # grew since the stat
        build.too_large += 1
        return None
    return data


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _val_digests(stdlib: Path) -> set[bytes]:
    """The content hashes of the default corpus's validation files."""
    found = set()
    for path in _source_files(stdlib, "*.py"):
        if is_val_file(path.relative_to(stdlib).as_posix()):
            found.add(_digest(path.read_bytes()))
    return found


def _env_sources(stdlib: Path, sites: list[Path], held_out: set[bytes],
                 build: EnvBuild) -> Iterator[bytes]:
    """The training files' bytes, each content once: the standard library, then each
    site-packages folder; files whose content hashes to one of ``held_out`` (the
    validation files') left out. Says how far it got every :data:`PROGRESS_EVERY_S`."""
    seen: set[bytes] = set()
    last = time.monotonic()
    for root in (stdlib, *sites):
        for path in _python_files(root):
            data = _read_source(path, build)
            if data is None:
                continue
            digest = _digest(data)
            if digest in held_out:
                build.held_out += 1
            elif digest in seen:
                build.duplicates += 1
            elif build.bytes + len(data) > MAX_ENV_BYTES:
                build.over_limit += 1
            else:
                seen.add(digest)
                build.files += 1
                build.bytes += len(data)
                yield data
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                _say(f"reading the Python environment's sources: {build.text()} so far")


def _say(line: str) -> None:
    print(f"lab2-train: {line}", file=sys.stderr, flush=True)


def _write_npy_stream(f: BinaryIO, chunks: Iterable[bytes]) -> int:
    """Write ``chunks`` to ``f`` as one ``.npy`` array of uint8, streamed: the header is
    written for an empty array, then again for the length once it is known (NumPy pads the
    header so that the shape's digits never change its length). Returns the length."""
    header = {"descr": np.dtype(np.uint8).str, "fortran_order": False, "shape": (0,)}
    np.lib.format.write_array_header_1_0(f, header)
    start = f.tell()
    length = 0
    for chunk in chunks:
        f.write(chunk)
        length += len(chunk)
    f.seek(0)
    np.lib.format.write_array_header_1_0(f, {**header, "shape": (length,)})
    if f.tell() != start:
        raise ValueError(f"the .npy header grew from {start} to {f.tell()} bytes")
    f.seek(0, os.SEEK_END)
    return length


def _env_key(stdlib: Path, sites: list[Path]) -> str:
    """The cache key of an environment: the interpreter, the limits, and each site-packages
    folder's listing (an install, an upgrade or a removal changes it: each package has a
    ``<name>-<version>.dist-info`` there)."""
    h = hashlib.sha1(f"{stdlib}|{sys.version}|{VAL_PERCENT}|{MAX_SOURCE_BYTES}|"
                     f"{MAX_ENV_BYTES}|v1".encode())
    for site in sites:
        try:
            names = sorted(os.listdir(site))
        except OSError:
            names = []
        h.update(f"|{site}:".encode(errors="surrogateescape"))
        h.update("\0".join(names).encode(errors="surrogateescape"))
    return h.hexdigest()[:16]


def load_python_env_corpus(*, use_cache: bool = True,
                           roots: tuple[Path, list[Path]] | None = None) -> Corpus:
    """``--data python-env``: every ``.py`` file of the running environment (see the module
    docstring), with the default corpus's validation split; built once, then memory-mapped
    from the cache.

    Args:
        use_cache: read and write the cache (without it the array is built in memory).
        roots: (standard library, site-packages folders) to read instead of
            :func:`environment_roots`'s (tests pass small folders).
    """
    stdlib, sites = environment_roots() if roots is None else roots
    if not stdlib.is_dir():
        raise DataError(f"standard library directory not found: {stdlib}")
    val = load_stdlib_corpus(use_cache=use_cache, root=stdlib).val
    key = _env_key(stdlib, sites)
    source = f"{PYTHON_ENV}:{key}"
    folder = cache_dir() / f"{PYTHON_ENV}-{key}"
    train_path = folder / "train.npy"
    if use_cache and train_path.is_file():
        damage = _cache_damage(folder, (train_path,))
        if damage is None:
            try:
                return Corpus(np.load(train_path, mmap_mode="r"), val, 256, source,
                              is_bytes=True)
            except (OSError, ValueError):
                damage = "it cannot be read"
        if damage != "unsealed":
            _say(f"note: the corpus cache {folder} is damaged ({damage}); rebuilding it")
    where = ", ".join(str(p) for p in (stdlib, *sites))
    _say(f"building the {PYTHON_ENV} corpus from every .py file under {where} (once: it is "
         "cached)")
    held_out = _val_digests(stdlib)
    build = EnvBuild()
    train = None
    if use_cache:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(train_path, lambda f: _write_npy_stream(
                f, _env_sources(stdlib, sites, held_out, build)))
            # Written last: a cache is used only once its checksum is there and matches.
            sums = json.dumps({train_path.name: _file_crc(train_path)}).encode()
            atomic_write(folder / CACHE_CHECKSUMS, lambda f: f.write(sums))
            train = np.load(train_path, mmap_mode="r")
        except OSError as exc:
            _say(f"note: cannot write the corpus cache {folder} ({exc.strerror or exc}): "
                 "the corpus is held in memory")
            build = EnvBuild()
    if train is None:
        data = b"".join(_env_sources(stdlib, sites, held_out, build))
        train = np.frombuffer(data, dtype=np.uint8)
    if build.files == 0:
        raise DataError(f"--data {PYTHON_ENV}: no Python source to train on under {where}")
    _say(f"{PYTHON_ENV} corpus: {build.text()}"
         + (f"; cached in {folder}" if use_cache and isinstance(train, np.memmap) else ""))
    return Corpus(train, val, 256, source, is_bytes=True)


def _load_token_array(path: Path) -> np.ndarray:
    try:
        if path.suffix == ".npy":
            array = np.load(path, mmap_mode="r")
        else:
            array = np.memmap(path, dtype=np.uint16, mode="r")
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read token array {path}: {exc}") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise DataError(f"token array {path} must be 1-D integers, got {array.dtype} {array.shape}")
    return array


def _split_tail(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cut = len(array) - max(1, len(array) * VAL_PERCENT // 100)
    return array[:cut], array[cut:]


def _check_vocab(array: np.ndarray, vocab_size: int, what: str) -> None:
    if len(array) and int(array.max()) >= vocab_size:
        raise DataError(
            f"{what} holds token id {int(array.max())}, not below --vocab-size {vocab_size}"
        )
    if len(array) and not np.issubdtype(array.dtype, np.unsignedinteger) \
            and int(array.min()) < 0:
        first = int(np.argmax(np.asarray(array) < 0))
        raise DataError(f"{what} holds negative token id {int(array[first])} (at position "
                        f"{first}); token ids must be in [0, --vocab-size)")


def load_corpus(path: str | None = None, vocab_size: int | None = None,
                stdlib_share: float = 0.0) -> Corpus:
    """Load the corpus named by ``path`` (see the module docstring); ``None`` is the stdlib.

    Args:
        path: text file, directory, ``.npy``/``.bin`` token array, ``"python-env"``
            (:data:`PYTHON_ENV`) or ``None``.
        vocab_size: required for token arrays; must be 256 (or omitted) for text.
        stdlib_share: the share of training windows drawn from the default corpus's
            training split instead (``--stdlib-share``; 0: none).

    Raises:
        DataError: missing path, unreadable or empty data, tokens outside the vocabulary,
            a share outside [0, 1) or one that mixes bytes into a token array.
    """
    problem = stdlib_share_problem(stdlib_share, path)
    if problem is not None:
        raise DataError(problem)
    corpus = _load_source(path, vocab_size)
    if stdlib_share > 0:
        if not corpus.is_bytes:
            raise DataError(f"--stdlib-share mixes bytes; --data {path} is a token array with "
                            "its own vocabulary")
        corpus.mix = ((load_stdlib_corpus().train, float(stdlib_share)),)
    return corpus


def _load_source(path: str | None, vocab_size: int | None) -> Corpus:
    """:func:`load_corpus` without the mix."""
    if path is None or path == PYTHON_ENV:
        if vocab_size not in (None, 256):
            raise DataError(f"the {'default' if path is None else PYTHON_ENV} byte corpus has "
                            f"vocabulary 256, not {vocab_size}")
        return load_stdlib_corpus() if path is None else load_python_env_corpus()
    from lab2_trainer.runtime.paths import check_input_path

    if str(path) == "":
        raise DataError("--data is empty: name a file or a folder (or leave --data out for "
                        "the standard library's sources)")
    # A regular file or a folder, never a FIFO or a device (/dev/zero): one would block
    # the read below, the other never end it.
    p = check_input_path(path, "--data", missing="the data path does not exist")
    arrays = {}
    if p.is_dir():
        for split in ("train", "val"):
            for suffix in TOKEN_ARRAY_SUFFIXES:
                if (p / f"{split}{suffix}").is_file():
                    arrays[split] = p / f"{split}{suffix}"
    if p.suffix in TOKEN_ARRAY_SUFFIXES or arrays:
        if vocab_size is None:
            raise DataError(f"{p} is a token array: pass --vocab-size")
        if p.is_dir():
            if set(arrays) != {"train", "val"}:
                raise DataError(f"{p} must hold both train.npy|bin and val.npy|bin")
            train = _load_token_array(arrays["train"])
            val = _load_token_array(arrays["val"])
        else:
            train, val = _split_tail(_load_token_array(p))
        _check_vocab(train, vocab_size, f"{p} (train)")
        _check_vocab(val, vocab_size, f"{p} (val)")
        return Corpus(train, val, vocab_size, str(p), is_bytes=False)
    if vocab_size not in (None, 256):
        raise DataError(
            f"text data is read as bytes (vocabulary 256), not --vocab-size {vocab_size}"
        )
    if p.is_dir():
        files = _source_files(p, "*")
        if not files:
            raise DataError(f"no files under {p}")
        if len(files) == 1:
            train, val = _split_tail(np.frombuffer(files[0].read_bytes(), dtype=np.uint8))
        else:
            train, val = _split_files(p, files)
            if len(val) == 0:  # too few files for the hash to pick one: hold out the last
                train, val = _split_files_last(p, files)
    else:
        train, val = _split_tail(np.frombuffer(p.read_bytes(), dtype=np.uint8))
    return Corpus(train, val, 256, str(p), is_bytes=True)


def _split_files_last(root: Path, files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    train = np.frombuffer(b"".join(f.read_bytes() for f in files[:-1]), dtype=np.uint8)
    return train, np.frombuffer(files[-1].read_bytes(), dtype=np.uint8)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies of ``tokens`` (the loss of the best model
    that ignores context: the baseline a language model has to beat)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk = 1 << 24  # bincount in chunks so a large memory map is never copied whole
    for start in range(0, len(tokens), chunk):
        counts += np.bincount(np.asarray(tokens[start : start + chunk]), minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


#: The most validation bytes the compressors read (the baselines of a larger split are
#: those of its first 16 MiB).
COMPRESS_LIMIT = 16 << 20


def compression_baselines(corpus: Corpus) -> dict[str, float]:
    """What general-purpose compressors make of the validation split, in nats per token:
    ``gzip`` (level 9) and ``xz`` (preset 9, extreme), the figures a language model's
    validation loss is worth putting beside (bits per byte x ln 2, on bytes).

    Computed once per corpus (xz takes about a second per 2 MB) and cached under
    :func:`cache_dir`, keyed by the corpus's identity and a CRC-32 of the bytes read.
    """
    import gzip
    import lzma

    data = np.ascontiguousarray(corpus.val[: COMPRESS_LIMIT // corpus.val.itemsize]).tobytes()
    tokens = len(data) // corpus.val.itemsize
    key = json.dumps([corpus.identity(), zlib.crc32(data), "v1"], sort_keys=True)
    path = cache_dir() / "baselines" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
        if set(cached) == {"gzip", "xz"}:
            return cached
    except (OSError, ValueError):
        pass
    nats = 8 * math.log(2) / max(tokens, 1)
    figures = {"gzip": len(gzip.compress(data, 9)) * nats,
               "xz": len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) * nats}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(json.dumps(figures).encode()))
    except OSError:
        pass  # an unwritable cache only costs computing them again
    return figures


