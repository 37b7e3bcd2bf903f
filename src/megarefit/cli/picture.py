"""``megarefit plan --svg FILE``: which trainer rank's bytes go to which receiver, and how many
of them are strided (through scratch), as two heat maps (matplotlib, ``pip install
'megarefit[bench]'``; SVG, PNG or PDF by the file's suffix)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarefit.errors import MegarefitError

FORMATS = ("svg", "png", "pdf")  # file suffixes draw() writes (matplotlib picks the format by the suffix)


def bytes_matrix(plans: Sequence[Any]) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """(trainer rank labels, bytes[rank][receiver], strided bytes[rank][receiver]) of ``plans``,
    one plan per receiver (a vLLM worker, or the one HF receiver)."""
    summaries = [p.summary()["per_rank"] for p in plans]
    ranks = sorted({r for s in summaries for r in s if r is not None})
    labels = [f"tp{r.tp} pp{r.pp} ep{r.ep}" for r in ranks]
    pulled = [[s.get(r, {}).get("bytes", 0) for s in summaries] for r in ranks]
    strided = [[s.get(r, {}).get("scratch_bytes", 0) for s in summaries] for r in ranks]
    return labels, pulled, strided


def check_picture_path(path: str) -> None:
    """Raise :class:`MegarefitError` unless ``path``'s suffix is one of :data:`FORMATS`."""
    if Path(path).suffix.lower().removeprefix(".") not in FORMATS:
        raise MegarefitError(f"cannot draw {path!r}: the file's suffix picks the format, one of "
                             f"{', '.join('.' + f for f in FORMATS)}")


def draw(path: str, plans: Sequence[Any], receivers: Sequence[str], title: str) -> None:
    """Write the picture of ``plans`` (one per receiver, labelled ``receivers``) to ``path``.

    Raises:
        MegarefitError: ``path``'s suffix is not one of :data:`FORMATS`, or matplotlib is not
            installed (names the extra to install)."""
    check_picture_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MegarefitError("--svg needs matplotlib: pip install 'megarefit[bench]'") from None
    labels, pulled, strided = bytes_matrix(plans)
    height = max(3.0, 0.28 * len(labels) + 1.5)
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.1 * len(receivers) * 2, height), squeeze=False)
    for ax, values, name in zip(axes[0], (pulled, strided), ("bytes pulled (GB)", "of which strided, via scratch (GB)")):
        gb = [[v / 1e9 for v in row] for row in values]
        image = ax.imshow(gb, aspect="auto", cmap="viridis")
        ax.set_title(name, fontsize=10)
        ax.set_xticks(range(len(receivers)), receivers, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("receiver")
        ax.set_ylabel("trainer rank")
        top = max((v for row in gb for v in row), default=0.0)
        if len(labels) * len(receivers) <= 256:
            for i, row in enumerate(gb):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2f}" if v else "-", ha="center", va="center", fontsize=6,
                            color="black" if top and v > top / 2 else "white")
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = ["FORMATS", "bytes_matrix", "check_picture_path", "draw"]
