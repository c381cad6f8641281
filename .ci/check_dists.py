"""Check built distributions' metadata before an upload: ``check_dists.py [--upload] FILE...``.

Every classifier must be one the index knows (an unknown one makes an upload fail half-way
through the members), and, with ``--upload``, every distribution must link to its source
(``[project.urls]``: the index page's only way back to the repository); without it a missing
link is a warning. Needs the ``trove-classifiers`` package.
"""

import email
import email.message
import sys
import tarfile
import zipfile

from trove_classifiers import classifiers, deprecated_classifiers


def metadata(path: str) -> email.message.Message:
    """The core metadata of a wheel (METADATA) or an sdist (PKG-INFO)."""
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            raw = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    else:
        with tarfile.open(path) as t:
            raw = t.extractfile(next(m for m in t.getmembers()
                                     if m.name.count("/") == 1
                                     and m.name.endswith("/PKG-INFO"))).read()
    return email.message_from_bytes(raw)


def main(argv: list[str]) -> int:
    upload = "--upload" in argv
    failed = False
    for path in (a for a in argv if a != "--upload"):
        meta = metadata(path)
        problems = [f"unknown or deprecated classifier {c!r}"
                    for c in meta.get_all("Classifier") or []
                    if c not in classifiers or c in deprecated_classifiers]
        if not meta.get_all("Project-URL"):
            missing = "no project URLs ([project.urls] in its pyproject.toml)"
            if upload:
                problems.append(missing)
            else:
                print(f"{path}: warning: {missing}; needed before an upload")
        for problem in problems:
            print(f"{path}: {problem}")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
