"""A study's venv, pinned to the package list its cells recorded.

Every cell of a study records the sha256 of its interpreter's package list
(``RESULTS/packages/HASH.txt``: ``name==version`` lines, sorted, under a Python line).
``make install`` resolves the newest versions the project's ranges allow, so on a fresh
machine it can build a venv that differs from the recorded one. This puts the recorded
versions back (``pip install --no-deps`` each one that differs, through the venv's own
pip and its configuration, ``pip uninstall`` what the list lacks) and checks the hash:

    python experiments/venv_pin.py --python /work/wt/study3/.venv/bin/python \\
        experiments/results/textworld-credit/packages/4650b9df...txt
    python experiments/venv_pin.py --check --python ... LIST   # only say what differs

It refuses (exit 2) what it cannot put back: another Python, or another version of the
project's own package (the worktree's commit sets that). Exit 1 when the venv still
differs afterwards (``--check``: when it differs). Imports nothing of the project's, so
it runs in any interpreter (``python experiments/venv_pin.py --list`` prints the running
interpreter's list).
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import subprocess
import sys
from pathlib import Path

PROJECT = "lachesis-rl"


def packages() -> tuple[str, str]:
    """The interpreter's installed distributions (``name==version``, sorted) and Python,
    and the sha256 of that text: the venv a cell ran in."""
    from importlib import metadata

    names = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                    if d.metadata["Name"]}, key=str.lower)
    text = f"# Python {platform.python_version()} {platform.machine()}\n" + "\n".join(names) + "\n"
    return text, hashlib.sha256(text.encode()).hexdigest()


def parse(text: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """(the Python line, lower-cased name -> (name, version))."""
    header, *lines = text.splitlines()
    return header, {line.split("==")[0].lower(): tuple(line.split("==", 1))
                    for line in lines if line}


def listing_of(python: Path) -> str:
    done = subprocess.run([str(python), __file__, "--list"], capture_output=True, text=True,
                          check=True)
    return done.stdout


def differences(recorded: str, current: str) -> tuple[list[str], list[str], list[str]]:
    """(``name==version`` to install, names to uninstall, why it cannot be pinned)."""
    (want_header, want), (have_header, have) = parse(recorded), parse(current)
    refused = []
    if want_header != have_header:
        refused.append(f"the list was recorded on {want_header[2:]}, this venv is "
                       f"{have_header[2:]}: build the venv with that Python")
    if want.get(PROJECT) != have.get(PROJECT):
        refused.append(f"{PROJECT}: recorded {want.get(PROJECT, ('', 'absent'))[1]}, here "
                       f"{have.get(PROJECT, ('', 'absent'))[1]} (the worktree's commit sets "
                       "the project's own version)")
    install = [f"{name}=={version}" for key, (name, version) in sorted(want.items())
               if key != PROJECT and have.get(key, ("", None))[1] != version]
    remove = [name for key, (name, _) in sorted(have.items()) if key not in want]
    return install, remove, refused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("listing", nargs="?", type=Path, help="a recorded packages/HASH.txt")
    parser.add_argument("--python", type=Path, default=Path(".venv/bin/python"),
                        help="the venv's interpreter (default .venv/bin/python)")
    parser.add_argument("--check", action="store_true", help="only say what differs")
    parser.add_argument("--list", action="store_true",
                        help="print this interpreter's package list and exit")
    args = parser.parse_args()
    if args.list:
        sys.stdout.write(packages()[0])
        return 0
    if args.listing is None:
        parser.error("a recorded package list (RESULTS/packages/HASH.txt) is needed")
    recorded = args.listing.read_text()
    wanted = hashlib.sha256(recorded.encode()).hexdigest()
    if args.listing.stem != wanted:
        print(f"{args.listing}: its text hashes to {wanted[:12]}..., not its name",
              file=sys.stderr)
        return 2
    install, remove, refused = differences(recorded, listing_of(args.python))
    for line in refused:
        print(f"cannot pin: {line}", file=sys.stderr)
    if refused:
        return 2
    for spec in install:
        print(f"differs: {spec} recorded")
    for name in remove:
        print(f"differs: {name} not in the list")
    if not (install or remove):
        print(f"{args.python}: the recorded list ({wanted[:12]}...)")
        return 0
    if args.check:
        print(f"{args.python}: differs ({wanted[:12]}...)")
        return 1
    if install:
        subprocess.run([str(args.python), "-m", "pip", "install", "-q", "--no-deps", *install],
                       check=True)
    if remove:
        subprocess.run([str(args.python), "-m", "pip", "uninstall", "-q", "-y", *remove],
                       check=True)
    now = hashlib.sha256(listing_of(args.python).encode()).hexdigest()
    print(f"{args.python}: {len(install)} installed, {len(remove)} removed; its list "
          f"{'is the recorded one' if now == wanted else 'still differs'} ({now[:12]}...)")
    return 0 if now == wanted else 1


if __name__ == "__main__":
    sys.exit(main())
