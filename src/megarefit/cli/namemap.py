"""``megarefit name-map``: print a Megatron -> HF name map, optionally checked against Megatron-Bridge."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from megarefit.layout import RankCoord
from megarefit.planner.namemap import NameMapEntry, NameMapReport, compare, name_map


def _span(values: set[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else (f"{lo}-{hi}" if len(values) == hi - lo + 1 else ",".join(map(str, sorted(values))))


def ranks_text(ranks: tuple[RankCoord, ...]) -> str:
    """``tp0-1 pp0 ep0-1`` for the ranks holding a parameter (their span per dimension)."""
    return " ".join(f"{dim}{_span({getattr(r, dim) for r in ranks})}" for dim in ("tp", "pp", "ep"))


def _hf_text(hf: tuple[str, ...] | None) -> str:
    if hf is None:
        return ""
    return "\n".join(hf[:4]) + (f"\n... {len(hf) - 4} more" if len(hf) > 4 else "")


def name_map_table(entries: list[NameMapEntry], *, bridge: bool) -> Table:
    table = Table(show_lines=False, title="Megatron -> HF name map" + (" (vs Megatron-Bridge)" if bridge else ""))
    for col in ("Megatron parameter (global)", "ranks", "role", "HF"):
        table.add_column(col, no_wrap=col != "role")
    if bridge:
        table.add_column("Bridge mapping")
        table.add_column("agrees")
    bad = {d.megatron for d in compare(entries)}
    for e in entries:
        role = f"{e.role} ({e.parallel})" + (" tied copy, not exported" if e.duplicate else "") + (
            f"; {e.transform}" if e.transform else "")
        row = [escape(e.megatron), ranks_text(e.ranks), escape(role), escape(_hf_text(e.hf))]
        if bridge:
            row += [escape(e.other_kind) if e.other_kind else "[red]none[/]",
                    "[red]no[/]" if e.megatron in bad else "yes"]
        table.add_row(*row)
    return table


def cmd_name_map(args: argparse.Namespace, console: Console, config: Any, dims: Any, layout: Any) -> int:
    entries = name_map(dims, layout)
    report = NameMapReport(dims.family, layout.to_dict(), entries)
    if args.from_bridge:
        from megarefit.integrations.bridge import bridge_name_map, bridge_patterns, bridge_version

        config = dict(config) if isinstance(config, dict) else config.to_dict()
        report.entries = bridge_name_map(entries, config)
        report.source = f"megarefit vs Megatron-Bridge {bridge_version()}"
        report.disagreements = compare(report.entries)
        if args.patterns:
            patterns = Table(title="Megatron-Bridge mapping registry")
            for col in ("Megatron pattern", "HF pattern(s)", "mapping"):
                patterns.add_column(col, overflow="fold")
            for p in bridge_patterns(config):
                patterns.add_row(escape(p.megatron), escape("\n".join(p.hf)), escape(p.kind))
            console.print(patterns)
    if args.format == "json":
        print(report.to_json())
    else:
        console.print(f"{dims.family}: {len(entries)} Megatron parameters; layout tp={layout.tp} pp={layout.pp} "
                      f"ep={layout.ep} etp={layout.etp}, {layout.layer_spec} spec, {layout.expert_layout} experts")
        console.print(name_map_table(report.entries, bridge=args.from_bridge))
        if args.from_bridge:
            if report.disagreements:
                console.print(f"[bold red]{len(report.disagreements)} disagreement(s) with Megatron-Bridge:[/]")
                for d in report.disagreements:
                    console.print(f"  {escape(str(d))}")
            else:
                console.print("megarefit's table and Megatron-Bridge agree on every parameter.")
    return 1 if report.disagreements else 0
