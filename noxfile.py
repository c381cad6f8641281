"""Sessions for the lab2 workspace. A bare ``nox`` runs what CI runs.

Every session installs the workspace from ``uv.lock`` (``uv sync --locked``) into
its own virtual environment, so a session checks exactly what the lock pins.
"""

from __future__ import annotations

import glob
import os
import shutil
import tarfile
import zipfile

import nox

nox.needs_version = ">=2024.10"
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "build", "triton-interpret", "tests", "tests-hf", "tests-gloo"]

# Let the sessions' interpreters cache bytecode even where the environment says not to:
# without .pyc files every test process (and every rank it spawns) compiles torch's
# sources again, which costs 10-20 s per process on a small CI machine.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

MEMBERS = ("tritonnorm", "minddp", "zero1", "minitp", "lab2bench", "lab2sys", "lab2-trainer")
WORLD_SIZES = [1, 2, 3, 4]


def _sync(session: nox.Session) -> None:
    """Install every member and the dev group, exactly as locked, into the session's venv."""
    session.run_install(
        "uv", "sync", "--locked", "--group", "dev",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _pytest(session: nox.Session, *args: str, **env: str) -> None:
    session.run("python", "-m", "pytest", *args, *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole workspace."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session
def tests(session: nox.Session) -> None:
    """Every member's unit and property-based tests on the CPU (Gloo and Triton apart)."""
    _sync(session)
    _pytest(session, "-m", "not gloo and not triton", "-p", "no:cacheprovider")


@nox.session(name="triton-interpret")
def triton_interpret(session: nox.Session) -> None:
    """The Triton kernels, run on the CPU by Triton's interpreter."""
    _sync(session)
    _pytest(session, "-m", "triton", "-p", "no:cacheprovider", TRITON_INTERPRET="1")


#: The transformers releases tritonnorm's Hugging Face drop-in is tested with (4.57 and 5.24).
TRANSFORMERS = "transformers>=4.57,<5.25"


@nox.session(name="tests-hf")
def tests_hf(session: nox.Session) -> None:
    """tritonnorm's drop-in and minitp's Llama plan on tiny Hugging Face models (built from
    their configs, nothing downloaded): the swapped norms on the Triton kernels under the
    interpreter, the sharded Llama on two Gloo ranks."""
    _sync(session)
    session.install(TRANSFORMERS)
    _pytest(session, "-m", "hf", "-p", "no:cacheprovider", "packages/tritonnorm/tests/hf",
            "packages/minitp/tests/hf", TRITON_INTERPRET="1")


@nox.session(name="tests-gloo")
@nox.parametrize("world_size", WORLD_SIZES)
def tests_gloo(session: nox.Session, world_size: int) -> None:
    """One cell of the CPU Gloo matrix: every distributed test at one world size."""
    _sync(session)
    _pytest(session, "-m", "gloo", "-p", "no:cacheprovider", LAB2_WORLD_SIZES=str(world_size))


#: What each member's wheel is installed with for its smoke test (testing/smoke/).
SMOKE_EXTRAS = {"tritonnorm": "interpret"}
#: Environment of each smoke test: tritonnorm's runs its kernels under Triton's interpreter.
SMOKE_ENV = {"tritonnorm": {"TRITON_INTERPRET": "1"}}
#: Console scripts checked in each wheel's environment.
SCRIPTS = {"lab2bench": "lab2bench", "lab2-trainer": "lab2-train"}


def _build(session: nox.Session, name: str, *kinds: str) -> str:
    """Build every member (``kinds``: ``--wheel`` and/or ``--sdist``) into a fresh folder."""
    out = os.path.abspath(os.path.join(session.create_tmp(), name))
    shutil.rmtree(out, ignore_errors=True)
    session.run("uv", "build", "--all-packages", *kinds, "--out-dir", out, external=True)
    return out


def _one(session: nox.Session, out: str, dist_name: str, suffix: str) -> str:
    found = glob.glob(os.path.join(out, f"{dist_name.replace('-', '_')}-*{suffix}"))
    if len(found) != 1:
        session.error(f"expected one {suffix} of {dist_name} in {out}, found {found}")
    return found[0]


def _check_license(session: nox.Session, path: str) -> None:
    """The repository's LICENSE is in the wheel or sdist at ``path``, word for word."""
    with open("LICENSE", "rb") as f:
        text = f.read()
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
            ok = len(names) == 1 and z.read(names[0]) == text
    else:
        with tarfile.open(path) as t:
            members = [m for m in t.getmembers() if m.name.count("/") == 1
                       and m.name.endswith("/LICENSE")]
            ok = len(members) == 1 and t.extractfile(members[0]).read() == text
    if not ok:
        session.error(f"{os.path.basename(path)} lacks the repository's LICENSE")


def _smoke(session: nox.Session, out: str, dist_name: str) -> None:
    """Install one member's wheel alone into a fresh venv, then run its smoke test there."""
    module = dist_name.replace("-", "_")
    wheel = _one(session, out, dist_name, ".whl")
    _check_license(session, wheel)
    venv = os.path.join(out, f"venv-{module}")
    session.run("uv", "venv", "-q", venv, external=True)
    py = os.path.join(venv, "bin", "python")
    extra = f"[{SMOKE_EXTRAS[dist_name]}]" if dist_name in SMOKE_EXTRAS else ""
    # Only this wheel comes from disk; its dependencies (the other members too)
    # come from the dist folder where needed, and the package index otherwise.
    session.run("uv", "pip", "install", "-q", "--python", py, "--find-links", out,
                f"{dist_name}{extra} @ file://{wheel}", external=True)
    # __version__ must be the wheel's own version (both are written by hand).
    session.run(py, "-c", f"import importlib.metadata as m, {module}; v = {module}.__version__; "
                f"assert v == m.version('{dist_name}'), v; print({module}.__name__, v)",
                external=True)
    if dist_name in SCRIPTS:
        session.run(os.path.join(venv, "bin", SCRIPTS[dist_name]), "--version", external=True)
    # Run from a neutral folder, so that nothing of the workspace can be imported instead.
    script = os.path.abspath(os.path.join("testing", "smoke", f"smoke_{module}.py"))
    with session.chdir(out):
        session.run(py, script, env=SMOKE_ENV.get(dist_name, {}), external=True)


@nox.session
def build(session: nox.Session) -> None:
    """Build every wheel, then install each alone into a fresh venv and run its smoke test
    (testing/smoke/): tritonnorm's runs its Triton kernels under the interpreter."""
    session.install("uv")
    out = _build(session, "wheels", "--wheel")
    for dist_name in MEMBERS:
        _smoke(session, out, dist_name)


@nox.session(default=False)
def publish(session: nox.Session) -> None:
    """Build every sdist and wheel, check them, and upload them with `uv publish` when
    UV_PUBLISH_TOKEN is set (UV_PUBLISH_URL picks another index, e.g. TestPyPI's
    https://test.pypi.org/legacy/). Never run by a bare `nox`: `nox -s publish`."""
    session.install("uv", "twine>=6.1", "trove-classifiers")
    out = _build(session, "dist", "--sdist", "--wheel")
    files = sorted(glob.glob(os.path.join(out, "*.whl")) + glob.glob(os.path.join(out, "*.tar.gz")))
    upload = bool(os.environ.get("UV_PUBLISH_TOKEN"))
    session.run("twine", "check", "--strict", *files)
    session.run("python", ".ci/check_dists.py", *(["--upload"] if upload else []), *files)
    for dist_name in MEMBERS:
        _check_license(session, _one(session, out, dist_name, ".tar.gz"))
        _smoke(session, out, dist_name)
    if not upload:
        session.log(f"UV_PUBLISH_TOKEN is not set: {len(files)} files built and checked in "
                    f"{out}, nothing uploaded")
        return
    session.run("uv", "publish", *files, external=True)

