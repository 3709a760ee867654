#!/usr/bin/env python3
"""Draw docs/img/overview.svg (the parts of pitstop and what flows between them during a move),
docs/img/layers.svg (the packages of service/pitstop by layer, from the table that
tests/test_layers.py holds the imports to) and docs/img/dump-path.svg (the operation framework
and the one pause the coordinator's operations share; who dumps and sends a worker on the agent:
a move's capture, a pre-copy and a snapshot's part, through one path each).

Plain SVG written by hand (no plotting library needed): `python3 scripts/diagram.py` redraws all three.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "img" / "overview.svg"
LAYERS_OUT = ROOT / "docs" / "img" / "layers.svg"
DUMP_OUT = ROOT / "docs" / "img" / "dump-path.svg"
W, H = 960, 520


def box(x: int, y: int, w: int, h: int, title: str, lines: tuple[str, ...] = (), fill: str = "#eef3fb",
        stroke: str = "#35598f") -> str:
    out = [f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>',
           f'<text x="{x + w / 2}" y="{y + 20}" text-anchor="middle" font-weight="bold">{title}</text>']
    for i, ln in enumerate(lines):
        out.append(f'<text x="{x + w / 2}" y="{y + 40 + 16 * i}" text-anchor="middle" font-size="12">{ln}</text>')
    return "\n".join(out)


def arrow(x1: float, y1: float, x2: float, y2: float, label: str = "", dx: int = 0, dy: int = -6,
          color: str = "#444", dash: bool = False) -> str:
    d = ' stroke-dasharray="6 4"' if dash else ""
    out = [f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" stroke-width="1.6" '
           f'marker-end="url(#head)"{d}/>']
    if label:
        out.append(f'<text x="{(x1 + x2) / 2 + dx}" y="{(y1 + y2) / 2 + dy}" text-anchor="middle" '
                   f'font-size="12" fill="{color}">{label}</text>')
    return "\n".join(out)


def draw() -> str:
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="14">',
        '<defs><marker id="head" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
        '<path d="M0,0 L10,4 L0,8 z" fill="#444"/></marker></defs>',
        '<rect width="100%" height="100%" fill="white"/>',
        box(330, 20, 300, 80, "coordinator", ("REST API, SQLite, planner, driver", "consistent cut across every rank")),
        box(20, 30, 230, 60, "operator / scheduler", ("pitstop evacuate NODE, drain",), fill="#f6f6f6", stroke="#777"),
        arrow(250, 60, 330, 60, "evacuate"),
        # leaving host
        '<rect x="20" y="160" width="400" height="330" rx="10" fill="none" stroke="#999" stroke-dasharray="4 3"/>',
        '<text x="30" y="180" font-size="13" fill="#666">leaving host</text>',
        box(40, 195, 170, 110, "rank (unchanged)", ("pitstop run -- python train.py", "NCCL shim (LD_PRELOAD)",
                                                    "pitstop-init, own PID ns"), fill="#fff6e6", stroke="#b07a1f"),
        box(230, 195, 170, 110, "agent", ("pause at the cut", "capture, stream, commit", "or roll back")),
        box(40, 330, 360, 140, "capture", ("cuda-checkpoint: device memory to host",
                                           "CRIU dump (pre-copy: only pages written since)",
                                           "seal + digests of every image file",
                                           "images in /run/pitstop/images (tmpfs, root's)"), fill="#f2f8ee",
            stroke="#4d7f35"),
        arrow(230, 250, 210, 250, ""),
        arrow(315, 305, 315, 330, ""),
        # spare host
        '<rect x="540" y="160" width="400" height="330" rx="10" fill="none" stroke="#999" stroke-dasharray="4 3"/>',
        '<text x="550" y="180" font-size="13" fill="#666">spare host</text>',
        box(560, 195, 170, 110, "agent", ("verify manifest", "restore (CRIU, UFFDIO_COPY)", "register the rank")),
        box(750, 195, 170, 110, "rank, restored", ("same step, same handles", "communicators re-created",
                                                   "with new unique ids"), fill="#fff6e6", stroke="#b07a1f"),
        box(560, 330, 360, 140, "restore", ("CRIU restore from the received images",
                                            "cuda-checkpoint restore (UUID remap)",
                                            "post-copy: memory follows after resume"), fill="#f2f8ee",
            stroke="#4d7f35"),
        arrow(730, 250, 750, 250, ""),
        arrow(645, 330, 645, 305, ""),
        arrow(400, 400, 560, 400, "image stream (data port)", dy=-8),
        arrow(400, 420, 560, 420, "pre-copy while training", dy=18, dash=True),
        arrow(330, 100, 315, 195, "pause / resume", dx=-50),
        arrow(630, 100, 645, 195, "restore / rewire", dx=55),
        arrow(480, 320, 480, 100, "", color="#aaa", dash=True),
        '<text x="486" y="140" font-size="12" fill="#888">heartbeats</text>',
        '</svg>',
    ]
    return "\n".join(parts) + "\n"


def layers() -> list[tuple[str, set[str]]]:
    spec = importlib.util.spec_from_file_location("test_layers", ROOT / "tests" / "test_layers.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.LAYERS


def draw_layers() -> str:
    rows = layers()
    row_h, gap, left, width = 44, 14, 150, 780
    h = 30 + len(rows) * (row_h + gap)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 30}" height="{h}" '
             f'viewBox="0 0 {left + width + 30} {h}" font-family="Helvetica, Arial, sans-serif" font-size="13">',
             '<defs><marker id="head" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
             '<path d="M0,0 L10,4 L0,8 z" fill="#444"/></marker></defs>',
             '<rect width="100%" height="100%" fill="white"/>',
             arrow(22, 15, 22, h - 15, ""),
             f'<text x="0" y="0" transform="translate(38 {h / 2}) rotate(-90)" text-anchor="middle" '
             'font-size="12" fill="#444">imports go down, never up or sideways</text>']
    for i, (name, units) in enumerate(rows):
        y = 15 + i * (row_h + gap)
        shown = sorted(u for u in units if u != "__init__")
        ground = name == "ground"
        parts.append(f'<text x="{left - 10}" y="{y + row_h / 2 + 5}" text-anchor="end" fill="#666">{name}</text>')
        bw = (width - 8 * (len(shown) - 1)) / len(shown) if not ground else width
        if ground:
            parts.append(box(left, y, width, row_h, "", (" ".join(shown),), fill="#f6f6f6", stroke="#777")
                         .replace('y="' + str(y + 40) + '"', 'y="' + str(y + 27) + '"'))
            continue
        for j, u in enumerate(shown):
            x = left + j * (bw + 8)
            parts.append(f'<rect x="{x:.0f}" y="{y}" width="{bw:.0f}" height="{row_h}" rx="6" fill="#eef3fb" '
                         f'stroke="#35598f" stroke-width="1.3"/>')
            parts.append(f'<text x="{x + bw / 2:.0f}" y="{y + row_h / 2 + 5}" text-anchor="middle" '
                         f'font-weight="bold">{u}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def draw_dump_path() -> str:
    """Coordinator above, agent below: the operation framework and the one pause the coordinator's
    operations share, and how each kind of image is dumped and sent on the agent."""
    w, h = 960, 710
    coord, agent, shared = "#eef3fb", "#f2f8ee", "#fff6e6"

    def poly(points: str) -> str:
        return (f'<polyline points="{points}" fill="none" stroke="#444" stroke-width="1.6" '
                'marker-end="url(#head)"/>')

    def vlabel(x: int, y: int, text: str) -> str:
        return (f'<text x="{x}" y="{y}" font-size="12" fill="#444" text-anchor="middle" '
                f'transform="rotate(-90 {x} {y})">{text}</text>')

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="14">',
        '<defs><marker id="head" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
        '<path d="M0,0 L10,4 L0,8 z" fill="#444"/></marker></defs>',
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="40" y="24" font-size="13" fill="#666">coordinator</text>',
        box(40, 32, 900, 62, "one pause (pausing.py, cut.py)",
            ("stop / resume: one call per host, all hosts at once  \u00b7  JobHold: the snapshot's undo stack  "
             "\u00b7  through_agents: the NCCL cut",), fill=shared, stroke="#b07a1f"),
        '<rect x="28" y="116" width="594" height="136" rx="10" fill="none" stroke="#35598f" '
        'stroke-dasharray="6 4"/>',
        '<text x="40" y="134" font-size="12" fill="#35598f">operations.py, one framework: the journal, '
        'the phase table, the watchdog, the reconcile</text>',
        box(40, 145, 260, 95, "evacuation", ("evacuation_run.py: OpRun,", "rollback from the record"), fill=coord),
        box(350, 145, 260, 95, "recovery", ("recovery_run.py: RecoveryRun,", "run again from its start"),
            fill=coord),
        box(660, 145, 280, 95, "snapshot", ("snapshots.py: pause, lock, dump,", "resume; each way back on",
                                           "one JobHold"), fill=coord),
        arrow(170, 145, 170, 96, "pause", dx=24),
        arrow(480, 145, 480, 96, "resume", dx=28),
        arrow(800, 145, 800, 96, "pause", dx=24),
        '<line x1="20" y1="285" x2="940" y2="285" stroke="#bbb" stroke-dasharray="5 4"/>',
        '<text x="40" y="310" font-size="13" fill="#666">agent</text>',
        box(40, 325, 260, 95, "capture", ("capturing.py: stop the world,", "dump, send; one kind of four"),
            fill=agent),
        box(350, 325, 260, 95, "restore", ("receiving.py: one RestoreOptions,", "bring back, register",
                                           "(restore_views.py, leftovers.py)"), fill=agent),
        box(660, 325, 280, 95, "snapshot part", ("snapshots.py: leave_running,", "against the last part",
                                                "(part_tracking.py)"), fill=agent),
        box(40, 460, 260, 80, "pre-copies", ("precopies.py: memory ahead", "of the pause, kept as a basis"),
            fill=agent),
        box(350, 460, 260, 95, "one dump path", ("dumper.py: one DumpOptions,", "one start window per directory,",
                                                "incremental, else whole"), fill=shared, stroke="#b07a1f"),
        box(40, 595, 260, 80, "lazy pages", ("page_sources.py: served after", "a post-copy move"), fill=agent),
        box(350, 595, 260, 80, "sender", ("sending.py: data port or HTTP,", "compression per destination"),
            fill=shared, stroke="#b07a1f"),
        arrow(170, 240, 170, 325, "capture", dx=32),
        arrow(480, 240, 480, 325, "restore", dx=32),
        arrow(800, 240, 800, 325, "take a part", dx=42),
        arrow(170, 420, 170, 460, "its basis", dx=38),
        arrow(300, 400, 350, 480, "dump", dx=18, dy=-2),
        arrow(700, 420, 612, 480, "dump", dx=20, dy=-2),
        arrow(300, 505, 350, 505, "parent", dy=-6),
        arrow(480, 555, 480, 595, "images", dx=30),
        arrow(300, 525, 350, 620, "pre-copy", dx=-26, dy=10),
        poly("800,420 800,695 480,695 480,677"),
        '<text x="812" y="560" font-size="12" fill="#444">replicas</text>',
        poly("610,620 636,620 636,372 612,372"),
        vlabel(650, 500, "to the destination"),
        poly("40,380 22,380 22,635 38,635"),
        vlabel(16, 508, "post-copy"),
        "</svg>",
    ]
    return "\n".join(parts) + "\n"


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(draw())
    LAYERS_OUT.write_text(draw_layers())
    DUMP_OUT.write_text(draw_dump_path())
    print(OUT, LAYERS_OUT, DUMP_OUT)


if __name__ == "__main__":
    main()
