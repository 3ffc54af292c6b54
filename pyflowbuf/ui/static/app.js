// The web view of a pyflowbuf job: plain JavaScript, no library, no build step.
// It polls the JSON endpoints of the process that serves it about once a second
// and redraws the current view; once the job ended it draws the final state once more.
"use strict";
(function () {
  const TOKEN = new URLSearchParams(location.search).get("token");
  const POLL_MS = 1000;
  const main = document.getElementById("main");
  let job = null;           // the last /api/job answer
  let ended = false;        // the job ended and its final state was drawn
  let timer = null;
  let busy = false;

  function api(path) {
    const url = "/api/" + path + (TOKEN ? (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN) : "");
    return fetch(url, { cache: "no-store" }).then(function (r) {
      if (!r.ok) { return r.text().then(function (t) { throw new Error(r.status + " " + t); }); }
      return r.json();
    });
  }
  function esc(s) {
    return String(s == null ? "" : s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  function num(x, digits) {
    if (x == null) return "–";
    const a = Math.abs(x);
    if (a >= 1e9) return (x / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (x / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (x / 1e3).toFixed(1) + "k";
    return digits == null ? String(Math.round(x)) : x.toFixed(digits);
  }
  function bytes(x) {
    if (x == null) return "–";
    if (x >= 1 << 30) return (x / (1 << 30)).toFixed(1) + " GiB";
    if (x >= 1 << 20) return (x / (1 << 20)).toFixed(1) + " MiB";
    if (x >= 1 << 10) return (x / (1 << 10)).toFixed(1) + " KiB";
    return x + " B";
  }
  function ms(x) { return x == null ? "–" : (x >= 1000 ? (x / 1000).toFixed(2) + " s" : x.toFixed(1) + " ms"); }
  function pct(x) { return x == null ? "–" : Math.round(x * 100) + " %"; }
  function level(l) { return l ? '<span class="lvl ' + esc(l) + '">' + esc(l) + "</span>" : "–"; }
  function live(s) { return s.state === "RUNNING" || s.state === "CREATED"; }
  function when(t) { return t == null ? "–" : new Date(t * 1000).toLocaleTimeString(); }
  function wmText(w, end) {
    if (end) return "end of input";
    if (w == null) return "none yet";
    return w > 1e9 ? new Date(w * 1000).toISOString().replace("T", " ").replace("Z", "") : w.toFixed(3);
  }

  // Flink's colours: blue when idle, through to red when busy, black when
  // backpressured; a node takes the maximum over its running subtasks.
  function shade(busyMs, bpMs) {
    const b = Math.min(1, busyMs / 1000), p = Math.min(1, bpMs / 1000);
    const hue = 210 * (1 - b);
    const light = 45 * (1 - p);
    return "hsl(" + hue.toFixed(0) + ", 70%, " + light.toFixed(1) + "%)";
  }
  function shadeName(n) {
    if (!n.live_subtasks) return "ended";
    if (n.max_backpressured_ms_per_s >= 500) return "black";
    if (n.max_busy_ms_per_s >= 500) return "red";
    return "blue";
  }

  // A layered layout, left to right: a node's column is its longest path from
  // a source; within a column nodes follow the mean row of their inputs.
  function layout(nodes, edges) {
    const ins = {}, col = {}, row = {};
    nodes.forEach(function (n) { ins[n.id] = []; });
    edges.forEach(function (e) { if (ins[e.target]) ins[e.target].push(e.source); });
    const order = nodes.map(function (n) { return n.id; });
    function depth(id, seen) {
      if (col[id] != null) return col[id];
      if (seen[id]) return 0;
      seen[id] = true;
      let d = 0;
      ins[id].forEach(function (s) { d = Math.max(d, depth(s, seen) + 1); });
      col[id] = d;
      return d;
    }
    order.forEach(function (id) { depth(id, {}); });
    const cols = [];
    order.forEach(function (id) { (cols[col[id]] = cols[col[id]] || []).push(id); });
    cols.forEach(function (ids) {
      ids.forEach(function (id, i) {
        const r = ins[id].map(function (s) { return row[s]; }).filter(function (x) { return x != null; });
        row[id] = r.length ? r.reduce(function (a, b) { return a + b; }, 0) / r.length + i * 1e-3 : i;
      });
      ids.sort(function (a, b) { return row[a] - row[b]; });
      let last = -1;
      ids.forEach(function (id) { row[id] = Math.max(Math.round(row[id]), last + 1); last = row[id]; });
    });
    return { col: col, row: row, cols: cols.length, rows: Math.max.apply(null, order.map(function (id) { return row[id]; }).concat([0])) + 1 };
  }

  const NW = 240, NH = 74, GX = 150, GY = 40;
  function renderGraph(g) {
    const L = layout(g.nodes, g.edges);
    const W = L.cols * (NW + GX) + 20, H = L.rows * (NH + GY) + 20;
    const pos = {};
    g.nodes.forEach(function (n) { pos[n.id] = { x: 10 + L.col[n.id] * (NW + GX), y: 10 + L.row[n.id] * (NH + GY) }; });
    let s = '<svg id="graph" xmlns="http://www.w3.org/2000/svg" width="' + W + '" height="' + H + '">';
    s += '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0L10,5L0,10z" fill="#7a8396"/></marker></defs>';
    g.edges.forEach(function (e) {
      const a = pos[e.source], b = pos[e.target];
      if (!a || !b) return;
      const x1 = a.x + NW, y1 = a.y + NH / 2, x2 = b.x, y2 = b.y + NH / 2, mx = (x1 + x2) / 2;
      s += '<path class="edge" data-source="' + e.source + '" data-target="' + e.target + '" d="M' + x1 + "," + y1 + " C" + mx + "," + y1 + " " + mx + "," + y2 + " " + (x2 - 2) + "," + y2 + '" fill="none" stroke="#7a8396" stroke-width="1.5" marker-end="url(#arrow)"/>';
      let label = e.partitioner.toUpperCase() + (e.side_output ? " [" + e.side_output + "]" : "");
      const ly = (y1 + y2) / 2 - 5;
      s += '<text class="edge-label" x="' + mx + '" y="' + ly + '" text-anchor="middle">' + esc(label) + "</text>";
      if (e.inflight_bytes != null) {
        // with debloating on: what the gate holds, and the buffer size it announced
        s += '<text class="edge-label" x="' + mx + '" y="' + (ly + 18) + '" text-anchor="middle">' + esc(bytes(e.inflight_bytes) + " in flight") + "</text>";
        s += '<text class="edge-label" x="' + mx + '" y="' + (ly + 31) + '" text-anchor="middle">' + esc("buffer " + bytes(e.buffer_size)) + "</text>";
      }
    });
    g.nodes.forEach(function (n) {
      const p = pos[n.id], kind = shadeName(n);
      const fill = kind === "ended" ? "#9aa3b5" : shade(n.max_busy_ms_per_s, n.max_backpressured_ms_per_s);
      s += '<g class="node" data-id="' + n.id + '" data-shade="' + kind + '" data-level="' + esc(n.level || "") + '" data-out="' + Math.round(n.records_out_per_s) + '" transform="translate(' + p.x + "," + p.y + ')">';
      s += "<title>" + esc(n.operators.join(" → ")) + "</title>";
      s += '<rect width="' + NW + '" height="' + NH + '" rx="6" fill="' + fill + '" stroke="#1d2330" stroke-width="1"/>';
      const name = n.name.length > 34 ? n.name.slice(0, 33) + "…" : n.name;
      s += '<text class="title" x="8" y="17">' + esc(name) + "</text>";
      s += '<text x="8" y="33">parallelism ' + n.parallelism + " · " + (n.live_subtasks ? (n.level || "OK") : "ended") + "</text>";
      s += '<text x="8" y="49">in ' + num(n.records_in_per_s) + "/s · out " + num(n.records_out_per_s) + "/s</text>";
      s += '<text x="8" y="65">busy ' + Math.round(n.max_busy_ms_per_s / 10) + " % · backpr. " + Math.round(n.max_backpressured_ms_per_s / 10) + " %</text>";
      s += "</g>";
    });
    s += "</svg>";
    main.innerHTML = '<div class="legend"><span><span class="swatch sw-idle"></span>idle</span><span><span class="swatch sw-busy"></span>busy</span>' +
      '<span><span class="swatch sw-bp"></span>backpressured</span><span><span class="swatch sw-end"></span>ended</span>' +
      '<span class="muted">max over each node\'s subtasks; click a node for its subtasks</span></div>' +
      '<div class="graph-wrap">' + s + "</div>";
  }

  const SUB_COLS = [
    ["subtask", "#", function (r) { return r.subtask + 1; }],
    ["worker", "worker", function (r) { return r.worker == null ? "–" : r.worker; }],
    ["host", "host", function (r) { return esc(r.host); }, "l"],
    ["state", "state", function (r) { return esc(r.state || "–"); }, "l"],
    ["level", "level", function (r) { return level(r.level); }],
    ["busy", "busy ms/s", function (r) { return live(r) ? num(r.busy_ms_per_s) : "–"; }],
    ["bp", "backpr. ms/s", function (r) { return live(r) ? num(r.backpressured_ms_per_s) : "–"; }],
    ["idle", "idle ms/s", function (r) { return live(r) ? num(r.idle_ms_per_s) : "–"; }],
    ["rin", "records in", function (r) { return num(r.records_in); }],
    ["rout", "records out", function (r) { return num(r.records_out); }],
    ["rins", "in/s", function (r) { return num(r.records_in_per_s); }],
    ["routs", "out/s", function (r) { return num(r.records_out_per_s); }],
    ["bin", "bytes in", function (r) { return bytes(r.bytes_in); }],
    ["bout", "bytes out", function (r) { return bytes(r.bytes_out); }],
    ["inpool", "in pool", function (r) { return pct(r.in_pool_usage); }],
    ["outpool", "out pool", function (r) { return pct(r.out_pool_usage); }],
    ["credit", "credit (backlog)", function (r) { return r.credit_available == null ? "–" : num(r.credit_available) + " (" + num(r.sender_backlog) + ")"; }],
    ["inflight", "in flight", function (r) { return bytes(r.debloat_inflight_bytes); }],
    ["bufsize", "buffer size", function (r) { return bytes(r.debloat_buffer_size); }],
    ["ttc", "time to consume", function (r) { return r.debloat_time_to_consume_s == null ? "–" : r.debloat_time_to_consume_s.toFixed(2) + " s"; }],
    ["wm", "watermark", function (r) { return esc(r.hasOwnProperty("watermark") ? wmText(r.watermark, r.watermark_end) : "–"); }],
    ["ckpt", "last ckpt", function (r) { return r.last_checkpoint || "–"; }],
  ];
  function subtaskTable(rows, withName) {
    let s = '<table class="subtasks"><thead><tr>' + (withName ? '<th class="l">task</th>' : "");
    SUB_COLS.forEach(function (c) { s += '<th class="' + (c[3] || "") + '">' + c[1] + "</th>"; });
    s += "</tr></thead><tbody>";
    rows.forEach(function (r) {
      s += '<tr class="subtask" data-task="' + esc(r.task) + '" data-worker="' + (r.worker == null ? "" : r.worker) + '">' + (withName ? '<td class="l">' + esc(r.task) + "</td>" : "");
      SUB_COLS.forEach(function (c) { s += '<td class="' + (c[3] || "") + '">' + c[2](r) + "</td>"; });
      s += "</tr>";
    });
    return s + "</tbody></table>";
  }
  function renderSubtasks(rows, vertices, vid, total) {
    let pick = '<div class="pick">operator chain: <select id="vertex-pick"><option value="">all (' + total + ' subtasks)</option>';
    vertices.forEach(function (v) { pick += '<option value="' + v.id + '"' + (String(v.id) === vid ? " selected" : "") + ">" + esc(v.name) + " (" + v.parallelism + ")</option>"; });
    pick += "</select></div>";
    const shown = vid === "" ? rows : rows.filter(function (r) { return String(r.vertex_id) === vid; });
    main.innerHTML = pick + '<div class="table-wrap">' + subtaskTable(shown, true) + "</div>";
  }

  function topTable(title, rows, key, cls) {
    let s = '<div><h2>' + title + '</h2><table class="top ' + cls + '"><thead><tr><th class="l">subtask</th><th>worker</th><th>' +
      key[1] + '</th><th>level</th><th>in/s</th></tr></thead><tbody>';
    rows.forEach(function (r) {
      s += '<tr class="click top-row" data-vertex="' + r.vertex_id + '" data-task="' + esc(r.task) + '"><td class="l">' + esc(r.task) + "</td><td>" +
        (r.worker == null ? "–" : r.worker) + "</td><td>" + num(r[key[0]]) + "</td><td>" + level(r.level) + "</td><td>" + num(r.records_in_per_s) + "</td></tr>";
    });
    if (!rows.length) s += '<tr><td class="l muted" colspan="5">no running subtask</td></tr>';
    return s + "</tbody></table></div>";
  }
  // Ranked by the server, once per metrics sample: n rows of each ranking, not every subtask.
  function renderTop(t) {
    main.innerHTML = '<div class="grid3">' +
      topTable("Most backpressured", t.backpressured, ["backpressured_ms_per_s", "backpr. ms/s"], "top-bp") +
      topTable("Busiest", t.busy, ["busy_ms_per_s", "busy ms/s"], "top-busy") +
      topTable("Most idle", t.idle, ["idle_ms_per_s", "idle ms/s"], "top-idle") + "</div>" +
      '<p class="muted">' + (t.n < t.running ? "The " + t.n + " of " + t.running + " running subtasks" : "All " + t.running + " running subtasks") +
      " with the most of each first; click one for its operator chain's subtasks.</p>";
  }

  function renderCheckpoints(list) {
    if (!job.checkpointing) { main.innerHTML = '<p class="muted">Checkpointing is off for this job (set checkpoint_interval).</p>'; return; }
    let s = '<h2>Checkpoint history</h2><table class="checkpoints"><thead><tr><th>id</th><th class="l">kind</th><th class="l">status</th><th>triggered</th>' +
      "<th>duration</th><th>acknowledged</th><th>state</th><th>in-flight persisted</th><th>slowest alignment</th><th>slowest async</th></tr></thead><tbody>";
    list.slice().reverse().forEach(function (c) {
      s += '<tr class="click checkpoint" data-id="' + c.id + '"><td>' + c.id + '</td><td class="l">' + esc(c.kind) + '</td><td class="l">' + esc(c.status) +
        "</td><td>" + when(c.trigger_time) + "</td><td>" + (c.duration_s == null ? "–" : ms(c.duration_s * 1000)) + "</td><td>" +
        (c.acknowledged == null ? "–" : c.acknowledged + "/" + c.tasks) + "</td><td>" + bytes(c.state_bytes) + "</td><td>" + bytes(c.inflight_bytes) +
        "</td><td>" + ms(c.phases.alignment_ms) + "</td><td>" + ms(c.phases.async_ms) + "</td></tr>";
    });
    if (!list.length) s += '<tr><td class="l muted" colspan="10">no checkpoint yet</td></tr>';
    main.innerHTML = s + '</tbody></table><p class="muted">Click a checkpoint for its timeline, one row per subtask.</p>';
  }
  const PHASES = [["start_delay_ms", "ph-delay", "start delay (trigger → barrier at the task)"], ["alignment_ms", "ph-align", "alignment"],
    ["sync_ms", "ph-sync", "synchronous part"], ["async_ms", "ph-async", "asynchronous part"]];
  function renderTimeline(c) {
    const W = 520;
    const span = Math.max.apply(null, c.timeline.map(function (r) { return r.ack_ms || 0; }).concat([1]));
    let s = "<h2>Checkpoint " + c.id + " · " + esc(c.kind) + " · " + esc(c.status) + " · " + (c.duration_s == null ? "" : ms(c.duration_s * 1000)) +
      ' <a href="#checkpoints">(back to the history)</a></h2><div class="bar-legend">';
    PHASES.forEach(function (p) { s += '<span><span class="swatch ' + p[1] + '"></span>' + p[2] + "</span>"; });
    s += '<span><span class="swatch ph-rest"></span>waiting for the write, acknowledgement</span></div>';
    s += '<table class="timeline"><thead><tr><th class="l">subtask (slowest first)</th><th class="l">timeline (0 – ' + ms(span) + ')</th><th>start delay</th><th>alignment</th><th>sync</th><th>async</th><th>acknowledged</th><th>state</th><th>in-flight</th><th class="l">aligned</th></tr></thead><tbody>';
    c.timeline.forEach(function (r) {
      let x = 0, bars = "";
      const scale = W / span;
      PHASES.forEach(function (p) {
        const w = (r[p[0]] || 0) * scale;
        bars += '<rect class="' + p[1] + '" x="' + x.toFixed(1) + '" y="2" width="' + Math.max(w, 0).toFixed(1) + '" height="12"/>';
        x += w;
      });
      const rest = Math.max(0, (r.ack_ms || 0) * scale - x);
      bars += '<rect class="ph-rest" x="' + x.toFixed(1) + '" y="2" width="' + rest.toFixed(1) + '" height="12"/>';
      s += '<tr class="timeline-row" data-key="' + esc(r.key) + '"><td class="l">' + esc(r.task) + '</td><td class="l"><svg width="' + W + '" height="16">' + bars + "</svg></td><td>" +
        ms(r.start_delay_ms) + "</td><td>" + ms(r.alignment_ms) + "</td><td>" + ms(r.sync_ms) + "</td><td>" + ms(r.async_ms) + "</td><td>" + ms(r.ack_ms) + "</td><td>" +
        bytes(r.state_bytes) + "</td><td>" + bytes(r.inflight_bytes) + '</td><td class="l">' + (r.unaligned ? '<span class="tag unaligned">unaligned</span>' : '<span class="tag">aligned</span>') + "</td></tr>";
    });
    main.innerHTML = s + "</tbody></table>";
  }

  function renderWatermarks(list) {
    const any = list.some(function (w) { return w.event_time; });
    let s = "<h2>Watermarks of every operator chain</h2>";
    if (!any) s += '<p class="muted">No operator of this job keeps event time (assign_timestamps): no watermarks.</p>';
    s += '<table class="watermarks"><thead><tr><th class="l">operator chain</th><th class="l">watermark (min over subtasks)</th><th>lag behind now</th><th class="l">subtasks</th></tr></thead><tbody>';
    list.forEach(function (w) {
      const subs = w.subtasks.map(function (x) { return x == null ? "–" : wmText(x, false); });
      s += '<tr class="watermark" data-id="' + w.id + '"><td class="l">' + esc(w.name) + '</td><td class="l">' + (w.event_time ? esc(wmText(w.watermark, w.watermark_end)) : "–") +
        "</td><td>" + (w.lag_s == null ? "–" : w.lag_s.toFixed(1) + " s") + '</td><td class="l">' + esc(subs.length > 8 ? subs.slice(0, 8).join(", ") + ", …" : subs.join(", ")) + "</td></tr>";
    });
    main.innerHTML = s + '</tbody></table><p class="muted">Event time is in seconds; the lag is wall-clock time minus the watermark (meaningful when timestamps are wall-clock seconds).</p>';
  }

  function route() {
    const h = (location.hash || "#graph").slice(1).split("/");
    return { view: h[0] || "graph", arg: h[1] || "" };
  }
  // One request per refresh: /api/live answers the job's state and what the
  // current view shows (the subtasks of one chain only, when one is picked).
  function poll() {
    const r = route();
    document.querySelectorAll("nav a").forEach(function (a) { a.classList.toggle("active", a.dataset.view === r.view); });
    let q = "live?view=" + encodeURIComponent(r.view);
    if (r.view === "subtasks" && r.arg) q += "&vertex=" + encodeURIComponent(r.arg);
    if (r.view === "checkpoints" && r.arg) q += "&checkpoint=" + encodeURIComponent(r.arg);
    if (r.view === "top" && r.arg) q += "&n=" + encodeURIComponent(r.arg);   // #top/20: 20 of each
    if (["graph", "subtasks", "top", "checkpoints", "watermarks"].indexOf(r.view) < 0) {
      return api("job").then(function (j) { return { job: j, render: function () {
        main.innerHTML = '<p class="muted">No such view: ' + esc(r.view) + "</p>"; } }; });
    }
    return api(q).then(function (a) {
      let render;
      if (r.view === "graph") render = function () { renderGraph(a.graph); };
      else if (r.view === "subtasks") render = function () { renderSubtasks(a.subtasks, a.vertices, r.arg, a.job.subtasks); };
      else if (r.view === "top") render = function () { renderTop(a.top); };
      else if (r.view === "checkpoints") render = function () { if (r.arg) { renderTimeline(a.checkpoint); } else { renderCheckpoints(a.checkpoints); } };
      else render = function () { renderWatermarks(a.watermarks); };
      return { job: a.job, render: render };
    });
  }
  function drawJob(j) {
    job = j;
    document.title = j.name + " · pyflowbuf";
    document.getElementById("job-name").textContent = j.name;
    const st = document.getElementById("job-state");
    st.textContent = j.state; st.className = "state " + j.state;
    document.getElementById("job-meta").textContent = j.subtasks + " subtasks in " + j.vertices + " chains" +
      (j.workers ? " · " + j.workers + " workers" : "") + " · " + (j.duration_s == null ? "" : j.duration_s.toFixed(0) + " s") +
      (j.restarts ? " · " + j.restarts + " restarts" : "");
    const banner = document.getElementById("banner");
    if (j.ended) {
      banner.hidden = false;
      banner.className = "banner" + (j.state === "FAILED" ? " failed" : "");
      banner.textContent = "The job ended (" + j.state + (j.failure ? ": " + j.failure : "") + "). This is its final state.";
    } else {
      banner.hidden = true;
    }
  }
  function tick() {
    if (busy) return;
    busy = true;
    poll().then(function (a) {
      drawJob(a.job);
      a.render();
      document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
      if (a.job.ended) { ended = true; clearInterval(timer); timer = null; }
    }).catch(function (e) {
      document.getElementById("updated").textContent = "not updated: " + e.message;
    }).finally(function () { busy = false; });
  }
  main.addEventListener("click", function (ev) {
    const node = ev.target.closest(".node");
    if (node) { location.hash = "#subtasks/" + node.dataset.id; return; }
    const top = ev.target.closest(".top-row");
    if (top) { location.hash = "#subtasks/" + top.dataset.vertex; return; }
    const ck = ev.target.closest("tr.checkpoint");
    if (ck) { location.hash = "#checkpoints/" + ck.dataset.id; }
  });
  main.addEventListener("change", function (ev) {
    if (ev.target.id === "vertex-pick") location.hash = "#subtasks" + (ev.target.value ? "/" + ev.target.value : "");
  });
  window.addEventListener("hashchange", function () {
    if (ended) { poll().then(function (a) { a.render(); }); } else { tick(); }
  });
  tick();
  timer = setInterval(tick, POLL_MS);
})();
