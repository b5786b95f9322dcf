// kvatlas fleet page. Polls ui/fleet.json (the coordinator's counters, directory stats and
// every live member's /status, gathered by the coordinator), derives rates from successive
// polls, and renders with DOM calls and textContent only (instance ids and errors come
// from the fleet, never from this page, so nothing is parsed as HTML). Fetches nothing but
// ui/fleet.json on its own origin.
"use strict";
(() => {
  const TOKEN_KEY = "kvatlas.token";
  const WINDOW_S = 300;
  const SVG = "http://www.w3.org/2000/svg";

  const state = {
    interval: 2,
    paused: false,
    timer: 0,
    inFlight: false,
    waitingForToken: false,
    lastOkAt: 0,
    prev: null, // the last sample of cumulative counters
    points: [], // derived rates, oldest first
    doc: null,
    sort: { key: "instance", dir: 1 },
    filter: "",
    problemsOnly: false,
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    if (props) {
      for (const [k, v] of Object.entries(props)) {
        if (v === undefined || v === null) continue;
        if (k === "class") e.className = v;
        else if (k === "text") e.textContent = v;
        else if (k.startsWith("data-")) e.setAttribute(k, v);
        else e[k] = v;
      }
    }
    for (const c of children) {
      if (c !== null && c !== undefined) e.append(c);
    }
    return e;
  }

  // ---- formatting ------------------------------------------------------------------

  function fmtNum(n) {
    if (n === null || n === undefined || Number.isNaN(n)) return "-";
    const a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(2) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(2) + "M";
    if (a >= 1e4) return (n / 1e3).toFixed(1) + "k";
    if (Number.isInteger(n)) return String(n);
    if (a >= 100) return n.toFixed(0);
    if (a >= 10) return n.toFixed(1);
    return n.toFixed(2);
  }

  function fmtBytes(n) {
    if (n === null || n === undefined || Number.isNaN(n)) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    let v = n;
    while (Math.abs(v) >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return (i === 0 ? String(Math.round(v)) : v.toFixed(v >= 100 ? 0 : 1)) + " " + units[i];
  }

  function fmtAge(s) {
    if (s === null || s === undefined) return "-";
    if (s < 10) return s.toFixed(1) + " s";
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.round(s / 60) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  function fmtPct(x) {
    return x === null || x === undefined || Number.isNaN(x) ? "-" : (100 * x).toFixed(1) + " %";
  }

  const sum = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);

  // ---- token -----------------------------------------------------------------------

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  function askToken(refused) {
    state.waitingForToken = true;
    $("auth-error").hidden = !refused;
    $("token").value = "";
    const dialog = $("auth");
    if (!dialog.open) dialog.showModal();
    $("token").focus();
  }

  function onTokenSubmit(ev) {
    ev.preventDefault();
    const value = $("token").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("auth").close();
    state.waitingForToken = false;
    $("forget-token").hidden = false;
    poll();
  }

  // ---- polling ---------------------------------------------------------------------

  function schedule() {
    clearTimeout(state.timer);
    if (!state.paused && !state.waitingForToken) {
      state.timer = setTimeout(poll, state.interval * 1000);
    }
  }

  function setBanner(text) {
    const b = $("banner");
    b.hidden = !text;
    b.textContent = text || "";
    document.body.classList.toggle("stale-data", Boolean(text) && state.doc !== null);
  }

  async function poll() {
    if (state.inFlight) return;
    state.inFlight = true;
    try {
      const headers = {};
      const t = token();
      if (t) headers.Authorization = "Bearer " + t;
      const r = await fetch("ui/fleet.json", { headers, cache: "no-store" });
      if (r.status === 401) {
        if (t) sessionStorage.removeItem(TOKEN_KEY);
        setBanner("");
        askToken(Boolean(t));
        return;
      }
      if (!r.ok) {
        const body = (await r.text()).slice(0, 300);
        throw new Error("HTTP " + r.status + " " + body);
      }
      const doc = await r.json();
      state.lastOkAt = Date.now();
      state.doc = doc;
      setBanner("");
      addSample(doc);
      render(doc);
    } catch (err) {
      const since = state.lastOkAt
        ? "; showing data from " + fmtAge((Date.now() - state.lastOkAt) / 1000) + " ago"
        : "";
      setBanner("The coordinator did not answer: " + err.message + since);
    } finally {
      state.inFlight = false;
      schedule();
    }
  }

  // ---- rates -----------------------------------------------------------------------

  function sampleOf(doc) {
    const members = new Map();
    for (const m of doc.members) {
      if (!m.status) continue;
      const s = m.status;
      const p2p = s.p2p || { bytes_read: 0, fallbacks: {} };
      members.set(m.instance_id + "#" + m.incarnation, {
        lookups: s.lookups.requests,
        chunks: s.lookups.chunks,
        hits: s.lookups.hit_chunks,
        bytesRead: p2p.bytes_read,
        fallbacks: Object.assign({}, p2p.fallbacks),
      });
    }
    const c = doc.counters;
    return {
      t: doc.generated_at,
      events: c.entries.applied || 0,
      lookups: sum(c.lookups),
      members,
    };
  }

  // A counter that went down was reset (a restarted coordinator or member): count from 0.
  const grow = (now, before) => (now >= before ? now - before : now);

  function addSample(doc) {
    const cur = sampleOf(doc);
    const prev = state.prev;
    if (prev && cur.t <= prev.t) return; // the coordinator served its cached document
    state.prev = cur;
    if (!prev) return;
    const dt = cur.t - prev.t;
    let engineLookups = 0;
    let chunks = 0;
    let hits = 0;
    let bytes = 0;
    const causes = {};
    // Only members seen in both polls: one that joined or restarted counts from the next.
    for (const [key, m] of cur.members) {
      const p = prev.members.get(key);
      if (!p) continue;
      engineLookups += grow(m.lookups, p.lookups);
      chunks += grow(m.chunks, p.chunks);
      hits += grow(m.hits, p.hits);
      bytes += grow(m.bytesRead, p.bytesRead);
      for (const [cause, n] of Object.entries(m.fallbacks)) {
        causes[cause] = (causes[cause] || 0) + grow(n, p.fallbacks[cause] || 0);
      }
    }
    state.points.push({
      t: cur.t,
      events: grow(cur.events, prev.events) / dt,
      lookups: grow(cur.lookups, prev.lookups) / dt,
      engineLookups: engineLookups / dt,
      hitRate: chunks > 0 ? hits / chunks : null,
      peerBytes: bytes / dt,
      fallbacks: sum(causes) / dt,
      causes,
    });
    while (state.points.length && state.points[0].t < cur.t - WINDOW_S) state.points.shift();
  }

  const CHARTS = [
    { id: "events", title: "events ingested", key: "events", fmt: (v) => fmtNum(v) + " /s" },
    { id: "lookups", title: "directory lookups", key: "lookups", fmt: (v) => fmtNum(v) + " /s" },
    { id: "engine-lookups", title: "engine lookups", key: "engineLookups", fmt: (v) => fmtNum(v) + " /s" },
    { id: "hit-rate", title: "hit rate (chunks)", key: "hitRate", fmt: fmtPct, max: 1 },
    { id: "peer-bytes", title: "read from peers", key: "peerBytes", fmt: (v) => fmtBytes(v) + "/s" },
    { id: "fallbacks", title: "P2P fallbacks", key: "fallbacks", fmt: (v) => fmtNum(v) + " /s" },
  ];

  function buildCharts() {
    const host = $("charts");
    for (const c of CHARTS) {
      const svg = document.createElementNS(SVG, "svg");
      svg.setAttribute("viewBox", "0 0 300 70");
      svg.setAttribute("preserveAspectRatio", "none");
      svg.append(document.createElementNS(SVG, "polygon"), document.createElementNS(SVG, "polyline"));
      host.append(
        el(
          "div",
          { class: "chart", id: "chart-" + c.id },
          el("div", { class: "head" }, el("span", { text: c.title }), el("span", { class: "value", id: "rate-" + c.id, text: "-" })),
          svg,
          el("div", { class: "axis" }, el("span", { class: "from", text: "" }), el("span", { class: "peak", text: "" }), el("span", { text: "now" })),
        ),
      );
    }
  }

  function renderCharts() {
    const pts = state.points;
    const tEnd = pts.length ? pts[pts.length - 1].t : 0;
    // The x axis spans the history there is (at least 30 s), up to the whole window.
    const span = pts.length ? Math.min(WINDOW_S, Math.max(30, tEnd - pts[0].t)) : WINDOW_S;
    for (const c of CHARTS) {
      const box = $("chart-" + c.id);
      const values = pts.filter((p) => p[c.key] !== null);
      const last = values.length ? values[values.length - 1][c.key] : null;
      const out = $("rate-" + c.id);
      out.textContent = last === null ? "-" : c.fmt(last);
      out.setAttribute("data-value", last === null ? "" : String(last));
      const top = values.length ? Math.max(...values.map((p) => p[c.key])) : 0;
      const scale = c.max || top;
      box.querySelector(".peak").textContent = values.length ? "peak " + c.fmt(top) : "";
      box.querySelector(".from").textContent = "-" + fmtAge(span);
      const xy = values.map((p) => {
        const x = 300 - ((tEnd - p.t) / span) * 300;
        const y = scale > 0 ? 67 - (p[c.key] / scale) * 62 : 67;
        return x.toFixed(1) + "," + y.toFixed(1);
      });
      box.querySelector("polyline").setAttribute("points", xy.join(" "));
      const area = xy.length ? [xy[0].split(",")[0] + ",70", ...xy, xy[xy.length - 1].split(",")[0] + ",70"] : [];
      box.querySelector("polygon").setAttribute("points", area.join(" "));
    }
    $("rates-window").textContent = pts.length
      ? "(last " + fmtAge(Math.min(WINDOW_S, tEnd - pts[0].t)) + ", " + pts.length + " polls)"
      : "(from the second poll on)";
  }

  // ---- members ---------------------------------------------------------------------

  function memberRow(m, cursors) {
    const s = m.status;
    const cursor = cursors.get(m.instance_id);
    let st = "live";
    if (m.stale) st = "stale";
    else if (!s) st = "unreachable";
    else if (s.registration_state !== "registered" || s.events.failed_sends > 0 || s.events.dropped_events > 0) st = "degraded";
    const p2p = s ? s.p2p : null;
    return {
      m,
      s,
      state: st,
      instance: m.instance_id,
      incarnation: m.incarnation,
      address: m.address,
      heartbeat: m.heartbeat_age_s,
      l1: s && s.l1.capacity_bytes ? s.l1.used_bytes / s.l1.capacity_bytes : -1,
      l2: s && s.l2.capacity_bytes ? s.l2.used_bytes / s.l2.capacity_bytes : -1,
      p2p: s ? (s.p2p_enabled ? s.p2p_state + " " + s.p2p_peer_count : "off") : "",
      backlog: s ? s.events.pending + s.events.buffered_batches : -1,
      hit: s && s.lookups.chunks ? s.lookups.hit_chunks / s.lookups.chunks : -1,
      peer: p2p ? p2p.bytes_read : -1,
      fallbacks: p2p ? sum(p2p.fallbacks) : -1,
      gaps: cursor ? cursor.gaps : 0,
      status: m.error || (s ? s.registration_state : ""),
      text: [m.instance_id, m.address, st, m.error, s ? s.p2p_state : ""].join(" ").toLowerCase(),
      problem: st !== "live" || (cursor && cursor.gaps > 0) || (p2p && sum(p2p.fallbacks) > 0),
    };
  }

  function meter(used, cap) {
    if (!cap) return el("span", { class: "muted", text: "off" });
    const f = Math.min(1, used / cap);
    const bar = el("span", { class: f > 0.9 ? "meter full" : "meter" }, el("span"));
    bar.firstChild.style.width = (100 * f).toFixed(1) + "%";
    return el("span", null, bar, fmtBytes(used) + " / " + fmtBytes(cap));
  }

  function renderMembers(doc) {
    const cursors = new Map((doc.directory.cursors || []).map((c) => [c.instance_id, c]));
    const all = doc.members.map((m) => memberRow(m, cursors));
    const words = state.filter.toLowerCase().split(/\s+/).filter(Boolean);
    const shown = all.filter((r) => (!state.problemsOnly || r.problem) && words.every((w) => r.text.includes(w)));
    const { key, dir } = state.sort;
    shown.sort((a, b) => {
      const x = a[key];
      const y = b[key];
      const c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
      return c * dir || a.instance.localeCompare(b.instance);
    });
    const rows = document.createDocumentFragment();
    for (const r of shown) {
      const s = r.s;
      const tr = el("tr", { class: r.state, "data-instance": r.instance, "data-state": r.state });
      const p2pCell = el("td", {
        text: s ? (s.p2p_enabled ? s.p2p_state + ", " + s.p2p_peer_count + (s.p2p_peer_count === 1 ? " peer" : " peers") : "off") : "-",
      });
      if (s && s.p2p_peers.length) p2pCell.title = "peers: " + s.p2p_peers.join(", ");
      const fb = s && s.p2p ? s.p2p.fallbacks : {};
      const fbCell = el("td", { class: "num", text: s && s.p2p ? fmtNum(sum(fb)) : "-" });
      if (s && s.p2p && sum(fb)) fbCell.title = Object.entries(fb).map(([k, v]) => k + ": " + v).join(", ");
      const backlog = s
        ? el("td", { class: "num", text: fmtNum(s.events.pending) + " ev / " + fmtNum(s.events.buffered_batches) + " b" })
        : el("td", { class: "num", text: "-" });
      if (s && s.events.last_error) backlog.title = "last error: " + s.events.last_error;
      const hb = el("td", { class: "num hb", text: fmtAge(r.heartbeat) });
      hb.title = "stale after " + fmtAge(r.m.stale_after_s);
      const statusCell = r.m.error
        ? el("td", { class: "err", text: r.m.error })
        : el("td", { text: s ? s.registration_state + ", up " + fmtAge(s.uptime_s) : "" });
      if (r.m.error) statusCell.title = r.m.error + " (" + r.m.status_url + ")";
      tr.append(
        el("td", null, el("span", { class: "dot " + r.state }), r.state),
        el("td", { text: r.instance }),
        el("td", { class: "num", text: String(r.incarnation) }),
        el("td", { text: r.address }),
        hb,
        el("td", null, s ? meter(s.l1.used_bytes, s.l1.capacity_bytes) : "-"),
        el("td", null, s ? meter(s.l2.used_bytes, s.l2.enabled ? s.l2.capacity_bytes : 0) : "-"),
        p2pCell,
        backlog,
        el("td", { class: "num", text: r.hit >= 0 ? fmtPct(r.hit) : "-" }),
        el("td", { class: "num", text: r.peer >= 0 ? fmtBytes(r.peer) : "-" }),
        fbCell,
        el("td", { class: r.gaps ? "num bad" : "num", text: String(r.gaps) }),
        statusCell,
      );
      rows.append(tr);
    }
    $("members").tBodies[0].replaceChildren(rows);
    $("members-count").textContent = "(showing " + shown.length + " of " + all.length + ")";
    for (const th of $("members").tHead.rows[0].cells) {
      th.classList.toggle("sorted-asc", th.dataset.sort === key && dir > 0);
      th.classList.toggle("sorted-desc", th.dataset.sort === key && dir < 0);
    }
    return all;
  }

  // ---- the rest --------------------------------------------------------------------

  function fillTable(id, rows) {
    const body = $(id).tBodies[0];
    body.replaceChildren(
      ...rows.map((cells) => el("tr", null, ...cells.map(([text, cls]) => el("td", { class: cls || "", text: String(text) })))),
    );
  }

  function renderCards(doc, rows) {
    const d = doc.directory;
    const stale = rows.filter((r) => r.state === "stale").length;
    const unreachable = rows.filter((r) => r.state === "unreachable").length;
    $("card-members").textContent = String(rows.length);
    $("card-members-detail").textContent =
      stale + " stale, " + unreachable + " unreachable, " + (d.provisional_instances || []).length + " provisional";
    $("card-keys").textContent = fmtNum(d.keys);
    $("card-keys-detail").textContent = fmtNum(d.placements) + " placements, " + d.namespaces + " namespaces";
    for (const tier of ["l1", "l2"]) {
      $("card-" + tier).textContent = fmtBytes((d.bytes_by_tier || {})[tier] || 0);
      $("card-" + tier + "-detail").textContent = fmtNum((d.placements_by_tier || {})[tier] || 0) + " placements";
    }
    $("card-blend").textContent = d.blend ? fmtNum(d.blend.chunks) : "off";
    $("card-blend-detail").textContent = d.blend ? d.blend.namespaces + " namespaces, " + fmtBytes(d.blend.token_bytes) + " of tokens" : "--enable-blend-lookup";
    const e = doc.counters.entries;
    $("card-events").textContent = fmtNum(e.applied || 0);
    $("card-events-detail").textContent =
      "applied; " + fmtNum(e.duplicate || 0) + " duplicate, " + fmtNum(e.stale || 0) + " stale, " + fmtNum(e.invalid || 0) + " invalid";
  }

  function renderProblems(doc) {
    const totals = {};
    let p2pLookups = 0;
    for (const m of doc.members) {
      const p = m.status && m.status.p2p;
      if (!p) continue;
      p2pLookups += p.lookups;
      for (const [cause, n] of Object.entries(p.fallbacks)) totals[cause] = (totals[cause] || 0) + n;
    }
    const recent = {};
    const tEnd = state.points.length ? state.points[state.points.length - 1].t : 0;
    for (const p of state.points) {
      if (p.t <= tEnd - 60) continue;
      for (const [cause, n] of Object.entries(p.causes)) recent[cause] = (recent[cause] || 0) + n;
    }
    const causes = Object.keys(totals).sort((a, b) => totals[b] - totals[a]);
    fillTable(
      "fallbacks",
      causes.map((c) => [[c], [fmtNum(totals[c]), "num"], [fmtNum(recent[c] || 0), recent[c] ? "num warn" : "num"]]),
    );
    const stale = totals.stale_hint || 0;
    $("stale-hints").textContent =
      (causes.length ? "" : "No P2P fallback so far. ") +
      "Stale directory hints: " + fmtNum(stale) +
      (p2pLookups ? " of " + fmtNum(p2pLookups) + " P2P lookups (" + fmtPct(stale / p2pLookups) + ")" : "") + ".";

    const cursors = (doc.directory.cursors || []).slice().sort((a, b) => b.gaps - a.gaps || a.instance_id.localeCompare(b.instance_id));
    const gapped = cursors.filter((c) => c.gaps > 0);
    fillTable(
      "gaps",
      gapped.map((c) => [[c.instance_id], [c.incarnation ?? "-", "num"], [c.last_seq ?? "-", "num"], [c.gaps, "num bad"], [c.missing, "num"]]),
    );
    $("gaps-note").textContent = gapped.length
      ? fmtNum(doc.counters.gaps) + " gaps, " + fmtNum(doc.counters.missing_seqs) + " seqs missing since the coordinator started."
      : "No gaps in the " + cursors.length + " event streams.";

    const lag = doc.counters.kafka_lag || {};
    const positions = doc.directory.kafka_positions || {};
    const parts = [...new Set([...Object.keys(lag), ...Object.keys(positions)])].sort((a, b) => Number(a) - Number(b) || a.localeCompare(b));
    fillTable(
      "kafka",
      parts.map((p) => [[p], [p in lag ? fmtNum(lag[p]) : "-", lag[p] > 0 ? "num warn" : "num"], [p in positions ? positions[p] : "-", "num"]]),
    );
    $("kafka-note").textContent =
      doc.event_transport === "kafka"
        ? "Records: " + Object.entries(doc.counters.kafka_records).map(([k, v]) => k + " " + fmtNum(v)).join(", ")
        : "Events arrive over HTTP: no Kafka consumer.";
  }

  function renderDirectory(doc) {
    const d = doc.directory;
    const tiers = [...new Set([...Object.keys(d.placements_by_tier || {}), ...Object.keys(d.bytes_by_tier || {})])].sort();
    fillTable(
      "tiers",
      tiers.map((t) => [[t], [fmtNum(d.placements_by_tier[t] || 0), "num"], [fmtBytes(d.bytes_by_tier[t] || 0), "num"]]),
    );
    const owners = (d.owners || []).slice().sort((a, b) => b.bytes - a.bytes);
    $("owners-count").textContent = String(owners.length);
    fillTable(
      "owners",
      owners.map((o) => [[o.instance_id], [o.incarnation, "num"], [o.tier], [o.backend], [fmtNum(o.placements), "num"], [fmtBytes(o.bytes), "num"]]),
    );
  }

  function fmtShares(shares) {
    // Each member's guaranteed L1 bytes per active salt: one figure when they agree.
    const v = Object.values(shares);
    if (v.length === 0) return "-";
    const lo = Math.min(...v);
    const hi = Math.max(...v);
    const on = " on " + v.length + (v.length === 1 ? " member" : " members");
    return (lo === hi ? fmtBytes(lo) : fmtBytes(lo) + " – " + fmtBytes(hi)) + on;
  }

  function renderQuotas(doc) {
    const q = doc.quotas;
    if (!q) {
      fillTable("quotas", []);
      $("quotas-note").textContent = "No quota controller.";
      return;
    }
    const body = $("quotas").tBodies[0];
    body.replaceChildren(
      ...q.salts.map((s) => {
        const limit = s.effective_limit_bytes;
        const over = limit !== null && s.l2_bytes >= limit;
        const used = limit === null
          ? el("span", null, fmtBytes(s.l2_bytes) + " (exempt)")
          : meter(s.l2_bytes, limit || 1);
        const kind = s.limit_bytes !== null ? "own" : limit !== null ? "default" : "none";
        const salt = s.cache_salt === "" ? "(empty)" : s.cache_salt;
        return el(
          "tr",
          { class: over ? "warn" : "" },
          el("td", { text: s.tenant || salt, title: s.tenant ? "cache_salt " + salt : null }),
          el("td", null, used),
          el("td", { text: limit === null ? "none" : fmtBytes(limit) + " (" + kind + ")" }),
          el("td", { class: "num", text: fmtNum(s.pinned_keys) }),
          el("td", { class: "num", text: fmtBytes(s.l1_bytes || 0) }),
          el("td", { class: "num", text: fmtNum(s.l1_chunks || 0) }),
          el("td", { class: "num", text: fmtNum(s.l1_evicted_by_own || 0) + " / " + fmtNum(s.l1_evicted_by_others || 0) }),
          el("td", { class: "num", text: fmtShares(s.l1_shares || {}) }),
        );
      }),
    );
    const hidden = q.salts_hidden
      ? "Per-salt rows (L2 and L1) need the operator token: " + fmtBytes(q.l2_bytes || 0) + " in L2 across salts, " +
        fmtNum(q.salts_over_quota || 0) + " salts at or over their quota. "
      : "";
    $("quotas-note").textContent =
      hidden + "Default quota: " + (q.default_limit_bytes === null ? "none (salts without a quota are exempt)" : fmtBytes(q.default_limit_bytes)) +
      ". " + fmtNum(q.pinned_keys) + " keys pinned against eviction. " +
      (q.eviction_interval_s > 0 ? "Eviction sweeps every " + q.eviction_interval_s + " s." : "Eviction loop off.");
  }

  function render(doc) {
    const badge = $("coordinator-state");
    badge.textContent = (doc.ready ? "ready" : "not ready: " + doc.not_ready_reason) + " · events over " + doc.event_transport;
    badge.className = "badge " + (doc.ready ? "ok" : "warn");
    $("updated").textContent = "updated " + new Date(doc.generated_at * 1000).toLocaleTimeString();
    const rows = renderMembers(doc);
    renderCards(doc, rows);
    renderCharts();
    renderProblems(doc);
    renderDirectory(doc);
    renderQuotas(doc);
  }

  // ---- controls --------------------------------------------------------------------

  function init() {
    buildCharts();
    const asked = Number(new URLSearchParams(location.search).get("interval"));
    if (asked >= 0.5 && asked <= 60) {
      state.interval = asked;
      const sel = $("interval");
      if (![...sel.options].some((o) => Number(o.value) === asked)) sel.append(el("option", { value: String(asked), text: asked + " s" }));
      sel.value = String(asked);
    }
    $("interval").addEventListener("change", (e) => {
      state.interval = Number(e.target.value);
      schedule();
    });
    $("pause").addEventListener("click", () => {
      state.paused = !state.paused;
      $("pause").textContent = state.paused ? "resume" : "pause";
      if (!state.paused) poll();
      else clearTimeout(state.timer);
    });
    $("forget-token").hidden = !token();
    $("forget-token").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      $("forget-token").hidden = true;
      poll();
    });
    $("auth-form").addEventListener("submit", onTokenSubmit);
    $("auth").addEventListener("cancel", (e) => e.preventDefault()); // the page needs a token
    $("filter").addEventListener("input", (e) => {
      state.filter = e.target.value;
      if (state.doc) renderMembers(state.doc);
    });
    $("problems").addEventListener("change", (e) => {
      state.problemsOnly = e.target.checked;
      if (state.doc) renderMembers(state.doc);
    });
    for (const th of $("members").tHead.rows[0].cells) {
      th.addEventListener("click", () => {
        const key = th.dataset.sort;
        state.sort = { key, dir: state.sort.key === key ? -state.sort.dir : 1 };
        if (state.doc) renderMembers(state.doc);
      });
    }
    poll();
  }

  document.addEventListener("DOMContentLoaded", init);
})();
