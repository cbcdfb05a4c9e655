// The dashboard page. Every text from the node is set with textContent, never parsed as HTML: event text is
// written by agents and is hostile input.
"use strict";

const $ = (id) => document.getElementById(id);
let seenSeq = null;
let answers = 0; // recall answers shown, on the form as data-answered: when the page has drawn one

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (cls) td.className = cls;
  return td;
}

function badge(text, cls) {
  const span = document.createElement("span");
  span.className = "badge " + cls;
  span.textContent = text;
  return span;
}

const BAD = new Set(["suspended", "contradicted", "rolled_back", "retracted", "mistyped", "rejected", "forgotten", "stalled"]);
const WARN = new Set(["unverified", "resolved", "superseded", "stale", "degraded", "disputed"]);

function tone(value) {
  return BAD.has(value) ? "bad" : WARN.has(value) ? "warn" : "ok";
}

function stateCell(values) {
  const td = document.createElement("td");
  td.className = "nowrap";
  for (const value of values.filter(Boolean)) {
    if (td.childNodes.length) td.append(" "); // a space between badges, for copying and screen readers
    td.appendChild(badge(value, tone(value)));
  }
  return td;
}

function fill(tbody, rows, build, empty) {
  const made = rows.map(build);
  if (!made.length && empty) {
    const tr = document.createElement("tr");
    const td = cell(empty, "empty");
    td.colSpan = tbody.parentElement.tHead.rows[0].cells.length;
    tr.appendChild(td);
    made.push(tr);
  }
  tbody.replaceChildren(...made);
}

function time(iso) {
  // The date and a 24-hour clock, in the viewer's time zone: YYYY-MM-DD HH:MM:SS
  if (!iso) return "";
  const d = new Date(iso);
  const two = (n) => String(n).padStart(2, "0");
  return d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate()) + " " +
    two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds());
}

function showEvents(data) {
  $("rate").textContent = Number(data.rate).toFixed(2);
  const projects = new Set();
  const previous = seenSeq;
  fill($("events").tBodies[0], data.events, (e) => {
    projects.add(e.project);
    const tr = document.createElement("tr");
    tr.dataset.eventId = e.event_id;
    tr.dataset.artifactId = e.artifact_id;
    if (previous !== null && e.seq > previous) tr.className = "new";
    const state = e.status === "applied" ? [e.trust, e.lifecycle, e.resolution] : [e.status];
    tr.append(cell(e.seq, "num"), cell(time(e.at), "nowrap"), cell(e.kind), cell(e.project, "nowrap"), cell(e.artifact_id, "id"),
      cell(e.actor), stateCell(state), cell(e.vouched, "nowrap"), cell(e.status === "applied" ? e.text : e.reason, "text"));
    return tr;
  }, "no events in the journal yet");
  if (data.events.length) seenSeq = Math.max(seenSeq ?? 0, data.events[0].seq);
  const known = new Set(Array.from($("projects").options, (o) => o.value));
  for (const p of projects) {
    if (known.has(p)) continue;
    const option = document.createElement("option");
    option.value = p;
    $("projects").appendChild(option);
  }
  if (!$("recall-project").value && data.events.length) $("recall-project").value = data.events[0].project;
}

function showHealth(h) {
  $("rate").textContent = Number(h.rate).toFixed(2);
  $("node-name").textContent = h.node ? h.node.name : "";
  $("updated").textContent = h.node ? "updated " + time(h.node.at) : "";
  $("dlq").textContent = h.dlq_depth ?? "?";
  $("outbox").textContent = h.outbox ? h.outbox.depth + " / " + h.outbox.parked : "?";
  $("mesh").textContent = h.mesh ? h.mesh.tasks + " / " + h.mesh.pending_acks : "?";
  const nats = h.node ? h.node.nats : null;
  $("nats").replaceChildren(nats && nats.connected ? badge("connected", "ok") : badge("down", "bad"));
  $("dropped").textContent = h.pages.dropped_here + " / " + h.pages.dropped;
  fill($("problems"), h.problems || [], (p) => {
    const li = document.createElement("li");
    li.textContent = p;
    return li;
  });
  fill($("observers").tBodies[0], Object.entries(h.observers || {}), ([name, o]) => {
    const tr = document.createElement("tr");
    tr.dataset.observer = name;
    tr.append(cell(name, "id"), stateCell([o.state]), cell(o.lag ?? "…", "num"), cell(o.handled, "num"),
      cell(o.last_stream_seq, "num"), cell(o.dead_lettered, "num"), cell(o.last_error, "text"));
    return tr;
  }, "no observers running");
  fill($("tasks").tBodies[0], h.mesh ? h.mesh.latest : [], (t) => {
    const tr = document.createElement("tr");
    tr.append(cell(time(t.at), "nowrap"), cell(t.project, "nowrap"), cell(t.task_id, "id"), cell(t.title, "text"),
      stateCell([t.state, t.awaits_ack ? "awaiting ack" : null]), cell(t.proposer), cell(t.assignee));
    return tr;
  }, h.mesh ? "no mesh tasks" : "the mesh is not followed by this node");
  const w = h.watches;
  $("watch-count").textContent = w ? w.held + " / " + w.pushed : "?";
  $("watch-cost").textContent = w
    ? "(" + w.claims + " claims matched, " + w.matches + " matches, " +
      (w.match_ms_per_claim === null ? "no claim yet" : w.match_ms_per_claim + " ms of matching per claim") + ")"
    : "";
  fill($("watches").tBodies[0], w ? w.latest : [], (x) => {
    const tr = document.createElement("tr");
    tr.dataset.watchId = x.watch_id;
    tr.append(cell(x.agent), cell(x.projects.join(", "), "nowrap"), cell(x.about, "text"), cell(x.threshold, "num"),
      cell(time(x.expires_at), "nowrap"), stateCell([x.expired ? "expired" : "active", x.audit ? "audit" : null]));
    return tr;
  }, w ? "no agent keeps a watch" : "this node runs no mirror: it matches no watch");
  const budgets = h.budgets;
  $("budget-limit").textContent = budgets
    ? "(" + budgets.msgs_per_window + " messages, " + budgets.bytes_per_window + " bytes per " + budgets.window_s + " s)"
    : "";
  fill($("budgets").tBodies[0], budgets ? Object.entries(budgets.agents) : [], ([agent, b]) => {
    const tr = document.createElement("tr");
    tr.dataset.agent = agent;
    tr.append(cell(agent), cell(b.msgs, "num"), cell(b.bytes, "num"),
      stateCell([b.suspended ? "suspended" : "ok"]), cell(b.suspensions, "num"));
    return tr;
  }, budgets ? "no agent has sent anything yet" : "this node keeps no budgets (no authentication, or not its own server)");
}

function connect() {
  const source = new EventSource("/api/stream");
  source.addEventListener("open", () => { $("link").className = "badge ok"; $("link").textContent = "live"; });
  source.addEventListener("error", () => { $("link").className = "badge warn"; $("link").textContent = "reconnecting…"; });
  source.addEventListener("events", (m) => showEvents(JSON.parse(m.data)));
  source.addEventListener("health", (m) => showHealth(JSON.parse(m.data)));
}

async function recall(event) {
  event.preventDefault();
  const error = $("recall-error");
  const table = $("recall-hits");
  error.hidden = true;
  const body = JSON.stringify({ query: $("recall-query").value, project: $("recall-project").value.trim() });
  let answer;
  try {
    const response = await fetch("/api/recall", {
      method: "POST", headers: { "Content-Type": "application/json" }, body, credentials: "same-origin",
    });
    answer = await response.json();
    if (!response.ok) throw new Error(answer.error || "recall failed (" + response.status + ")");
  } catch (e) {
    error.textContent = e.message;
    error.hidden = false;
    table.hidden = true;
    $("recall").dataset.answered = String(++answers);
    return;
  }
  fill(table.tBodies[0], answer.hits, (h) => {
    const tr = document.createElement("tr");
    tr.dataset.artifactId = h.artifact_id;
    tr.append(cell(h.score.toFixed(3), "num"), cell(h.kind), cell(h.artifact_id, "id"),
      stateCell([h.state.trust, h.state.lifecycle, h.state.resolution]), cell(h.provenance.actor), cell(h.vouched_text, "nowrap"),
      cell(h.content, "text"));
    return tr;
  });
  if (!answer.hits.length) {
    error.textContent = "no hits for this query in " + answer.project;
    error.hidden = false;
  }
  table.hidden = !answer.hits.length;
  $("recall").dataset.answered = String(++answers);
}

function showInitial() {
  const initial = $("initial");
  if (!initial || !initial.textContent.trim()) return;
  const data = JSON.parse(initial.textContent);
  showEvents(data.events);
  showHealth(data.health);
}

document.addEventListener("DOMContentLoaded", () => {
  $("recall").addEventListener("submit", recall);
  showInitial();
  connect();
});
