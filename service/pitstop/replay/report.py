"""A replay's result as an operator reads it: a Markdown report, JSON, and an SVG chart (no
plotting library: the chart is a few rectangles, written out directly)."""

from __future__ import annotations

from dataclasses import asdict
from html import escape
from typing import Any

from pitstop.replay.model import Result


def as_dict(r: Result, sens: list[dict] | None = None) -> dict[str, Any]:
    return {"inputs": asdict(r.inputs), "duration_h": r.duration_h, "events": r.events, "planned": r.planned,
            "unplanned": r.unplanned, "lost_gpu_h": {"pitstop": r.lost_pitstop_gpu_h,
                                                     "checkpoint_restart": r.lost_restart_gpu_h},
            "saved_gpu_h": r.saved_gpu_h, "wait_for_spare_gpu_h": r.wait_gpu_h,
            "unplanned_lost_work_gpu_h": r.unplanned_lost_work_gpu_h,
            "common": {"checkpoints_gpu_h": r.checkpoints_gpu_h, "spares_idle_gpu_h": r.spares_idle_gpu_h},
            "break_even_move_pause_s": r.break_even_move_pause_s,
            "coverage": {d: asdict(c) | {"covered_share": c.covered_share} for d, c in r.coverage.items()},
            "sensitivity": sens or []}


def _n(x: float) -> str:
    return f"{x:,.1f}"


def markdown(r: Result, sens: list[dict], source: str) -> str:
    i = r.inputs
    lines = [
        f"# Replay: {r.events} events over {r.duration_h / 24:,.1f} days, a job of {i.job_gpus:,} GPUs",
        "",
        f"Trace: {source}. {r.planned} planned events (maintenance, drains), {r.unplanned} unplanned (hosts died).",
        f"Inputs: move pause {i.move_pause_s:g} s; checkpoint-restart {i.restart_s:g} s to restart and "
        f"{i.checkpoint_save_s:g} s to save, a checkpoint every {i.checkpoint_interval_h:g} h; spares "
        f"{i.spares_per_domain} per domain and {i.pooled_spares} pooled, back {i.repair_h:g} h after use.",
        "",
        "| GPU-hours lost to the events | pitstop | checkpoint-restart |",
        "|---|---|---|",
        f"| total | {_n(r.lost_pitstop_gpu_h)} | {_n(r.lost_restart_gpu_h)} |",
        f"| of which work since the last checkpoint (unplanned) | | {_n(r.unplanned_lost_work_gpu_h)} |",
        f"| of which waiting for spares | | {_n(r.wait_gpu_h)} |",
        "",
        f"pitstop saves **{_n(r.saved_gpu_h)} GPU-hours** "
        f"({r.saved_gpu_h / r.lost_restart_gpu_h:+.1%} of checkpoint-restart's loss)." if r.lost_restart_gpu_h else
        f"pitstop saves **{_n(r.saved_gpu_h)} GPU-hours**.",
        (f"It breaks even at a move pause of {r.break_even_move_pause_s:g} s (the planned events' "
         "checkpoint-restart cost); below that every planned move saves." if r.break_even_move_pause_s else
         "No planned event: pitstop changes nothing here."),
        "Unplanned events cost the same with and without pitstop: it moves only hosts that still run.",
        "",
        f"Common to both, not counted above: the job's checkpoints {_n(r.checkpoints_gpu_h)} GPU-hours; "
        f"the spares held idle {_n(r.spares_idle_gpu_h)} GPU-hours.",
        "",
        "## Sensitivity: pitstop's saving with each input halved and doubled (spares: one less, one more)",
        "",
        "| input | value | low | saved at low | high | saved at high |",
        "|---|---|---|---|---|---|",
    ]
    for s in sens:
        lo, hi = s.get("low_saved_gpu_h"), s.get("high_saved_gpu_h")
        lines.append(f"| {s['input']} | {s['value']:g} | {s['low_value']:g} | {'-' if lo is None else _n(lo)} | "
                     f"{s['high_value']:g} | {'-' if hi is None else _n(hi)} |")
    lines += ["", "## Coverage by failure domain", "",
              "| domain | events | own spare | pooled spare | waited | wait (h) | covered by its own spares |",
              "|---|---|---|---|---|---|---|"]
    for d, c in sorted(r.coverage.items(), key=lambda kv: -kv[1].events):
        lines.append(f"| {d} | {c.events} | {c.own_spare} | {c.pooled} | {c.waited} | {c.wait_h:,.1f} | "
                     f"{c.covered_share:.0%} |")
    return "\n".join(lines) + "\n"


def svg(r: Result, sens: list[dict]) -> str:
    """Two panels: GPU-hours lost by method, and the saving's range per input."""
    w, bar_h, gap, left = 760, 22, 8, 230
    rows = [("pitstop", r.lost_pitstop_gpu_h, "#2b7bb9"), ("checkpoint-restart", r.lost_restart_gpu_h, "#c0504d"),
            ("checkpoints (both)", r.checkpoints_gpu_h, "#999999"), ("spares idle (both)", r.spares_idle_gpu_h, "#bbbbbb")]
    top = max(v for _, v, _ in rows) or 1.0
    out = [f'<text x="10" y="22" font-size="15" font-weight="bold">GPU-hours lost over {r.duration_h / 24:,.1f} '
           f'days ({r.events} events, {r.inputs.job_gpus:,} GPUs)</text>']
    y = 36
    for name, v, colour in rows:
        bw = (w - left - 90) * v / top
        out.append(f'<text x="{left - 8}" y="{y + 15}" font-size="12" text-anchor="end">{escape(name)}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{bw:.1f}" height="{bar_h}" fill="{colour}"/>')
        out.append(f'<text x="{left + bw + 6:.1f}" y="{y + 15}" font-size="12">{v:,.0f}</text>')
        y += bar_h + gap
    y += 24
    out.append(f'<text x="10" y="{y}" font-size="15" font-weight="bold">pitstop\'s saving (GPU-hours) with each '
               'input halved / doubled</text>')
    y += 14
    vals = [x for s in sens for x in (s.get("low_saved_gpu_h"), s.get("high_saved_gpu_h"), s["base_saved_gpu_h"])
            if x is not None]
    lo, hi = min(vals + [0.0]), max(vals + [0.0])
    span = (hi - lo) or 1.0

    def xof(v: float) -> float:
        return left + (w - left - 90) * (v - lo) / span

    zero = xof(0.0)
    y0 = y
    for s in sens:
        a, b = s.get("low_saved_gpu_h"), s.get("high_saved_gpu_h")
        pts = [x for x in (a, b, s["base_saved_gpu_h"]) if x is not None]
        x1, x2 = xof(min(pts)), xof(max(pts))
        out.append(f'<text x="{left - 8}" y="{y + 15}" font-size="12" text-anchor="end">{escape(s["input"])}</text>')
        out.append(f'<rect x="{x1:.1f}" y="{y}" width="{max(1.0, x2 - x1):.1f}" height="{bar_h}" fill="#8aa9c9"/>')
        out.append(f'<line x1="{xof(s["base_saved_gpu_h"]):.1f}" y1="{y}" x2="{xof(s["base_saved_gpu_h"]):.1f}" '
                   f'y2="{y + bar_h}" stroke="#000"/>')
        y += bar_h + gap
    out.append(f'<line x1="{zero:.1f}" y1="{y0 - 4}" x2="{zero:.1f}" y2="{y}" stroke="#c0504d" stroke-dasharray="4 3"/>')
    out.append(f'<text x="{zero:.1f}" y="{y + 14}" font-size="11" text-anchor="middle">0</text>')
    out.append(f'<text x="{left}" y="{y + 14}" font-size="11">{lo:,.0f}</text>')
    out.append(f'<text x="{w - 90}" y="{y + 14}" font-size="11" text-anchor="end">{hi:,.0f}</text>')
    h = y + 30
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'font-family="sans-serif"><rect width="{w}" height="{h}" fill="#fff"/>' + "".join(out) + "</svg>\n")
