"""Sessions for the lab2 workspace. A bare ``nox`` runs what CI runs.

Every session installs the workspace from ``uv.lock`` (``uv sync --locked``) into
its own virtual environment, so a session checks exactly what the lock pins.
"""

from __future__ import annotations

import glob
import os
import shutil

import nox

nox.needs_version = ">=2024.10"
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "build", "triton-interpret", "tests", "tests-gloo"]

# Let the sessions' interpreters cache bytecode even where the environment says not to:
# without .pyc files every test process (and every rank it spawns) compiles torch's
# sources again, which costs 10-20 s per process on a small CI machine.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

MEMBERS = ("tritonnorm", "minddp", "zero1", "lab2bench", "lab2-trainer")
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


@nox.session(name="tests-gloo")
@nox.parametrize("world_size", WORLD_SIZES)
def tests_gloo(session: nox.Session, world_size: int) -> None:
    """One cell of the CPU Gloo matrix: every distributed test at one world size."""
    _sync(session)
    _pytest(session, "-m", "gloo", "-p", "no:cacheprovider", LAB2_WORLD_SIZES=str(world_size))


@nox.session
def build(session: nox.Session) -> None:
    """Build every wheel, then install each alone into a fresh venv and import it."""
    session.install("uv")
    out = os.path.join(session.create_tmp(), "wheels")
    shutil.rmtree(out, ignore_errors=True)
    session.run("uv", "build", "--all-packages", "--wheel", "--out-dir", out, external=True)
    for dist_name in MEMBERS:
        module = dist_name.replace("-", "_")
        wheels = glob.glob(os.path.join(out, f"{module}-*.whl"))
        if len(wheels) != 1:
            session.error(f"expected one wheel for {dist_name} in {out}, found {wheels}")
        venv = os.path.join(out, f"venv-{module}")
        session.run("uv", "venv", "-q", venv, external=True)
        py = os.path.join(venv, "bin", "python")
        # Only this wheel comes from disk; its dependencies (the other members too)
        # come from the dist folder where needed, and the package index otherwise.
        session.run("uv", "pip", "install", "-q", "--python", py, "--find-links", out,
                    wheels[0], external=True)
        session.run(py, "-c", f"import {module}; print({module}.__name__, {module}.__version__)",
                    external=True)
