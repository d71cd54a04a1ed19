"""``python -m model.train.data prepare [--out DIR] [--cache DIR] [--corpus NAME ...]``
and ``python -m model.train.data packages`` (refresh the Debian package list of v2)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model.train.data.debian_l10n import refresh_package_list
from model.train.data.prepare import CORPORA, PROSE, V2, prepare
from model.train.data.sources import SourceError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.train.data",
                                     description="Build the training corpora from their sources.")
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="fetch sources, clean, de-duplicate, split, write a manifest")
    prep.add_argument("--out", type=Path, default=Path("data/corpora"), help="where the corpora go")
    prep.add_argument("--cache", type=Path, default=Path("data/cache"), help="where raw downloads go")
    prep.add_argument("--corpus", action="append", choices=(*CORPORA, V2, PROSE), help="build only these (repeatable)")
    prep.add_argument("--no-system-catalogues", action="store_true",
                      help="leave out the German catalogues installed on this system")
    sub.add_parser("packages", help="re-read Debian's Contents indexes and rewrite debian-de-packages.txt")
    args = parser.parse_args(argv)
    if args.command == "packages":
        print(f"{len(refresh_package_list())} packages listed")
        return 0
    try:
        prepare(args.out, args.cache, tuple(args.corpus or CORPORA), not args.no_system_catalogues)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
