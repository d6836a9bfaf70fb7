"""Draw each pipeline schedule's timeline as an SVG for docs/parallel.md.

The pictures come from the action lists themselves (``poptorch._runtime.schedule``):
each schedule is built for 4 stages and 8 micro-batches, laid out in time
(``Timeline.cells``: F one slot, B two, I, W, LOAD and STORE one each) and drawn one
row per device; the serial phased schedule (4 phases, 2 micro-batches) shows the loads
and stores of each phase's weights (``L`` / ``S``).

Run: ``.venv/bin/python scripts/schedule_svg.py`` (writes docs/images/schedule-*.svg).
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src" / "poptorch" / "_runtime"))  # the package alone
from schedule import schedules  # noqa: E402  (poptorch itself is not imported)
from schedule.timeline import Timeline  # noqa: E402

COLOURS = {"F": "#8ecae6", "B": "#ffb703", "I": "#fb8500", "W": "#90be6d",
           "LOAD": "#d9d9d9", "STORE": "#bdbdbd"}
SLOT, ROW, PAD = 22, 26, 70

CASES = [  # (file name, schedule, stage -> device)
    ("gpipe", "GPipe", [0, 1, 2, 3]),
    ("1f1b", "1F1B", [0, 1, 2, 3]),
    ("zero-bubble", "ZeroBubble", [0, 1, 2, 3]),
    ("1f1b-4-on-2", "1F1B", [0, 1, 0, 1]),
    ("interleaved-1f1b", "Interleaved1F1B", [0, 1, 0, 1]),
]


def timeline(name: str, placement: list[int], count: int = 8) -> Timeline:
    topo = schedules.Topology.chain(len(placement))
    lanes = schedules.pipeline_lanes(name, topo, placement, max(placement) + 1, count, True)
    return Timeline.of(name, lanes, topo)


def svg(t: Timeline) -> str:
    """One row per device; a box per action (its kind's colour, ``stage.micro-batch``)."""
    cells = t.cells()
    width, height = PAD + t.span() * SLOT + 10, 30 + len(cells) * ROW + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="9">',
           f'<text x="4" y="16" font-size="12">{t.name}: bubble fraction '
           f'{t.bubble_fraction():.3f}</text>']
    for d, lane in enumerate(cells):
        y = 26 + d * ROW
        out.append(f'<text x="4" y="{y + 15}" font-size="11">device {d}</text>')
        for start, slots, op in lane:
            x = PAD + start * SLOT
            out.append(f'<rect x="{x}" y="{y}" width="{slots * SLOT - 1}" height="{ROW - 4}" '
                       f'fill="{COLOURS[op.kind.value]}" stroke="#333" stroke-width="0.5"/>')
            label = (f"{op.kind.value}{op.stage}.{op.microbatch}" if op.microbatch >= 0
                     else f"{op.kind.value[0]}{op.stage}")  # (L0: LOAD0, S0: STORE0)
            out.append(f'<text x="{x + 2}" y="{y + 14}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    folder = ROOT / "docs" / "images"
    folder.mkdir(exist_ok=True)
    drawn = [(file, timeline(name, placement)) for file, name, placement in CASES]
    drawn.append(("serial-phased", Timeline.of(
        "serial phased", [schedules.serial_phased(range(4), 2, True)],
        schedules.Topology.chain(4))))
    for file, t in drawn:
        (folder / f"schedule-{file}.svg").write_text(svg(t))
        print(t.render(), end="\n\n")


if __name__ == "__main__":
    main()
