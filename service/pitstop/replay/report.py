"""A replay's study (study.py) as an operator reads it: a Markdown report and an SVG chart (no
plotting library: the chart is a few rectangles, written out directly).  --json prints
study.public() itself."""

from __future__ import annotations

from html import escape
from typing import Any


def _n(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _h(x: float | None) -> str:
    if x is None:
        return "none"
    return f"{x * 60:,.1f} min" if x < 2 else f"{x:,.1f} h"


def _summary(d: dict[str, Any], source: str) -> list[str]:
    """The history in a paragraph, and the head of the per-event table."""
    j = d["job"]
    return [
        f"# Replay: {d['events']} events over {d['duration_h'] / 24:,.1f} days, a job of {j['gpus']:,} "
        f"{'GPUs' if j['ranks'] == 'gpu' else 'CPU ranks'}",
        "",
        f"**{d['model'][0].upper() + d['model'][1:]}.** Trace: {source}. {d['planned']} planned events (maintenance, drains), "
        f"{d['unplanned']} unplanned (hosts died) in {d['failures']} failures of the job"
        + (f" (one every {d['mtbf_h']:,.2f} h)" if d["mtbf_h"] else "") + f". Spares {j['spares_per_domain']} per domain and {j['pooled_spares']} pooled, back "
        f"{j['repair_h']:g} h after use. pitstop's rewire "
        + ("inside each pause (every communicator re-created at the job's size)." if j["rewire_on_path"] else
           "off the critical path (a what-if: not built)."),
        "",
        "| per event, in the job's seconds | " + " | ".join(f"{s}: pitstop | {s}: checkpoint-restart"
                                                          for s in d["stacks"]) + " |",
        "|---|" + "---|---|" * len(d["stacks"]),
    ]


def _costs(d: dict[str, Any]) -> list[str]:
    """Each event's cost in the job's seconds, then the GPU-hours lost, per stack and method."""
    lines: list[str] = []
    rows = [("a planned event (pitstop: a move)", lambda c: c["planned_s"]),
            ("a failure: detection", lambda c: c["detection_s"]),
            ("a failure: pause (pitstop: the recovery; else the restart)", lambda c: c["recover_s"]),
            ("snapshots / checkpoints every (h)", lambda c: c["every_h"]),
            ("each snapshot / checkpoint costs the job", lambda c: c["each_s"])]
    for label, f in rows:
        cells = []
        for run in d["stacks"].values():
            cells += [_n(f(run["costs"]["pitstop"]), 2), _n(f(run["costs"]["checkpoint_restart"]), 2)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| GPU-hours | " + " | ".join(f"{s}: pitstop | {s}: checkpoint-restart" for s in d["stacks"]) + " |",
              "|---|" + "---|---|" * len(d["stacks"])]
    for label, key in (("lost to the events, all told", "total"), ("planned events", "planned_gpu_h"),
                       ("failures: detection and pause", "unplanned_gpu_h"), ("work redone", "work_gpu_h"),
                       ("pitstop's snapshots", "periodic_gpu_h")):
        cells = []
        for run in d["stacks"].values():
            cells += [_n(run["lost_gpu_h"]["pitstop"][key], 0), _n(run["lost_gpu_h"]["checkpoint_restart"][key], 0)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for kind, label in (("planned", "per planned event"), ("failure", "per failure")):
        cells = []
        for run in d["stacks"].values():
            g = run["per_event"][kind]["gpu_h"]
            cells += [_n(g["pitstop"]), _n(g["checkpoint_restart"])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _stacks(d: dict[str, Any]) -> list[str]:
    """Per stack: the saving, the snapshot interval, the break-even rates, where pitstop loses."""
    lines = [""]
    for s, run in d["stacks"].items():
        be = run["break_even"]
        iv = be["snapshot_interval"]
        share = run["saved_share"]
        lines.append(f"**{s.capitalize()} stack.** pitstop saves **{_n(run['saved_gpu_h'], 0)} GPU-hours**"
                     + (f" ({share:+.1%} of checkpoint-restart's loss)." if share is not None else "."))
        lines.append(f"- Snapshot interval: {_h(run['costs']['pitstop']['every_h'])} (the least costly at this "
                     f"failure rate, unless given); over this history pitstop loses least at {_h(iv['best_h'])}; "
                     + (f"it loses no more than checkpoint-restart between {_h(iv['shortest_h'])} and "
                        f"{_h(iv['longest_h'])}." if iv["shortest_h"] is not None else
                        "at no interval from 5 s to a week does it lose as little as checkpoint-restart."))
        rates = be["device_rates_at_snapshot_every"]
        if rates:
            m = be["measured"]
            lines.append(f"- The GPU snapshot rate (device bytes over the time they hold the job: out, into the dump, "
                         f"back in; per GPU) at which pitstop breaks even over the history, against "
                         f"{m['snapshot_gbps']:.2f} GB/s from the measured rates (CUDA checkpoint out "
                         f"{m['cuda_checkpoint_gbps_out']:g} GB/s): "
                         + "; ".join(f"snapshots every {k.replace('_min', ' min')}: "
                                     + ("none within 1000 x" if x is None else
                                        f"{x['snapshot_gbps']:,.2f} GB/s (CUDA checkpoint out "
                                        f"{x['cuda_checkpoint_gbps_out']:,.2f})")
                                     for k, x in rates.items()) + ".")
        if be["move_pause_s"] is not None:
            lines.append(f"- A move breaks even at a pause of {be['move_pause_s']:,.0f} s (checkpoint-restart's "
                         "planned event).")
        lines.append("- Where pitstop loses: " + ("; ".join(run["where_pitstop_loses"]) or "nowhere here") + ".")
        lines.append("")
    return lines


def _appendix(d: dict[str, Any]) -> list[str]:
    """What both pay, the inputs with their sources, the sensitivity and the failure domains."""
    lines: list[str] = []
    lines += ["Common to both, not counted above: " + "; ".join(
        f"{s}: the job's checkpoints {_n(run['common']['checkpoints_gpu_h'], 0)} GPU-hours" for s, run in
        d["stacks"].items()) + f"; the spares held idle {_n(next(iter(d['stacks'].values()))['common']['spares_idle_gpu_h'], 0)}"
        " GPU-hours.", ""]
    lines += ["## Inputs", "", "| input | value | unit | kind | source |", "|---|---|---|---|---|"]
    for k, i in {**d["inputs"], **d["given"]}.items():
        lines.append(f"| {k} | {i['value']:g} | {i.get('unit', '')} | {i['kind']} | {i['source']} |")
    first = next(iter(d["stacks"]))
    lines += ["", f"## Sensitivity ({first} stack): pitstop's saving with each input halved and doubled "
              "(spares: one less, one more)", "",
              "| input | value | low | saved at low | high | saved at high |", "|---|---|---|---|---|---|"]
    for s in d["stacks"][first]["sensitivity"]:
        lo, hi = s.get("low_saved_gpu_h"), s.get("high_saved_gpu_h")
        lines.append(f"| {s['input']} | {s['value']:g} | {s['low_value']:g} | {_n(lo)} | {s['high_value']:g} | "
                     f"{_n(hi)} |")
    lines += ["", "## Coverage by failure domain", "",
              "| domain | events | own spare | pooled spare | waited | wait (h) | covered by its own spares |",
              "|---|---|---|---|---|---|---|"]
    for dom, c in sorted(d["coverage"].items(), key=lambda kv: -kv[1]["events"]):
        lines.append(f"| {dom} | {c['events']} | {c['own_spare']} | {c['pooled']} | {c['waited']} | "
                     f"{c['wait_h']:,.1f} | {c['covered_share']:.0%} |")
    return lines


def markdown(d: dict[str, Any], source: str) -> str:
    return "\n".join(_summary(d, source) + _costs(d) + _stacks(d) + _appendix(d)) + "\n"


def svg(d: dict[str, Any]) -> str:
    """GPU-hours lost by method on each stack, split by what they went to."""
    w, bar_h, gap, left = 760, 22, 8, 250
    parts = [("planned_gpu_h", "#2b7bb9", "planned"), ("unplanned_gpu_h", "#c0504d", "failures: down"),
             ("work_gpu_h", "#e69138", "work redone"), ("periodic_gpu_h", "#6aa84f", "snapshots")]
    rows = [(f"{s}: {'pitstop' if m == 'pitstop' else 'checkpoint-restart'}", run["lost_gpu_h"][m])
            for s, run in d["stacks"].items() for m in ("pitstop", "checkpoint_restart")]
    top = max(r["total"] for _, r in rows) or 1.0
    out = [f'<text x="10" y="22" font-size="15" font-weight="bold">GPU-hours lost over {d["duration_h"] / 24:,.1f} '
           f'days ({d["events"]} events, {d["job"]["gpus"]:,} GPUs): a model</text>']
    y = 36
    for name, lost in rows:
        x = float(left)
        out.append(f'<text x="{left - 8}" y="{y + 15}" font-size="12" text-anchor="end">{escape(name)}</text>')
        for key, colour, _ in parts:
            bw = (w - left - 90) * lost[key] / top
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{max(0.0, bw):.1f}" height="{bar_h}" fill="{colour}"/>')
            x += bw
        out.append(f'<text x="{x + 6:.1f}" y="{y + 15}" font-size="12">{lost["total"]:,.0f}</text>')
        y += bar_h + gap
    x = float(left)
    for _, colour, label in parts:
        out.append(f'<rect x="{x:.1f}" y="{y + 4}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16:.1f}" y="{y + 15}" font-size="11">{escape(label)}</text>')
        x += 120
    h = y + 30
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'font-family="sans-serif"><rect width="{w}" height="{h}" fill="#fff"/>' + "".join(out) + "</svg>\n")
