// pitstop's dashboard: hosts, jobs and evacuations, read from the coordinator's own REST API with
// the read (or operator) token.  The token comes in the address's fragment (#token=..., which no
// server sees) or from the form, and is kept for this tab only (sessionStorage).  No library, no
// network but the coordinator's: what a browser can run off an air-gapped cluster.
"use strict";

const EVERY_MS = 1000;
const KEY = "pitstop-token";
const colourOf = {};

function colour(name) {  // one hue per phase name, spread by the golden angle: no two alike
  if (!(name in colourOf)) colourOf[name] = `hsl(${(Object.keys(colourOf).length * 137.5 + 205) % 360}, 55%, 50%)`;
  return colourOf[name];
}

function token() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);  // not left in the address bar or history
  }
  return sessionStorage.getItem(KEY);
}

async function api(path) {
  const r = await fetch("v1/" + path, {headers: {"Authorization": "Bearer " + (token() || "")}});
  if (r.status === 401 || r.status === 403) {
    const e = new Error("refused"); e.refused = true;
    try { e.detail = (await r.json()).error.message; } catch (_) { e.detail = r.statusText; }
    throw e;
  }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function age(s) { return s < 90 ? s.toFixed(1) + " s ago" : (s / 60).toFixed(0) + " min ago"; }

function lasted(s) { return s < 90 ? s.toFixed(0) + " s" : s < 5400 ? (s / 60).toFixed(0) + " min" : (s / 3600).toFixed(1) + " h"; }

// A host's role; out of service (draining, drained): since when and why, with its operation;
// and whether an operator keeps it out of the spare pool (cordoned).
function role(h) {
  const now = Date.now() / 1000, why = h.role_why || {};
  let s = h.role;
  if (["draining", "drained"].includes(h.role)) {
    if (h.role_since) s += ` for ${lasted(now - h.role_since)}`;
    if (why.reason) s += `: ${why.reason}`;
    if (why.operation) s += ` (${why.operation})`;
  }
  if (h.cordoned) s += `, cordoned for ${lasted(now - h.cordoned.since)}: ${h.cordoned.reason}`;
  return s;
}

function rows(table, items, cells) {
  const body = document.querySelector(table + " tbody");
  body.replaceChildren(...items.map(x => el("tr", {}, ...cells(x).map(c => el("td", {}, c)))));
}

// One operation's phases in order, each from its start to its end, in seconds from the start;
// the phase under way grows until now.  Per leaving rank: its capture's phases laid from the
// operation's capture phase on, its restore's from the restore phase on.
function gantt(op) {
  const md = op.metadata, now = Date.now() / 1000;
  const bars = [];
  let t = 0;
  const starts = {};
  for (const [name, secs] of Object.entries(md.phases || {})) {
    if (name.endsWith("_bytes")) continue;
    starts[name] = t;
    bars.push({row: "operation", name, from: t, to: t + secs});
    t += secs;
  }
  if (!op.done && md.phase) {
    const end = Math.max(t, now - md.create_time);
    starts[md.phase] = starts[md.phase] ?? t;
    bars.push({row: "operation", name: md.phase, from: t, to: end, running: true});
    t = end;
  }
  for (const [wid, w] of Object.entries(md.workers || {})) {
    for (const [kind, phases] of [["capture", w.capture_phases], ["restore", w.restore_phases]]) {
      let at = starts[kind] ?? starts[kind === "capture" ? "capture" : "restore"];
      if (at === undefined) continue;
      for (const [name, secs] of Object.entries(phases || {})) {
        if (typeof secs !== "number" || /_(bytes|threads|rounds|processes)$/.test(name)) continue;
        bars.push({row: wid, name: kind + ": " + name, from: at, to: at + secs});
        at += secs;
      }
    }
  }
  const names = ["operation", ...Object.keys(md.workers || {})];
  const span = Math.max(t, ...bars.map(b => b.to), 0.001);
  const left = 150, width = 640, h = 18, top = 18;
  const svg = svgEl("svg", {width: left + width + 60, height: top + names.length * (h + 6) + 8,
                            role: "img", "aria-label": "phases of " + op.name});
  svg.append(svgEl("text", {x: left, y: 12}, "0 s"));
  svg.append(svgEl("text", {x: left + width, y: 12, "text-anchor": "end"}, span.toFixed(2) + " s"));
  names.forEach((n, i) => svg.append(svgEl("text", {x: left - 8, y: top + i * (h + 6) + 13, "text-anchor": "end"}, n)));
  for (const b of bars) {
    const i = names.indexOf(b.row), x = left + width * b.from / span;
    const r = svgEl("rect", {x, y: top + i * (h + 6), width: Math.max(1, width * (b.to - b.from) / span), height: h,
                             fill: colour(b.name.replace(/^(capture|restore): /, "")),
                             opacity: b.running ? 0.55 : 1, "data-phase": b.name});
    r.append(svgEl("title", {}, `${b.row} ${b.name}: ${(b.to - b.from).toFixed(3)} s${b.running ? " (under way)" : ""}`));
    svg.append(r);
  }
  const legend = el("div", {class: "legend muted"});
  for (const n of [...new Set(bars.map(b => b.name.replace(/^(capture|restore): /, "")))])
    legend.append(el("span", {}, el("i", {style: "background:" + colour(n)}), n));
  legend.append(el("span", {}, "(a rank's steps are laid end to end from its operation's phase; some overlap in time)"));
  return [svg, legend];
}

function opView(op) {
  const md = op.metadata;
  const state = op.done ? (md.result === "succeeded" ? el("span", {class: "ok"}, "succeeded")
                                                     : el("span", {class: "bad"}, md.result || "failed"))
                        : el("span", {}, "running, phase " + md.phase);
  const recovery = (md["@type"] || "").endsWith("RecoverMetadata");
  // the pause the job saw: after a post-copy restore, until its first step or the fill's end
  const secs = recovery ? md.pause_s : (md.job_pause_s ?? md.downtime_s);
  const longer = !recovery && md.job_pause_s != null && md.job_pause_until !== "last resume";
  const pause = secs != null ? `, ${secs.toFixed(2)} s pause` +
    (longer ? ` (until its ${md.job_pause_until}; downtime ${md.downtime_s.toFixed(2)} s)` : "") : "";
  const why = md.reason ? ` (${md.reason})` : "";
  const title = recovery ? `recovery of ${md.job}: ${md.node} → ${md.destination || "?"}` : `${md.node} → ${md.destination}`;
  const d = el("div", {class: "op", "data-op": op.name, "data-phase": md.phase || "", "data-done": String(op.done)},
               el("div", {}, el("b", {}, title), " ", state, pause + why,
                  el("span", {class: "muted"}, ` ${op.name}, by ${md.requested_by || "?"}`)));
  if (op.error) d.append(el("div", {class: "bad"}, op.error.message));
  if (recovery) d.append(el("div", {class: "muted", "data-recovery": op.name},
    `from snapshot ${md.snapshot}` +
    (md.detected_after_s != null ? `; found ${md.detected_after_s.toFixed(1)} s after the failure` : "") +
    (md.steps_redone != null ? `; ${md.steps_redone} steps redone` :
     md.lost_s != null ? `; ${md.lost_s.toFixed(0)} s of work redone` : "") +
    (md.spares_left != null ? `; spares left: ${md.spares_left}` : "")));
  const a = md.after_move;
  if (a) d.append(el("div", {class: "muted", "data-after": String(a.measured)}, a.measured
    ? `the job after it: first NCCL calls back in ${a.first_collectives_s.toFixed(3)} s` +
      (a.first_step_s != null ? `, first full step (${a.ops_per_step} calls) in ${a.first_step_s.toFixed(3)} s` : "") +
      (a.back_to_speed_s != null ? `, back to speed in ${a.back_to_speed_s.toFixed(2)} s` : "") +
      (a.step_time_ratio != null ? `, steps ${a.step_time_ratio.toFixed(2)} x as long as before` : "")
    : "the job after it: not measured (" + a.why_not + ")"));
  d.append(...gantt(op));
  return d;
}

// Whether a running job that asked for snapshots would be recovered from one now, and why not.
function protection(p) {
  if (!p) return "-";
  if (p.protected) return `yes (snapshot ${p.snapshot}, ${Math.round(p.age_s)} s old)`;
  return el("span", {class: "bad"}, "no: " + p.why_not);
}

// Which coordinator leads (GET /v1/leader), since when: a standby's page says who to look at instead.
function leadership(l) {
  if (!l || l.term == null) return "";
  const since = l.since ? ` since ${new Date(l.since * 1000).toLocaleString()} (${lasted(Date.now() / 1000 - l.since)})` : "";
  if (l.role === "leader") return `this coordinator (${l.this}) leads, term ${l.term}${since}`;
  return `this coordinator (${l.this}) stands by: ${l.leader || "no coordinator"} leads, term ${l.term}${since}`;
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [hosts, jobs, ops, lead] = await Promise.all([api("hosts"), api("jobs"), api("operations?limit=10"),
                                                        api("leader")]);
    document.getElementById("login").style.display = "none";
    document.getElementById("content").hidden = false;
    document.getElementById("leader").textContent = leadership(lead);
    rows("#hosts", hosts, h => [h.name, role(h),
      h.silent ? el("span", {class: "bad"}, "silent: taken for failed") :
      h.health && h.health.degraded ? el("span", {class: "bad"}, "degraded: " + h.health.reasons.join("; ")) : "ok",
      String(h.live_workers), age(h.age_s)]);
    rows("#jobs", jobs, j => [j.job, j.state, j.movable ? "yes" : "no", protection(j.protection),
      j.workers.map(w => `${w.rank}@${w.host}: ${w.state}`).join(", ")]);
    const shown = ops.slice().sort((a, b) => (a.done - b.done) || (b.metadata.create_time - a.metadata.create_time));
    const box = document.getElementById("ops");
    box.replaceChildren(...(shown.length ? shown.map(opView) : [el("p", {class: "muted"}, "none yet")]));
    const running = ops.filter(o => !o.done).length;
    status.textContent = `${hosts.length} hosts, ${jobs.length} jobs, ${running} evacuation(s) running; ` +
                         `updated ${new Date().toLocaleTimeString()}`;
    status.className = "muted";
  } catch (e) {
    if (e.refused) {
      document.getElementById("content").hidden = true;
      document.getElementById("login").style.display = "block";
      status.textContent = "refused: " + e.detail;
      status.className = "bad";
    } else {
      status.textContent = "cannot reach the coordinator: " + e.message + " (retrying)";
      status.className = "bad";
    }
  }
}

document.getElementById("login").addEventListener("submit", ev => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, document.getElementById("token").value);
  refresh();
});
refresh();
setInterval(refresh, EVERY_MS);
