// The headwater dashboard: polls the REST API for the overview and follows one stream
// or kind live through the Kiwi WebSocket (/ws). Plain DOM, no framework, no build step.
"use strict";

(() => {
  const POLL_MS = 2000;
  const CHART_SPAN_MS = 3600000; // the charts show the last hour
  const HISTORY_POINTS = CHART_SPAN_MS / POLL_MS; // the page's own 2 s samples, an hour of them
  const SQL_ROWS = 1000;
  const HISTORY_REFRESH_MS = 30000; // the per-minute charts (reads, errors) come from the server
  const TAIL_ROWS = 200;
  const TAIL_BACKFILL = 20;
  const KIND_ROWS = 500;
  const RECONNECT_MAX_MS = 10000;

  const params = new URLSearchParams(location.search);
  const TOKEN_KEY = "headwater.token";
  const state = {
    tenant: params.get("tenant") || "0",
    token: params.get("token") || sessionStorage.getItem(TOKEN_KEY) || "",
    previous: null, // the last poll's per-stream counters, for rates
    history: [], // {t, events, bytes} per poll
    serverHistory: [], // {t, events, bytes} per minute before the page opened (/api/history)
    minutes: [], // {t, reads, errors} per minute (/api/history, refreshed)
    streamRates: new Map(),
  };

  const $ = (id) => document.getElementById(id);

  // ---- formatting ---------------------------------------------------------------------

  function compact(n) {
    if (n === null || n === undefined || Number.isNaN(n)) return "–";
    const abs = Math.abs(n);
    if (abs >= 1e9) return (n / 1e9).toFixed(abs >= 1e10 ? 0 : 1) + "G";
    if (abs >= 1e6) return (n / 1e6).toFixed(abs >= 1e7 ? 0 : 1) + "M";
    if (abs >= 1e3) return (n / 1e3).toFixed(abs >= 1e4 ? 0 : 1) + "k";
    if (abs > 0 && abs < 10 && !Number.isInteger(n)) return n.toFixed(1);
    return String(Math.round(n));
  }

  function grouped(n) {
    return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
  }

  function bytes(n) {
    if (n === null || n === undefined || Number.isNaN(n)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = n;
    let unit = 0;
    while (Math.abs(value) >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return (unit === 0 ? String(Math.round(value)) : value.toFixed(value >= 100 ? 0 : 1)) + " " + units[unit];
  }

  function duration(seconds) {
    const s = Math.floor(seconds);
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  // ISO 8601 date and time in UTC, to the millisecond: "2026-11-26 15:16:09.123".
  function isoTime(ms) {
    return new Date(ms).toISOString().replace("T", " ").replace("Z", "");
  }

  function millis(ms) {
    for (const [unit, size] of [["d", 86400000], ["h", 3600000], ["min", 60000], ["s", 1000]]) {
      if (ms >= size && ms % size === 0) return ms / size + " " + unit;
    }
    return ms + " ms";
  }

  function ago(ms) {
    if (ms < 1000) return "just now";
    return duration(ms / 1000) + " ago";
  }

  // ---- DOM helpers --------------------------------------------------------------------

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      if (cell instanceof Node) {
        tr.appendChild(cell);
      } else {
        tr.appendChild(el("td", cell.text, cell.cls));
      }
    }
    return tr;
  }

  function badge(text, kind) {
    const td = el("td");
    td.appendChild(el("span", text, "badge" + (kind ? " " + kind : "")));
    return td;
  }

  function fillTable(tableId, emptyId, rows) {
    const tbody = $(tableId).tBodies[0];
    tbody.replaceChildren(...rows);
    $(emptyId).hidden = rows.length > 0;
    $(tableId).hidden = rows.length === 0;
  }

  function setPill(id, pillState, text) {
    const pill = $(id);
    pill.dataset.state = pillState;
    pill.querySelector("span").textContent = text;
  }

  // ---- REST ---------------------------------------------------------------------------

  function headers() {
    const out = { "X-Headwater-Tenant": state.tenant };
    if (state.token) out.Authorization = "Bearer " + state.token;
    return out;
  }

  class AuthNeeded extends Error {}

  // An error answer: `message` is the server's "Name: message" (what the page shows).
  class ApiError extends Error {}

  async function api(path, method, body) {
    const options = { headers: headers(), cache: "no-store", method: method || "GET" };
    if (body !== undefined) {
      options.body = JSON.stringify(body);
      options.headers["Content-Type"] = "application/json";
    }
    const response = await fetch(path, options);
    if (response.status === 401 || response.status === 403) throw new AuthNeeded(path);
    if (response.status === 204) return null;
    let answer = null;
    try {
      answer = await response.json();
    } catch (err) {
      answer = null;
    }
    if (!response.ok) {
      throw new ApiError(answer && answer.error ? answer.error.name + ": " + answer.error.message : response.status + " " + response.statusText);
    }
    return answer;
  }

  function showError(id, err) {
    const node = $(id);
    if (err instanceof AuthNeeded) node.textContent = "This server needs a token with access to this tenant.";
    else node.textContent = err.message;
    node.hidden = false;
  }

  // ---- charts -------------------------------------------------------------------------

  function niceMax(value) {
    if (value <= 0) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 2.5, 5, 10]) {
      if (value <= step * power) return step * power;
    }
    return 10 * power;
  }

  function niceBytes(value) {
    // Round up in the value's own binary unit, so the axis reads 5 KiB, 10 KiB, ...
    const unit = Math.pow(1024, Math.max(0, Math.floor(Math.log(Math.max(1, value)) / Math.log(1024))));
    return niceMax(value / unit) * unit;
  }

  function drawChart(canvas, points, color, fill, format, floor, nice) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const left = 56;
    const right = 8;
    const top = 8;
    const bottom = 22;
    const plotW = width - left - right;
    const plotH = height - top - bottom;
    const max = nice(Math.max(floor, ...points.map((p) => p.v)) * 1.1);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let i = 0; i <= 4; i += 1) {
      const y = top + plotH - (plotH * i) / 4;
      ctx.strokeStyle = i === 0 ? "#cfd6df" : "#eef1f5";
      ctx.lineWidth = 1;
      ctx.beginPath();
      ctx.moveTo(left, Math.round(y) + 0.5);
      ctx.lineTo(left + plotW, Math.round(y) + 0.5);
      ctx.stroke();
      ctx.fillStyle = "#6b7685";
      ctx.fillText(format((max * i) / 4), left - 8, y);
    }
    // Time axis: the last hour, newest at the right.
    const span = CHART_SPAN_MS;
    const now = Date.now();
    ctx.textAlign = "center";
    ctx.textBaseline = "alphabetic";
    for (const minutes of [60, 45, 30, 15, 0]) {
      const x = left + plotW - (minutes * 60000 * plotW) / span;
      if (x < left - 1) continue;
      ctx.fillText(minutes === 0 ? "now" : "-" + minutes + "m", Math.min(x, left + plotW - 10), height - 6);
    }
    if (points.length < 2) {
      ctx.fillStyle = "#9aa4b1";
      ctx.fillText("collecting samples…", left + plotW / 2, top + plotH / 2);
      return;
    }
    const xOf = (t) => left + plotW - ((now - t) * plotW) / span;
    const yOf = (v) => top + plotH - (v / max) * plotH;
    ctx.beginPath();
    points.forEach((p, i) => (i === 0 ? ctx.moveTo(xOf(p.t), yOf(p.v)) : ctx.lineTo(xOf(p.t), yOf(p.v))));
    ctx.lineTo(xOf(points[points.length - 1].t), top + plotH);
    ctx.lineTo(xOf(points[0].t), top + plotH);
    ctx.closePath();
    ctx.fillStyle = fill;
    ctx.fill();
    ctx.beginPath();
    points.forEach((p, i) => (i === 0 ? ctx.moveTo(xOf(p.t), yOf(p.v)) : ctx.lineTo(xOf(p.t), yOf(p.v))));
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.8;
    ctx.lineJoin = "round";
    ctx.stroke();
  }

  // The server's minutes from before the page's first sample, then the page's samples.
  function chartHistory() {
    const since = Date.now() - CHART_SPAN_MS;
    const first = state.history.length ? state.history[0].t : Infinity;
    return state.serverHistory.filter((h) => h.t >= since && h.t < first).concat(state.history.filter((h) => h.t >= since));
  }

  async function loadHistory() {
    const canvas = $("chart-events");
    try {
      const answer = await api("/api/history");
      const now = Date.now();
      // A minute's rate is drawn at its middle (the current minute's at now).
      state.serverHistory = answer.points.map((p) => ({
        t: Math.min(now, p.t_ms + (answer.interval_s * 1000) / 2),
        events: p.events_per_s,
        bytes: p.bytes_per_s,
      }));
      state.minutes = answer.points.map((p) => ({
        t: Math.min(now, p.t_ms + (answer.interval_s * 1000) / 2),
        reads: p.reads_per_s,
        errors: p.errors_per_s,
      }));
      canvas.dataset.historyPoints = String(answer.points.length);
      canvas.dataset.historyPeak = String(Math.max(0, ...answer.points.map((p) => p.events_per_s)));
      $("chart-reads").dataset.peak = String(Math.max(0, ...answer.points.map((p) => p.reads_per_s)));
      $("chart-errors").dataset.peak = String(Math.max(0, ...answer.points.map((p) => p.errors_per_s)));
      drawCharts();
    } catch (err) {
      canvas.dataset.historyError = err.message;
    }
  }

  function drawCharts() {
    const history = chartHistory();
    const events = history.map((h) => ({ t: h.t, v: h.events }));
    const written = history.map((h) => ({ t: h.t, v: h.bytes }));
    drawChart($("chart-events"), events, "#1f6feb", "rgba(31,111,235,0.12)", compact, 9, niceMax);
    drawChart($("chart-bytes"), written, "#0f9d8a", "rgba(15,157,138,0.12)", bytes, 900, niceBytes);
    const last = history[history.length - 1];
    if (last) {
      $("chart-events-now").textContent = compact(last.events) + " events/s now";
      $("chart-bytes-now").textContent = bytes(last.bytes) + "/s on disk now";
    }
    const reads = state.minutes.map((m) => ({ t: m.t, v: m.reads }));
    const errors = state.minutes.map((m) => ({ t: m.t, v: m.errors }));
    drawChart($("chart-reads"), reads, "#8250df", "rgba(130,80,223,0.12)", compact, 9, niceMax);
    drawChart($("chart-errors"), errors, "#c62828", "rgba(198,40,40,0.10)", compact, 0.9, niceMax);
    const minute = state.minutes[state.minutes.length - 1];
    if (minute) {
      $("chart-reads-now").textContent = compact(minute.reads) + " events/s this minute";
      $("chart-errors-now").textContent = compact(minute.errors) + " errors/s this minute, every tenant";
    }
  }

  // ---- overview -----------------------------------------------------------------------

  function selectableRow(tr, type, name) {
    tr.dataset.type = type;
    tr.dataset.name = name;
    if (live.current && live.current.type === type && live.current.name === name) tr.classList.add("selected");
    tr.addEventListener("click", () => live.select(type, name));
    return tr;
  }

  // The SQL console's example must run as it is shown: one of the tenant's own streams
  // (quoted unless a plain identifier: stream names may hold '.' and '-') and "offset"
  // quoted, a reserved word in DuckDB; SHOW TABLES before there is a stream.
  function sqlExample(streams) {
    if (!streams.length) return "SHOW TABLES";
    const name = streams[0].name;
    const table = /^[A-Za-z_][A-Za-z0-9_]*$/.test(name) ? name : '"' + name + '"';
    return "SELECT * FROM " + table + ' ORDER BY "offset" DESC LIMIT 10';
  }

  function renderStreams(streams, now) {
    $("sql-text").placeholder = sqlExample(streams);
    const previous = state.previous;
    let totalEvents = 0;
    let totalRate = 0;
    let totalBytesRate = 0;
    let totalSize = 0;
    const counters = new Map();
    const rows = [];
    for (const s of streams) {
      counters.set(s.name, { events: s.next_offset, size: s.size_bytes });
      totalEvents += s.next_offset;
      totalSize += s.size_bytes;
      let rate = null;
      let byteRate = null;
      const before = previous && previous.streams.get(s.name);
      if (before) {
        const seconds = (now - previous.t) / 1000;
        rate = Math.max(0, s.next_offset - before.events) / seconds;
        byteRate = Math.max(0, s.size_bytes - before.size) / seconds;
        totalRate += rate;
        totalBytesRate += byteRate;
      }
      rows.push(
        selectableRow(
          row([
            { text: s.name, cls: "name" },
            { text: grouped(s.next_offset), cls: "num" },
            { text: rate === null ? "–" : compact(rate), cls: "num" },
            { text: byteRate === null ? "–" : bytes(byteRate), cls: "num" },
            { text: bytes(s.size_bytes), cls: "num" },
            { text: s.segments, cls: "num" },
            { text: s.sync },
          ]),
          "stream",
          s.name,
        ),
      );
    }
    fillTable("streams-table", "streams-empty", rows);
    if (previous) {
      state.history.push({ t: now, events: totalRate, bytes: totalBytesRate });
      if (state.history.length > HISTORY_POINTS) state.history.shift();
    }
    state.previous = { t: now, streams: counters };
    $("card-streams").textContent = grouped(streams.length);
    $("card-streams-sub").textContent = compact(totalEvents) + " events · " + bytes(totalSize);
    $("card-rate").textContent = previous ? compact(totalRate) : "–";
    const peak = Math.max(0, ...chartHistory().map((h) => h.events));
    $("card-rate-sub").textContent = "peak " + compact(peak) + "/s · " + bytes(totalBytesRate) + "/s";
  }

  function renderKinds(kinds) {
    const rows = [];
    let entities = 0;
    let user = 0;
    for (const k of kinds) {
      if (!k.internal) {
        user += 1;
        entities += k.entities;
      }
      const name = el("td", k.name, "name");
      if (k.internal) name.appendChild(el("span", "system", "badge"));
      if (k.event_stream) name.appendChild(el("span", "events", "badge"));
      rows.push(
        selectableRow(
          row([
            name,
            { text: grouped(k.entities), cls: "num" },
            { text: k.fields.length, cls: "num" },
            { text: k.subscribers, cls: "num" },
            { text: bytes(k.changelog_bytes), cls: "num" },
          ]),
          "kind",
          k.name,
        ),
      );
    }
    fillTable("kinds-table", "kinds-empty", rows);
    $("card-kinds").textContent = grouped(user);
    $("card-kinds-sub").textContent = grouped(entities) + " entities";
  }

  function renderGroups(groups, partitionGroups) {
    let total = 0;
    const rows = groups.map((g) => {
      total += g.lag;
      let status;
      if (g.active) status = badge(g.waiting ? "active +" + g.waiting + " waiting" : "active", "good");
      else status = badge("idle");
      const tr = row([
        { text: g.stream },
        { text: g.group, cls: "name" },
        { text: grouped(g.committed_offset), cls: "num" },
        { text: grouped(g.end_offset), cls: "num" },
        { text: grouped(g.lag), cls: "num" + (g.lag > 1000 ? " lag-high" : "") },
        status,
        resetCell(g),
      ]);
      tr.dataset.stream = g.stream;
      tr.dataset.group = g.group;
      return tr;
    });
    // Kafka and Rivven groups: one row per committed partition (reset them with the
    // client's own tools; the Reset button moves the resume groups above only).
    const partitioned = new Set();
    for (const p of partitionGroups) {
      total += p.lag;
      partitioned.add(p.group);
      const tr = row([
        { text: p.stream + " [" + p.partition + "]" },
        { text: p.group, cls: "name" },
        { text: grouped(p.committed_offset), cls: "num" },
        { text: grouped(p.end_offset), cls: "num" },
        { text: grouped(p.lag), cls: "num" + (p.lag > 1000 ? " lag-high" : "") },
        badge("partition " + p.partition),
        el("td"),
      ]);
      tr.dataset.stream = p.stream;
      tr.dataset.group = p.group;
      tr.dataset.partition = String(p.partition);
      rows.push(tr);
    }
    fillTable("groups-table", "groups-empty", rows);
    const count = groups.length + partitioned.size;
    $("card-lag").textContent = compact(total);
    $("card-lag-sub").textContent = count + (count === 1 ? " group" : " groups");
  }

  function renderSources(sources, workers) {
    const bySlot = new Map();
    for (const w of workers) if (w.connected && w.source_id !== null) bySlot.set(w.source_id, w);
    const shown = new Set();
    const rows = [];
    for (const s of sources) {
      const worker = bySlot.get(s.source_id);
      if (worker) shown.add(worker.worker_id);
      const name = el("td", s.name || (worker ? worker.worker_id : "(unnamed)"), "name");
      if (worker && worker.outputs.length) {
        name.appendChild(el("div", "→ " + worker.outputs.map((o) => o.output).join(", "), "muted"));
      }
      rows.push(
        row([
          { text: s.source_id, cls: "id" },
          name,
          { text: worker ? "Ripple worker" : "ConvergeDB" },
          s.connected ? badge("connected", "good") : badge("grace " + Math.round(s.liveness_deadline_ms / 1000) + "s", "warn"),
          { text: grouped(s.entities), cls: "num" },
          { text: ago(s.idle_ms) },
        ]),
      );
    }
    for (const w of workers) {
      if (shown.has(w.worker_id)) continue;
      const name = el("td", w.worker_id, "name");
      if (w.outputs.length) name.appendChild(el("div", "→ " + w.outputs.map((o) => o.output).join(", "), "muted"));
      const heard = w.last_heartbeat === null ? "never" : ago(Math.max(0, Date.now() - w.last_heartbeat * 1000));
      rows.push(
        row([
          { text: w.source_id === null ? "–" : w.source_id, cls: "id" },
          name,
          { text: "Ripple worker" },
          w.connected ? badge("connected", "good") : badge("disconnected", "bad"),
          { text: "–", cls: "num" },
          { text: heard },
        ]),
      );
    }
    fillTable("sources-table", "sources-empty", rows);
  }

  function renderInfo(info) {
    $("version").textContent = "v" + info.version;
    $("uptime").textContent = "uptime " + duration(info.uptime_seconds);
    $("tenant-pill").textContent = "tenant " + info.tenant.id + (info.tenant.name ? " · " + info.tenant.name : "");
    const connections = info.connections || {};
    const parts = Object.entries(connections).filter(([, n]) => n > 0);
    const total = Object.values(connections).reduce((a, b) => a + b, 0);
    $("card-conns").textContent = grouped(total);
    const perProtocol = parts.length ? parts.map(([p, n]) => p + " " + n).join(" · ") : "none open";
    $("card-conns-sub").textContent = perProtocol;
    $("card-conns-sub").title = perProtocol;
    $("foot-text").textContent = "headwater " + info.version + " · log position " + grouped(info.tenant.log_position);
  }

  async function poll() {
    const now = Date.now();
    try {
      const [info, streams, kinds, groups, sources, workers] = await Promise.all([
        api("/api/info"),
        api("/api/streams"),
        api("/api/kinds"),
        api("/api/consumer-groups"),
        api("/api/sources"),
        api("/api/ripple/workers"),
      ]);
      renderInfo(info);
      renderStreams(streams.streams, now);
      renderKinds(kinds.kinds);
      renderGroups(groups.groups, groups.partition_groups || []);
      renderSources(sources.sources, workers.workers);
      drawCharts();
      setPill("api-status", "ok", "API");
      $("token-form").hidden = true;
    } catch (err) {
      if (err instanceof AuthNeeded) {
        $("token-form").hidden = false;
        setPill("api-status", "error", "API: token needed");
      } else {
        setPill("api-status", "error", "API unreachable");
      }
    }
  }

  // ---- actions: streams, groups, SQL --------------------------------------------------

  const resetTarget = { stream: null, group: null };

  function resetCell(g) {
    const td = el("td");
    const button = el("button", "Reset…", "small");
    button.type = "button";
    button.dataset.action = "reset";
    button.disabled = g.active;
    button.title = g.active ? "a member is consuming: stop it to reset the group" : "move the group's offset";
    button.addEventListener("click", () => openReset(g));
    td.appendChild(button);
    return td;
  }

  function openReset(g) {
    resetTarget.stream = g.stream;
    resetTarget.group = g.group;
    $("group-reset-label").textContent = "Reset group " + g.group + " of " + g.stream + " (now at " + grouped(g.committed_offset) + ")";
    $("group-reset-error").hidden = true;
    $("group-reset-form").hidden = false;
  }

  async function applyReset(event) {
    event.preventDefault();
    const to = $("group-reset-to").value;
    let body;
    if (to === "offset") {
      const text = $("group-reset-offset").value.trim();
      if (!/^[0-9]+$/.test(text)) {
        showError("group-reset-error", new Error("type an offset: a whole number, 0 or more"));
        return;
      }
      body = { offset: Number(text) };
    } else {
      body = { to };
    }
    const path = "/api/consumer-groups/" + encodeURIComponent(resetTarget.stream) + "/" + encodeURIComponent(resetTarget.group) + "/reset";
    try {
      const group = await api(path, "POST", body);
      $("group-reset-form").hidden = true;
      $("group-reset-status").textContent = "Group " + group.group + " of " + group.stream + " now at offset " + grouped(group.committed_offset) + " (lag " + grouped(group.lag) + ").";
      poll();
    } catch (err) {
      showError("group-reset-error", err);
    }
  }

  async function createStream(event) {
    event.preventDefault();
    const name = $("stream-name").value.trim();
    const settings = {};
    if ($("stream-retention").value) settings.retention_ms = Number($("stream-retention").value);
    if ($("stream-sync").value) settings.sync = $("stream-sync").value;
    settings.cleanup_policy = $("stream-cleanup").value;
    try {
      await api("/api/streams", "POST", { name, settings });
      $("stream-form").hidden = true;
      $("stream-form").reset();
      await poll();
      live.select("stream", name);
    } catch (err) {
      showError("stream-form-error", err);
    }
  }

  async function deleteStream() {
    const current = live.current;
    if (!current || current.type !== "stream") return;
    if (!window.confirm("Delete stream " + current.name + " and all its events? This cannot be undone.")) return;
    try {
      await api("/api/streams/" + encodeURIComponent(current.name), "DELETE");
      live.deselect();
      $("live-info").textContent = "stream " + current.name + " deleted";
      poll();
    } catch (err) {
      $("live-info").textContent = "could not delete: " + err.message;
    }
  }

  const SETTING_LABELS = {
    retention_ms: "retention",
    retention_bytes: "retention size",
    segment_ms: "segment age",
    segment_bytes: "segment size",
    cleanup_policy: "cleanup",
    delete_retention_ms: "tombstones kept",
  };

  function settingsText(info) {
    const parts = ["sync " + info.sync];
    const settings = info.settings || {};
    for (const [key, value] of Object.entries(settings)) {
      if (key === "sync") continue;
      const label = SETTING_LABELS[key] || key.replace(/_/g, " ");
      parts.push(label + " " + (key.endsWith("_ms") ? millis(value) : key.endsWith("_bytes") ? bytes(value) : value));
    }
    if (!("retention_ms" in settings) && !("retention_bytes" in settings)) parts.push("retention: server default");
    return parts.join(" · ");
  }

  // What the produce box holds as one event: valid JSON as JSON (stored compact), any
  // other text as that text.
  function producedEvent(text) {
    try {
      return JSON.parse(text);
    } catch (err) {
      return text;
    }
  }

  async function produce(event) {
    event.preventDefault();
    const current = live.current;
    const text = $("produce-value").value;
    if (!current || current.type !== "stream" || text === "") return;
    const status = $("produce-status");
    try {
      const answer = await api("/api/streams/" + encodeURIComponent(current.name) + "/events", "POST", [producedEvent(text)]);
      status.textContent = "appended at offset " + grouped(answer.base_offset);
      status.dataset.offset = String(answer.base_offset);
      // Cleared unless something else was typed meanwhile.
      if ($("produce-value").value === text) $("produce-value").value = "";
    } catch (err) {
      status.textContent = "not appended: " + err.message;
    }
  }

  // The tail's filter: "path=value" compares a (dotted) field of a JSON value; any
  // other text is looked for, case-insensitively, in the key and value.
  function tailFilter(text) {
    const trimmed = text.trim();
    if (!trimmed) return null;
    const field = /^([A-Za-z_$][\w$]*(?:\.[\w$]+)*)\s*=\s*(.*)$/.exec(trimmed);
    if (field) {
      const path = field[1].split(".");
      const expected = field[2];
      return (tr) => {
        let value;
        try {
          value = JSON.parse(tr.dataset.value);
        } catch (err) {
          return false;
        }
        for (const step of path) {
          if (value === null || typeof value !== "object" || !(step in value)) return false;
          value = value[step];
        }
        return (typeof value === "object" ? JSON.stringify(value) : String(value)) === expected;
      };
    }
    const needle = trimmed.toLowerCase();
    return (tr) => tr.dataset.search.includes(needle);
  }

  function applyTailFilter() {
    const match = tailFilter($("tail-filter").value);
    const rows = $("tail-table").tBodies[0].rows;
    let shown = 0;
    for (const tr of rows) {
      tr.hidden = match !== null && !match(tr);
      if (!tr.hidden) shown += 1;
    }
    $("tail-filter-info").textContent = match === null ? "" : shown + " of " + rows.length + " rows match";
  }

  function sqlCell(value) {
    if (value === null) return { text: "NULL", cls: "null" };
    if (typeof value === "object") return { text: JSON.stringify(value) };
    return { text: value };
  }

  async function runSql(event) {
    if (event) event.preventDefault();
    const box = $("sql-text");
    // Run on an empty box runs the example shown in it, typed in so it can be edited.
    if (!box.value.trim()) box.value = box.placeholder;
    const text = box.value;
    const table = $("sql-table");
    $("sql-error").hidden = true;
    $("sql-run").disabled = true;
    $("sql-info").textContent = "running…";
    const started = performance.now();
    try {
      const result = await api("/api/sql", "POST", { sql: text });
      const ms = Math.round(performance.now() - started);
      table.tHead.rows[0].replaceChildren(...result.columns.map((c) => el("th", c)));
      const rows = result.rows.slice(0, SQL_ROWS).map((r) => row(r.map(sqlCell)));
      table.tBodies[0].replaceChildren(...rows);
      table.hidden = false;
      const count = result.rows.length;
      $("sql-info").textContent = grouped(count) + (count === 1 ? " row" : " rows") + (count > SQL_ROWS ? " (first " + grouped(SQL_ROWS) + " shown)" : "") + " · " + ms + " ms";
    } catch (err) {
      table.hidden = true;
      $("sql-info").textContent = "";
      showError("sql-error", err);
    } finally {
      $("sql-run").disabled = false;
    }
  }

  // ---- live view over /ws -------------------------------------------------------------

  function fieldText(type, value) {
    if (value === null || value === undefined) return "";
    if (type === "timestamp" && typeof value === "number") {
      return new Date(value / 1e6).toISOString().replace("T", " ").replace("Z", "");
    }
    if (typeof value === "number" && !Number.isInteger(value)) return String(Number(value.toPrecision(8)));
    return String(value);
  }

  // Entity ids are 32 bytes: show text ids (NUL-padded ASCII) as text, small numbers
  // without their leading zeros, anything else shortened; the row's title has all of it.
  function entityLabel(hex) {
    const trimmedEnd = hex.replace(/(00)+$/, "");
    if (trimmedEnd.length > 0) {
      let text = "";
      for (let i = 0; i < trimmedEnd.length; i += 2) {
        const code = parseInt(trimmedEnd.slice(i, i + 2), 16);
        if (code < 0x20 || code > 0x7e) {
          text = null;
          break;
        }
        text += String.fromCharCode(code);
      }
      if (text) return text;
    }
    const trimmedStart = hex.replace(/^(00)+/, "");
    if (trimmedStart.length <= 16) return "0x" + (trimmedStart || "0");
    return hex.slice(0, 8) + "…" + hex.slice(-8);
  }

  class Live {
    constructor() {
      this.socket = null;
      this.current = null; // {type, name}
      this.retryMs = 500;
      this.paused = false;
      this.held = [];
      this.tail = null; // {lastOffset, loading, pending}
      this.kind = null; // {fields, rows: Map(entityId -> {version, fields, tr}), loading, pending}
    }

    url() {
      const query = new URLSearchParams();
      if (state.token) query.set("token", state.token);
      if (state.tenant !== "0") query.set("tenant", state.tenant);
      const qs = query.toString();
      return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws" + (qs ? "?" + qs : "");
    }

    connect() {
      setPill("ws-status", "connecting", "live: connecting");
      const socket = new WebSocket(this.url());
      this.socket = socket;
      socket.addEventListener("open", () => {
        this.retryMs = 500;
        setPill("ws-status", "ok", "live: connected");
        if (this.current) {
          $("live-panel").dataset.subscribed = "false";
          this.send({ type: "SUBSCRIBE", sourceId: this.current.name, mode: "push" });
        }
      });
      socket.addEventListener("message", (event) => this.onFrame(event.data));
      socket.addEventListener("close", () => {
        if (this.socket !== socket) return;
        this.socket = null;
        setPill("ws-status", "error", "live: reconnecting");
        setTimeout(() => this.connect(), this.retryMs);
        this.retryMs = Math.min(RECONNECT_MAX_MS, this.retryMs * 2);
      });
    }

    send(frame) {
      if (this.socket && this.socket.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify(frame));
    }

    info(text) {
      $("live-info").textContent = text;
    }

    select(type, name) {
      if (this.current && this.current.type === type && this.current.name === name) return;
      if (this.current) this.send({ type: "UNSUBSCRIBE", sourceId: this.current.name });
      this.current = { type, name };
      this.held = [];
      for (const tr of document.querySelectorAll("tr.selected")) tr.classList.remove("selected");
      for (const tr of document.querySelectorAll("tr[data-type]")) {
        if (tr.dataset.type === type && tr.dataset.name === name) tr.classList.add("selected");
      }
      $("live-empty").hidden = true;
      $("live-pause").disabled = false;
      $("live-clear").disabled = false;
      $("live-title").textContent = (type === "stream" ? "Live tail: " : "Live table: ") + name;
      $("tail-table").hidden = type !== "stream";
      $("kind-table").hidden = type !== "kind";
      $("stream-tools").hidden = type !== "stream";
      $("stream-settings").textContent = "–";
      $("produce-status").textContent = "";
      $("tail-filter-info").textContent = "";
      this.info("subscribing…");
      const panel = $("live-panel");
      panel.dataset.subscribed = "false";
      panel.dataset.loaded = "false";
      // Subscribe first (subscriptions start live), then load what is already there;
      // frames arriving meanwhile wait in `pending` and are merged by offset / version.
      this.send({ type: "SUBSCRIBE", sourceId: name, mode: "push" });
      if (type === "stream") this.startTail(name);
      else this.startKind(name);
    }

    // Nothing watched (the stream was deleted): back to the empty view.
    deselect() {
      if (this.current) this.send({ type: "UNSUBSCRIBE", sourceId: this.current.name });
      this.current = null;
      this.tail = null;
      this.kind = null;
      this.held = [];
      for (const tr of document.querySelectorAll("tr.selected")) tr.classList.remove("selected");
      $("tail-table").tBodies[0].replaceChildren();
      $("tail-table").hidden = true;
      $("kind-table").hidden = true;
      $("stream-tools").hidden = true;
      $("live-empty").hidden = false;
      $("live-pause").disabled = true;
      $("live-clear").disabled = true;
      $("live-title").textContent = "Live view";
      delete $("live-panel").dataset.subscribed;
      delete $("live-panel").dataset.loaded;
    }

    async startTail(name) {
      const tail = { name, lastOffset: -1, loading: true, pending: [], count: 0 };
      this.tail = tail;
      this.kind = null;
      $("tail-table").tBodies[0].replaceChildren();
      try {
        const info = await api("/api/streams/" + encodeURIComponent(name));
        if (this.tail === tail) $("stream-settings").textContent = settingsText(info);
        const from = Math.max(info.start_offset, info.next_offset - TAIL_BACKFILL);
        const page = await api("/api/streams/" + encodeURIComponent(name) + "/events?from=" + from + "&limit=" + TAIL_BACKFILL);
        if (this.tail !== tail) return;
        for (const e of page.events) {
          this.addTailRow(tail, { offset: e.offset, timestamp: e.timestamp_ms, key: e.key_b64 ? atob(e.key_b64) : null, value: e.value, payload: e.value_b64 }, false);
        }
      } catch (err) {
        if (this.tail === tail) this.info("could not load recent events: " + err.message);
      }
      if (this.tail === tail) this.loaded(tail, (data) => this.addTailRow(tail, data, true), () => this.tailInfo());
    }

    // A view's first page is in: apply what arrived live meanwhile, in order, and say so.
    loaded(view, apply, info) {
      view.loading = false;
      for (const data of view.pending) apply(data);
      view.pending = [];
      $("live-panel").dataset.loaded = "true";
      info();
    }

    tailInfo() {
      if (this.tail) this.info(grouped(this.tail.count) + " events shown" + (this.paused ? " · paused" : ""));
    }

    addTailRow(tail, data, fresh) {
      if (data.offset <= tail.lastOffset) return;
      tail.lastOffset = data.offset;
      tail.count += 1;
      const value = data.value !== null && data.value !== undefined ? data.value : "base64:" + (data.payload || "");
      const key = data.key === null || data.key === undefined ? "–" : data.key;
      const tr = row([
        { text: data.offset, cls: "num id" },
        { text: data.timestamp ? isoTime(data.timestamp) : "–" },
        { text: key },
        { text: value, cls: "value" },
      ]);
      tr.dataset.offset = data.offset;
      tr.dataset.value = value;
      tr.dataset.search = (key + "\n" + value).toLowerCase();
      const match = tailFilter($("tail-filter").value);
      if (match !== null) tr.hidden = !match(tr);
      if (fresh) tr.classList.add("flash");
      const tbody = $("tail-table").tBodies[0];
      tbody.insertBefore(tr, tbody.firstChild);
      while (tbody.rows.length > TAIL_ROWS) tbody.deleteRow(tbody.rows.length - 1);
      if (match !== null) applyTailFilter();
    }

    async startKind(name) {
      const kind = { name, fields: [], rows: new Map(), loading: true, pending: [], total: 0 };
      this.kind = kind;
      this.tail = null;
      const table = $("kind-table");
      table.tBodies[0].replaceChildren();
      table.tHead.rows[0].replaceChildren();
      try {
        const page = await api("/api/kinds/" + encodeURIComponent(name) + "/entities?limit=" + KIND_ROWS);
        if (this.kind !== kind) return;
        kind.fields = page.fields;
        kind.total = page.total;
        const head = [el("th", "Entity"), el("th", "Version", "num")];
        for (const f of page.fields) head.push(el("th", f.name));
        table.tHead.rows[0].replaceChildren(...head);
        for (const e of page.entities) this.applyEntity(kind, { entityId: e.entity_id, version: e.version, change: "created", fields: e.fields }, false);
      } catch (err) {
        if (this.kind === kind) this.info("could not load entities: " + err.message);
      }
      if (this.kind === kind) this.loaded(kind, (data) => this.applyEntity(kind, data, true), () => this.kindInfo());
    }

    kindInfo() {
      if (this.kind) this.info(grouped(this.kind.rows.size) + " entities shown" + (this.paused ? " · paused" : ""));
    }

    applyEntity(kind, data, fresh) {
      const known = kind.rows.get(data.entityId);
      if (known && data.version < known.version) return;
      const tbody = $("kind-table").tBodies[0];
      if (data.change === "deleted") {
        if (!known) return;
        known.version = data.version;
        known.tr.classList.remove("flash");
        known.tr.classList.add("gone");
        kind.rows.delete(data.entityId);
        setTimeout(() => known.tr.remove(), 3000);
        return;
      }
      const fields = Object.assign({}, known ? known.fields : {}, data.fields || {});
      const tr = row([
        { text: entityLabel(data.entityId), cls: "id" },
        { text: data.version, cls: "num" },
        ...kind.fields.map((f) => ({ text: fieldText(f.type, fields[f.name]) })),
      ]);
      tr.title = data.entityId;
      tr.dataset.entity = data.entityId;
      if (fresh) tr.classList.add("flash");
      if (known) {
        known.tr.replaceWith(tr);
      } else if (fresh) {
        tbody.insertBefore(tr, tbody.firstChild);
      } else {
        tbody.appendChild(tr);
      }
      kind.rows.set(data.entityId, { version: data.version, fields, tr });
      if (!known && kind.rows.size > KIND_ROWS) {
        const last = tbody.rows[tbody.rows.length - 1];
        kind.rows.delete(last.dataset.entity);
        last.remove();
      }
    }

    onFrame(text) {
      let frame;
      try {
        frame = JSON.parse(text);
      } catch (err) {
        return;
      }
      const data = frame.data || {};
      const mine = this.current && data.sourceId === this.current.name;
      switch (frame.type) {
        case "RESULT":
          if (!mine) return;
          if (this.paused) {
            this.held.push(data);
            if (this.held.length > TAIL_ROWS * 10) this.held.shift();
          } else {
            this.deliver(data);
          }
          return;
        case "SUBSCRIBE_OK":
          if (mine) $("live-panel").dataset.subscribed = "true";
          return;
        case "SUBSCRIBE_ERROR":
          if (mine) this.info("cannot subscribe: " + data.error);
          return;
        case "NOTICE":
          if (!mine) return;
          if (data.type === "LAG") this.info("skipped " + grouped(data.count) + " events (the browser fell behind)");
          else if (data.type === "SUBSCRIPTION_CLOSED") this.info("subscription closed: " + data.message);
          return;
        default:
          return;
      }
    }

    deliver(data) {
      if (this.tail && data.sourceType !== "entity") {
        if (this.tail.loading) this.tail.pending.push(data);
        else {
          this.addTailRow(this.tail, data, true);
          this.tailInfo();
        }
      } else if (this.kind && data.sourceType === "entity") {
        if (this.kind.loading) this.kind.pending.push(data);
        else {
          this.applyEntity(this.kind, data, true);
          this.kindInfo();
        }
      }
    }

    togglePause() {
      this.paused = !this.paused;
      $("live-pause").textContent = this.paused ? "Resume" : "Pause";
      if (!this.paused) {
        const held = this.held;
        this.held = [];
        for (const data of held) this.deliver(data);
      }
      if (this.tail) this.tailInfo();
      else this.kindInfo();
    }

    clear() {
      if (this.tail) {
        $("tail-table").tBodies[0].replaceChildren();
        this.tail.count = 0;
        this.tailInfo();
      } else if (this.kind) {
        $("kind-table").tBodies[0].replaceChildren();
        this.kind.rows.clear();
        this.kindInfo();
      }
    }
  }

  const live = new Live();

  // ---- start --------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("streams-table").classList.add("selectable");
    $("kinds-table").classList.add("selectable");
    $("live-pause").addEventListener("click", () => live.togglePause());
    $("live-clear").addEventListener("click", () => live.clear());
    $("stream-new").addEventListener("click", () => {
      $("stream-form-error").hidden = true;
      $("stream-form").hidden = false;
      $("stream-name").focus();
    });
    $("stream-cancel").addEventListener("click", () => ($("stream-form").hidden = true));
    $("stream-form").addEventListener("submit", createStream);
    $("stream-delete").addEventListener("click", deleteStream);
    $("produce-form").addEventListener("submit", produce);
    $("tail-filter").addEventListener("input", applyTailFilter);
    $("sql-form").addEventListener("submit", runSql);
    $("sql-text").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) runSql(event);
    });
    $("group-reset-to").addEventListener("change", () => ($("group-reset-offset").hidden = $("group-reset-to").value !== "offset"));
    $("group-reset-form").addEventListener("submit", applyReset);
    $("group-reset-cancel").addEventListener("click", () => ($("group-reset-form").hidden = true));
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.token = $("token-input").value.trim();
      sessionStorage.setItem(TOKEN_KEY, state.token);
      if (live.socket) live.socket.close();
      loadHistory();
      poll();
    });
    window.addEventListener("resize", drawCharts);
    live.connect();
    loadHistory();
    poll();
    setInterval(poll, POLL_MS);
    setInterval(loadHistory, HISTORY_REFRESH_MS);
    drawCharts();
  });
})();
