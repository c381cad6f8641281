"""Checks of the command line, the machine and a checkpoint that must pass before any rank
starts: so that bad input costs one line on stderr, exit code 2, and no file written.

(Each setting's own range, e.g. ``--clip nan`` or ``--lr inf``, is its field's check in
:mod:`lab2_trainer.config`, run by ``TrainSettings.validate``.)

* :func:`check_out_path`: ``--out`` is a folder, or can become one, and the files a run
  writes there are absent or regular files;
* :func:`check_input_path`, :func:`read_bounded_text`: an input (``--data``,
  ``--resume``, ``--config``) is a regular file or a folder, never a FIFO or a device,
  which could block a read or never end (checked with ``stat``, before any read), and a
  config file is read with a size bound;
* :func:`check_output_file`: an output file (``plan --plot``) is absent or a regular
  file, in a folder; :func:`check_path_length`: a path the system could not open is one
  line, not a traceback;
* :func:`check_memory`: the model, its gradients and AdamW state (plus the logits of one
  micro-batch) fit the memory this machine has (a lower bound: a run refused here could
  never have run), counted by arithmetic on the configuration (:mod:`lab2_trainer.shapes`),
  so that an absurd size is refused at once;
* :func:`check_compile`: ``--compile-backend`` and ``--compile-mode`` are torch.compile's;
* :func:`check_checkpoint_fits`: a checkpoint's model tensors, optimizer state (zero1's
  checks, on ``meta`` tensors), random state and sampler position fit the run.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
from pathlib import Path
from typing import Any

from lab2_trainer.config import INT_LIMIT, UsageError
from lab2_trainer.shapes import parameter_count, training_state_bytes

GIB = 1024**3
# Per process: the interpreter, torch and the data maps (a lower bound).
PROCESS_BYTES = 200 * 1024**2


#: The longest file name and path Linux takes (NAME_MAX, PATH_MAX): a longer one fails
#: with ENAMETOOLONG wherever it is used.
NAME_MAX, PATH_MAX = 255, 4096
#: The largest ``--config`` file read (a settings file is a few hundred bytes).
CONFIG_MAX_BYTES = 1024 * 1024


def shown(path: Any, limit: int = 80) -> str:
    """``path`` as a message quotes it: whole when short, else its start and its length
    (a 10 MB path must not make a 10 MB error line)."""
    text = str(path)
    if len(text) <= limit and text.isprintable():
        return text
    return f"{text[: limit // 2]!r}... ({len(text):,} characters)"


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None: a regular file)."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, None)):
        if test(mode):
            return name
    return "not a regular file"


def check_path_length(path: Any, what: str) -> None:
    """``path`` is one the system can open: no NUL, no name over :data:`NAME_MAX` bytes,
    not over :data:`PATH_MAX` bytes in all.

    Raises:
        UsageError: naming ``what`` (the flag) and the part that is too long.
    """
    text = str(path)
    if "\0" in text:
        raise UsageError(f"{what} {shown(path)}: a path cannot hold a NUL character")
    size = len(os.fsencode(text))
    if size >= PATH_MAX:
        raise UsageError(f"{what} {shown(path)}: the path is {size:,} bytes, more than the "
                         f"{PATH_MAX - 1:,} a path may have")
    for part in Path(text).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            name = "the name" if part == text else f"the name {shown(part, 40)}"
            raise UsageError(f"{what} {shown(path)}: {name} is {len(os.fsencode(part)):,} "
                             f"bytes, more than the {NAME_MAX} a file name may have")


def _stat(path: Path, what: str) -> os.stat_result | None:
    """``stat`` of ``path`` (following links); None when it does not exist.

    Raises:
        UsageError: a symbolic link loop, a path that is too long, or another error.
    """
    check_path_length(path, what)
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"{what} {shown(path)}: a loop of symbolic links (it never "
                             "reaches a file)") from None
        if exc.errno == errno.ENOTDIR:
            return None
        raise UsageError(f"{what} {shown(path)}: cannot be examined "
                         f"({exc.strerror or exc})") from None


def check_input_path(path: str | os.PathLike, what: str, *, folder: bool = True,
                     missing: str = "does not exist") -> Path:
    """An input ``path`` exists and is a regular file, or a folder where ``folder``
    allows: checked with ``stat``, before any read (a FIFO would block it, a device like
    ``/dev/zero`` never end it).

    Args:
        what: the flag, for the message.
        folder: whether a folder is a valid input.
        missing: what to say of a path that does not exist.

    Raises:
        UsageError: one line naming the flag and what the path is.
    """
    p = Path(path).expanduser()
    st = _stat(p, what)
    if st is None:
        if os.path.islink(p):
            raise UsageError(f"{what} {shown(path)}: a symbolic link to "
                             f"{shown(os.readlink(p))}, which does not exist")
        raise UsageError(f"{what} {shown(path)}: {missing}")
    kind = _kind(st.st_mode)
    if kind is None or (folder and stat.S_ISDIR(st.st_mode)):
        return p
    expected = "a regular file or a folder" if folder else "a regular file"
    raise UsageError(f"{what} {shown(path)} is {kind}, not {expected}: refused before "
                     "reading it (nothing was read)")


def read_bounded_text(path: str | os.PathLike, what: str,
                      limit: int = CONFIG_MAX_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes (a file swapped for a
    FIFO after the check is opened without blocking, and refused).

    Raises:
        UsageError: not a regular file, too large, unreadable, or not UTF-8.
    """
    p = check_input_path(path, what, folder=False, missing="cannot read it: it does not exist")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{what} {shown(path)}: cannot read it ({exc.strerror or exc})") \
            from None
    try:
        st = os.fstat(fd)
        kind = _kind(st.st_mode)
        if kind is not None:
            raise UsageError(f"{what} {shown(path)} is {kind}, not a regular file (nothing was "
                             "read)")
        if st.st_size > limit:
            raise UsageError(f"{what} {shown(path)} is {st.st_size:,} bytes; a settings file "
                             f"is at most {limit:,}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UsageError(f"{what} {shown(path)}: cannot read it ({exc.strerror or exc})") \
            from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UsageError(f"{what} {shown(path)} is over {limit:,} bytes; a settings file is "
                         f"at most {limit:,}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {shown(path)}: not UTF-8 text ({exc})") from None


def check_output_file(path: str | os.PathLike, what: str, *,
                      make_parents: bool = False) -> Path:
    """An output file's ``path`` is absent or a regular file, in an existing folder (with
    ``make_parents``, in a folder that can be made: its nearest existing ancestor is a
    writable folder): a folder, a device, a FIFO or a socket there is never replaced.

    Raises:
        UsageError: one line naming the flag and what is in the way.
    """
    p = Path(path).expanduser()
    if str(path) == "":
        raise UsageError(f"{what} is empty: name a file")
    st = _stat(p, what)
    if st is not None and _kind(st.st_mode) is not None:
        raise UsageError(f"{what} {shown(path)} is {_kind(st.st_mode)}: only a new or a "
                         "regular file is written (nothing was written)")
    parent = p.parent
    pst = _stat(parent, what)
    while make_parents and pst is None and parent.parent != parent:
        parent = parent.parent  # made by the write; what is above must be a folder
        pst = _stat(parent, what)
    if pst is None or not stat.S_ISDIR(pst.st_mode):
        raise UsageError(f"{what} {shown(path)}: {shown(parent)} is not a folder (nothing was "
                         "written)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {shown(path)}: {shown(parent)} is not writable (nothing was "
                         "written)")
    return p


#: The files a run writes in its ``--out`` folder, and the folder of its checkpoints.
RUN_FILES = ("settings.toml", "metrics.jsonl", "summary.json", "sample.txt",
             "loss_curve.png", "ckpt.pt")
RUN_FOLDERS = ("ckpt",)


def check_out_path(out: str) -> None:
    """``out`` is an existing folder, or a path where a folder can be made; the files a run
    writes there (:data:`RUN_FILES`) are absent or regular files, and its checkpoint folder
    (:data:`RUN_FOLDERS`) absent or a folder.

    Raises:
        UsageError: it is empty, too long, a file, a parent is a file, it cannot be
            written, or a run file there is a FIFO, a device, a folder or a socket.
    """
    if out == "":
        raise UsageError("--out is empty: name a folder (or leave --out out for "
                         "runs/<preset>-<time>)")
    p = Path(out).expanduser()
    st = _stat(p, "--out")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"--out {shown(out)} exists and is not a folder (nothing was "
                         "written)")
    if st is not None:
        for name in RUN_FILES + RUN_FOLDERS:
            found = _stat(p / name, "--out")
            kind = found is not None and _kind(found.st_mode)
            if name in RUN_FOLDERS and found is not None and not stat.S_ISDIR(found.st_mode):
                raise UsageError(f"--out {shown(out)}: {name} there is "
                                 f"{kind or 'a regular file'}, not the folder a run keeps its "
                                 "checkpoints in (nothing was written)")
            if kind and name in RUN_FILES:
                raise UsageError(f"--out {shown(out)}: {name} there is {kind}; a run writes "
                                 "only new or regular files (nothing was written)")
    probe = p
    while not probe.exists():
        parent = probe.parent
        if parent == probe:
            break
        probe = parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"--out {shown(out)}: {shown(probe)} is a file, not a folder (nothing "
                         "was written)")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--out {shown(out)}: {shown(probe)} is not writable (nothing was "
                         "written)")


#: torch.compile's own backends, which ``torch._dynamo.list_backends()`` may leave out of
#: its default listing (it hides the "debug" ones, aot_eager and eager among them).
BUILTIN_BACKENDS = ("inductor", "eager", "aot_eager")


def check_compile(backend: str, mode: str | None) -> None:
    """``--compile-backend`` names a backend torch.compile knows, and ``--compile-mode`` one
    of inductor's modes (the other backends take none), checked here rather than in every
    rank at its first step.

    Raises:
        UsageError: an unknown backend or mode.
    """
    try:
        import torch._dynamo

        known = set(torch._dynamo.list_backends(exclude_tags=())) | set(BUILTIN_BACKENDS)
    except Exception:  # noqa: BLE001 (no dynamo on this platform: the ranks will say it)
        return
    if backend not in known:
        import difflib

        close = difflib.get_close_matches(backend, sorted(known), n=2)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise UsageError(f"--compile-backend {backend!r} is not a torch.compile backend{hint}; "
                         f"choose one of {', '.join(sorted(torch._dynamo.list_backends()))}, "
                         f"{', '.join(BUILTIN_BACKENDS[1:])}")
    if mode is None or mode == "default":
        return
    if backend != "inductor":
        raise UsageError(f"--compile-mode {mode!r} is an inductor mode; --compile-backend "
                         f"{backend} takes none (drop --compile-mode)")
    try:
        from torch._inductor import list_mode_options

        modes = list(list_mode_options())
    except Exception:  # noqa: BLE001 (cannot list them: inductor will check)
        return
    if mode not in modes:
        raise UsageError(f"--compile-mode {mode!r} is not one of inductor's modes: "
                         f"{', '.join(modes)}")


def shape_model(config: Any):
    """The model with ``meta`` tensors: shapes and names only, no memory, no init."""
    import torch

    from lab2_trainer.model import TransformerLM

    class _Shapes(TransformerLM):
        def reset_parameters(self, seed: int = 0) -> None:  # nothing to fill on meta
            pass

    with torch.device("meta"):
        return _Shapes(config)


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    cgroups = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
               ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
    for limit_file, usage_file in cgroups:
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 2**60:
                found.append(int(limit) - int(Path(usage_file).read_text().strip()))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _fmt(n: int) -> str:
    if n < 1024 * GIB:
        return f"{n / GIB:,.1f} GiB"
    tib = n / (1024 * GIB)
    return f"{tib:,.1f} TiB" if tib < 1e6 else f"{tib:.2g} TiB"  # absurd sizes stay short


def check_memory(settings: Any, world_size: int, device_type: str, *,
                 available: int | None = None) -> None:
    """Refuse a run whose model cannot fit: weights, gradients and AdamW's two moments in
    fp32 (sharded over the ranks as :func:`lab2_trainer.shapes.training_state_bytes`
    says), the logits and their gradient for one micro-batch, and the process itself. On
    the CPU every local rank shares this machine's memory; on GPUs each rank needs it on
    its own device.

    Raises:
        UsageError: with the estimate and what is available.
    """
    n = parameter_count(settings.model)
    micro = max(1, settings.batch_size // max(1, world_size) // max(1, settings.grad_accum))
    logits = 2 * 4 * micro * settings.model.context_length * settings.model.vocab_size
    per_rank = training_state_bytes(n, settings.sharding, world_size,
                                    getattr(settings, "reshard_after_forward", True)) + logits
    what = (f"{n:,} parameters: weights, gradients and AdamW state in fp32 (sharded as "
            f"--sharding {settings.sharding} shards them), and the logits of a micro-batch")
    hint = "make it smaller (--vocab-size, --d-model, --n-layers, --batch-size)"
    if device_type == "cuda":
        try:
            import torch

            smallest = min(torch.cuda.get_device_properties(i).total_memory
                           for i in range(min(world_size, torch.cuda.device_count())))
        except Exception:  # noqa: BLE001 (no answer from the driver: nothing to check)
            return
        if per_rank > smallest:
            raise UsageError(f"the model needs at least {_fmt(per_rank)} per GPU ({what}); "
                             f"the GPUs have {_fmt(smallest)}: {hint}")
        return
    need = world_size * (per_rank + PROCESS_BYTES)
    have = available if available is not None else available_memory()
    if have is not None and need > have:
        raise UsageError(f"the run needs at least {_fmt(need)} of memory ({what}, "
                         f"{world_size} rank(s)); this machine has {_fmt(have)} available: "
                         f"{hint}")


def check_checkpoint_fits(ckpt: dict[str, Any], settings: Any, path: Any) -> None:
    """A checkpoint's tensors, random state and position fit the run about to start.

    Raises:
        UsageError: one line naming the checkpoint and the first thing that does not fit.
    """
    import torch

    model = shape_model(settings.model)
    expected = model.state_dict()
    saved = ckpt["model"]
    if not isinstance(saved, dict):
        raise UsageError(f"checkpoint {path}: its model is not a state dict")
    for name in expected:
        if name not in saved:
            raise UsageError(f"checkpoint {path}: the model lacks {name}")
        t = saved[name]
        if not isinstance(t, torch.Tensor) or t.shape != expected[name].shape:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise UsageError(f"checkpoint {path}: model tensor {name} is {got}, the model "
                             f"needs {list(expected[name].shape)}")
    _refuse_extra(saved, expected, path)
    from zero1.checkpoint import check_state_dict, dry_run_load

    opt = _adamw_like_the_run(model, settings)
    try:
        check_state_dict(ckpt["optimizer"], opt.param_groups, opt.defaults,
                         optimizer_name="AdamW", optimizer_cls=torch.optim.AdamW,
                         who="optimizer state")
        dry_run_load(ckpt["optimizer"], opt.param_groups, opt.defaults, torch.optim.AdamW,
                     who="optimizer state")
    except (TypeError, ValueError) as exc:
        raise UsageError(f"checkpoint {path}: {exc}") from None
    _check_adamw_content(ckpt["optimizer"], opt.param_groups, settings, path)
    _check_run_state(ckpt, settings, path, len(list(model.parameters())))


def check_sharded_checkpoint_fits(small: dict[str, Any], tensors: dict[str, Any],
                                  settings: Any, path: Any) -> None:
    """A sharded checkpoint (its ``trainer.pt`` and DCP's metadata, ``tensors``) fits the
    run about to start: every parameter's flat tensor of its size, AdamW's state whole or
    absent for each, nothing else; then what :func:`check_checkpoint_fits` checks of the
    rest. No tensor is read.

    Raises:
        UsageError: one line naming the checkpoint and the first thing that does not fit.
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lab2_trainer.sharded_checkpoint import MOMENTS, model_key, parameter_names, state_key

    model = shape_model(settings.model)
    names = parameter_names(model)
    sizes = {}
    for p in model.parameters():
        name = names[id(p)]
        sizes[model_key(name)] = p.numel()
        if state_key(name, "exp_avg") in tensors:
            sizes.update({state_key(name, m): p.numel() for m in MOMENTS})
            sizes[state_key(name, "step")] = 1
    for key, numel in sizes.items():
        md = tensors.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise UsageError(f"checkpoint {path}: it lacks tensor {key}")
        if tuple(md.size) != (numel,) or not md.properties.dtype.is_floating_point:
            raise UsageError(f"checkpoint {path}: tensor {key} is {md.properties.dtype} of "
                             f"{list(md.size)} elements; the model needs a floating tensor of "
                             f"{numel}")
    _refuse_extra(tensors, sizes, path)
    from zero1.checkpoint import check_state_dict

    opt = _adamw_like_the_run(model, settings)
    groups = {"state": {}, "param_groups": small["optimizer_groups"]}
    try:
        check_state_dict(groups, opt.param_groups, opt.defaults, optimizer_name="AdamW",
                         optimizer_cls=torch.optim.AdamW, who="optimizer state")
    except (TypeError, ValueError) as exc:
        raise UsageError(f"checkpoint {path}: {exc}") from None
    _check_adamw_content(groups, opt.param_groups, settings, path)
    _check_run_state(small, settings, path, len(list(model.parameters())))


def _refuse_extra(saved: Any, expected: Any, path: Any) -> None:
    """A checkpoint tensor the model does not have is named, the first in sorted order."""
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise UsageError(f"checkpoint {path}: the model has no tensor {extra[0]}")


def _adamw_like_the_run(model: Any, settings: Any) -> Any:
    """The run's AdamW over ``model`` (its groups and hyperparameters), for the checks."""
    import torch

    from lab2_trainer.parallel import param_groups

    return torch.optim.AdamW(param_groups(model, settings.weight_decay), lr=settings.lr,
                             betas=(settings.beta1, settings.beta2), eps=1e-8)


def _check_run_state(ckpt: dict[str, Any], settings: Any, path: Any, n_params: int) -> None:
    """The launch order, random state, scaler, data position and step of a checkpoint."""
    _check_gradient_order(ckpt.get("gradient_order"), n_params, path)
    _check_rng(ckpt["rng"], path)
    _check_scaler(ckpt.get("scaler"), path)
    sampler = ckpt["sampler"]
    if not isinstance(sampler, dict) or not all(
            _is_int(sampler.get(k)) and 0 <= sampler[k] < INT_LIMIT for k in ("seed", "draws")):
        raise UsageError(f"checkpoint {path}: its sampler position is not two integers >= 0")
    if sampler["seed"] != settings.seed:
        raise UsageError(f"checkpoint {path} draws its data with seed {sampler['seed']}, not "
                         f"--seed {settings.seed}")
    step = ckpt["step"]
    if not _is_int(step) or not 0 <= step < INT_LIMIT:
        raise UsageError(f"checkpoint {path}: its step {step!r} is not an integer >= 0")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite Python number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


#: AdamW's per-parameter state, as ``torch.optim.AdamW`` keeps it (amsgrad off).
ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")


def _check_adamw_content(state_dict: dict[str, Any], groups: list[dict[str, Any]],
                         settings: Any, path: Any) -> None:
    """What zero1's structural checks leave to the optimizer's first step: each group's
    hyperparameters are AdamW's (``betas`` two numbers in [0, 1) equal to the run's, a
    finite ``lr``, ``eps`` and ``weight_decay``, no amsgrad nor maximize), and each
    parameter's state is exactly AdamW's: ``exp_avg`` and ``exp_avg_sq`` floating tensors
    of the parameter's shape and a finite ``step`` >= 0, or nothing (not stepped yet).

    Raises:
        UsageError: one line naming the group or parameter and what is wrong.
    """
    import torch

    betas = (settings.beta1, settings.beta2)
    decays = (settings.weight_decay, 0.0)  # parallel.param_groups: matrices, then vectors
    for i, saved in enumerate(state_dict["param_groups"]):
        where = f"checkpoint {path}: optimizer param group {i}"
        got = saved.get("betas")
        if (not isinstance(got, (list, tuple)) or len(got) != 2
                or not all(_is_real(b) and 0 <= b < 1 for b in got)):
            raise UsageError(f"{where}: betas must be two numbers in [0, 1), got {got!r}")
        if tuple(got) != betas:
            raise UsageError(f"{where}: betas {tuple(got)} differ from the run's (--beta1, "
                             f"--beta2) = {betas}")
        for key, low in (("lr", 0.0), ("eps", 0.0), ("weight_decay", 0.0)):
            value = saved.get(key)
            if not _is_real(value) or value < low or (key == "eps" and value == 0):
                raise UsageError(f"{where}: {key} must be a finite number "
                                 f"{'> 0' if key == 'eps' else '>= 0'}, got {value!r}")
        if i < len(decays) and saved["weight_decay"] != decays[i]:
            raise UsageError(f"{where}: weight_decay {saved['weight_decay']!r} differs from "
                             f"the run's {decays[i]!r}")
        for key in ("amsgrad", "maximize"):
            if saved.get(key, False) is not False:
                raise UsageError(f"{where}: {key}={saved[key]!r}; the trainer's AdamW runs "
                                 f"with {key}=False")
    state = state_dict["state"]
    for i, (ours, saved) in enumerate(zip(groups, state_dict["param_groups"])):
        for j, (param, saved_id) in enumerate(zip(ours["params"], saved["params"])):
            entry = state.get(saved_id)
            if not entry:
                continue
            where = f"checkpoint {path}: optimizer state of parameter {j} in param group {i}"
            if set(entry) != set(ADAMW_STATE):
                raise UsageError(f"{where} holds {', '.join(sorted(map(str, entry)))}; AdamW's "
                                 f"is {', '.join(sorted(ADAMW_STATE))}")
            for key in ("exp_avg", "exp_avg_sq"):
                t = entry[key]
                if not isinstance(t, torch.Tensor) or not t.is_floating_point() \
                        or t.shape != param.shape:
                    what = (f"a {t.dtype} tensor of shape {list(t.shape)}"
                            if isinstance(t, torch.Tensor) else f"a {type(t).__name__}")
                    raise UsageError(f"{where}: {key} is {what}; it must be a floating tensor "
                                     f"of the parameter's shape {list(param.shape)}")
            step = entry["step"]
            if isinstance(step, torch.Tensor):
                step = step.item() if step.numel() == 1 and not step.is_complex() else None
            if not _is_real(step) or step < 0:
                raise UsageError(f"{where}: step must be one finite number >= 0, got "
                                 f"{entry['step']!r}")


def _check_gradient_order(order: Any, count: int, path: Any) -> None:
    """minddp's learned launch order: None, or a permutation of the trainable parameters'
    indices (``range(count)``)."""
    if order is None:
        return
    if (not isinstance(order, (list, tuple)) or not all(_is_int(i) for i in order)
            or sorted(order) != list(range(count))):
        shown = repr(order) if len(repr(order)) <= 80 else repr(order)[:77] + "..."
        raise UsageError(f"checkpoint {path}: its gradient_order must be a permutation of "
                         f"range({count}) (the model's trainable parameters), got {shown}")


def _check_scaler(scaler: Any, path: Any) -> None:
    """fp16's GradScaler state: None or empty, or a dict of finite numbers with a scale > 0."""
    if not scaler:
        return
    if not isinstance(scaler, dict) or not all(_is_real(v) for v in scaler.values()) \
            or not scaler.get("scale", 1.0) > 0:
        raise UsageError(f"checkpoint {path}: its gradient scaler state is not a dict of "
                         "finite numbers with a scale > 0")


def _check_rng(rng: Any, path: Any) -> None:
    """Try the saved CPU random state for real (and put ours back); the GPU one must at
    least be a byte tensor."""
    import torch

    if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
        raise UsageError(f"checkpoint {path}: its random state is not a dict with a 'cpu' "
                         "tensor")
    ours = torch.get_rng_state()
    try:
        torch.set_rng_state(rng["cpu"])
    except (RuntimeError, TypeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"checkpoint {path}: its CPU random state is unusable: {reason}") \
            from None
    finally:
        torch.set_rng_state(ours)
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8
                                 and cuda.dim() == 1):
        raise UsageError(f"checkpoint {path}: its GPU random state is not a byte tensor")
