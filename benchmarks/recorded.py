"""The ``--record`` / ``--from-json`` main that benchmarks of one recorded result share.

A benchmark of this kind measures one result (a JSON object), may record it, and prints its
table from that result; the docs' generated blocks (benchmarks/render_docs.py) print the table
of the recorded file again::

    python benchmarks/bench_x.py [options] [--record docs/x.jsonl]   # measure, record, print the table
    python benchmarks/bench_x.py --from-json docs/x.jsonl            # the recorded table (its last line)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def recorded_main(ap: argparse.ArgumentParser, measure: Callable[[argparse.Namespace], dict[str, Any]],
                  print_table: Callable[[dict[str, Any]], None], argv: list[str] | None = None) -> None:
    """Add ``--record FILE`` and ``--from-json FILE`` to ``ap`` and run: with ``--from-json``,
    print the table of the file's last line (a result written by ``--record``) and measure
    nothing; else ``measure(namespace)``, write its result to ``--record`` (one JSON line, the
    file replaced) where given, and print its table. ``argv``: the arguments (default
    ``sys.argv[1:]``)."""
    ap.add_argument("--record", help="write the result to this JSONL file")
    ap.add_argument("--from-json", help="print the table of a recorded file and exit")
    ns = ap.parse_args(argv)
    if ns.from_json:
        print_table(json.loads(Path(ns.from_json).read_text().splitlines()[-1]))
        return
    result = measure(ns)
    if ns.record:
        Path(ns.record).write_text(json.dumps(result) + "\n")
    print_table(result)
