"use strict";
// BubbleTea's run page: one drawing for the live page (server-sent events) and the report's
// dashboard.html (data inlined). Plain SVG, no library: see docs/dependencies.md.
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const boot = JSON.parse(document.getElementById("bt-data").textContent);
  const ROW = 22, LEFT = 90, TOP = 18;
  let view = null;            // the last view: figures, wan, faults, ...
  const segs = new Map();     // seq -> [seq, worker, kind, start_ms, end_ms, iteration]
  let zoom = null;            // [lo, hi] device ms when zoomed (report, or a paused live page)

  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(f) {
    const v = f.value;
    if (v === null || v === undefined) return "–";
    if (f.share) return (100 * v).toFixed(1) + " %";
    if (/-total$/.test(f.name)) return String(Math.round(v));
    return Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(2);
  }
  function merge(v, snapshot) {
    if (snapshot) segs.clear();
    for (const s of v.segments) segs.set(s[0], s);
    const lo = v.now_ms - v.window_ms;
    for (const [k, s] of segs) if (s[4] < lo) segs.delete(k);
    view = v;
  }
  // The live page opens on the last few iterations (a bubble is a few device ms: over the whole
  // window it would be a hairline); the report opens on the whole run. The wheel zooms either.
  const LIVE_ITERATIONS = 4;
  function range() {
    if (zoom) return zoom;
    let lo = view.now_ms - view.window_ms;
    const its = view.iterations || [];
    if (!boot.view && its.length) lo = Math.max(lo, view.now_ms - LIVE_ITERATIONS * its[its.length - 1][2]);
    let first = Infinity;
    for (const s of segs.values()) first = Math.min(first, s[3]);
    return [Math.max(lo, Math.min(first, view.now_ms - 1)), view.now_ms];
  }
  function drawTimeline() {
    const svg = document.getElementById("timeline");
    const width = Math.max(600, (svg.parentNode.clientWidth || 1200) - 10);
    const workers = [...new Set([...segs.values()].map((s) => s[1]))].sort((a, b) => {
      const [as, ar] = a.split(".").map(Number), [bs, br] = b.split(".").map(Number);
      return as - bs || ar - br;
    });
    const [lo, hi] = range();
    const x = (ms) => LEFT + ((ms - lo) / Math.max(1e-9, hi - lo)) * (width - LEFT - 10);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.setAttribute("width", width);
    svg.setAttribute("height", TOP + ROW * workers.length + 20);
    const rows = {};
    workers.forEach((w, i) => {
      const g = el("g", { class: "worker", "data-worker": w, transform: `translate(0,${TOP + i * ROW})` }, svg);
      el("text", { x: 4, y: ROW - 8, class: "label" }, g).textContent = "worker " + w;
      rows[w] = g;
    });
    const order = { bubble: 0, wan: 1, compute: 2, prefill: 3 };  // prefill drawn over its bubble
    const shown = [...segs.values()].filter((s) => s[4] >= lo && s[3] <= hi).sort((a, b) => order[a[2]] - order[b[2]]);
    for (const s of shown) {
      const x0 = x(Math.max(s[3], lo)), x1 = x(Math.min(s[4], hi));
      const inset = s[2] === "prefill" ? 5 : 2;
      el("rect", {
        class: "seg", "data-kind": s[2], "data-start-ms": s[3], "data-end-ms": s[4], "data-iteration": s[5],
        x: x0.toFixed(1), y: inset, width: Math.max(0.5, x1 - x0).toFixed(1), height: ROW - 2 * inset,
      }, rows[s[1]]);
    }
    const bottom = TOP + ROW * workers.length;
    for (const f of view.faults) {
      if (f.at_ms < lo || f.at_ms > hi) continue;
      const line = el("line", { class: "fault-mark", "data-kind": f.kind, x1: x(f.at_ms), x2: x(f.at_ms), y1: TOP - 6, y2: bottom }, svg);
      el("title", {}, line).textContent = f.text;
    }
    const axis = el("text", { x: LEFT, y: bottom + 14 }, svg);
    axis.textContent = `${lo.toFixed(0)} … ${hi.toFixed(0)} device ms` + (zoom ? " (zoomed: double-click to reset)" : "");
    svg._x = { lo, hi, width };
  }
  function drawFigures() {
    const box = document.getElementById("figures");
    box.textContent = "";
    for (const f of view.figures) {
      const d = document.createElement("div");
      d.className = "figure";
      d.dataset.figure = f.name;
      d.dataset.value = f.value === null ? "" : String(f.value);
      if (f.metric) d.dataset.metric = f.metric;
      d.innerHTML = `<div class="v"></div><div class="l"></div>`;
      d.firstChild.textContent = fmt(f);
      d.lastChild.textContent = f.label;
      box.appendChild(d);
    }
    const series = document.getElementById("series");
    series.textContent = "";
    const shares = new Set(view.figures.filter((f) => f.share).map((f) => f.name));
    for (const name in view.series) {
      const pts = view.series[name];
      if (pts.length < 2) continue;
      const svg = el("svg", { width: 220, height: 50, "data-series": name }, series);
      const t0 = pts[0][0], t1 = pts[pts.length - 1][0];
      let vmax = Math.max(...pts.map((p) => p[1]));
      if (shares.has(name)) vmax = 1;
      const d = pts.map((p, i) => `${i ? "L" : "M"}${(4 + 212 * (p[0] - t0) / Math.max(1, t1 - t0)).toFixed(1)},${(44 - 38 * p[1] / Math.max(1e-9, vmax)).toFixed(1)}`).join("");
      el("path", { d, fill: "none", stroke: "#4c78a8" }, svg);
      el("text", { x: 4, y: 11 }, svg).textContent = name;
    }
  }
  function drawSide() {
    const wan = document.getElementById("wan");
    if (view.wan.length) {
      wan.textContent = "";
      for (const l of view.wan) {
        const d = document.createElement("div");
        d.className = "link";
        d.dataset.link = l.link;
        d.dataset.transfers = l.transfers;
        d.textContent = `${l.link}: ${l.transfers} transfers granted, ${l.in_flight} in flight, busy ${(100 * l.utilization).toFixed(0)} %, ${(l.bytes / 1e6).toFixed(1)} MB`;
        wan.appendChild(d);
      }
    }
    const tr = document.getElementById("training");
    const its = view.iterations;
    tr.textContent = its.length ? `${its.length} iterations seen; last: ${its[its.length - 1][2].toFixed(0)} device ms` : "no iteration reported yet";
    const faults = document.getElementById("faults");
    faults.textContent = "";
    for (const f of view.faults) {
      const li = document.createElement("li");
      li.className = "fault";
      li.dataset.kind = f.kind;
      li.dataset.atMs = f.at_ms;
      if (f.worker) li.dataset.worker = f.worker;
      li.textContent = `at ${f.at_ms.toFixed(0)} device ms: ${f.text}`;
      faults.appendChild(li);
    }
    if (!view.faults.length) faults.innerHTML = "<li class='none'>no fault</li>";
  }
  let pending = false;
  function draw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      document.getElementById("run").textContent = "run " + view.run;
      document.getElementById("time-scale").textContent =
        `Times in device ms: one device ms lasted k = ${view.time_scale} real ms (the device time scale); window ${view.window_ms.toFixed(0)} device ms.`;
      drawTimeline();
      drawFigures();
      drawSide();
      document.body.dataset.ready = "1";
    });
  }
  // zoom (wheel) and hover on the timeline
  const svg = document.getElementById("timeline");
  const hover = document.getElementById("hover");
  svg.addEventListener("wheel", (e) => {
    if (!view || !svg._x) return;
    e.preventDefault();
    const { lo, hi, width } = svg._x;
    const at = lo + ((e.offsetX - LEFT) / (width - LEFT - 10)) * (hi - lo);
    const f = e.deltaY < 0 ? 0.8 : 1.25;
    zoom = [at - (at - lo) * f, at + (hi - at) * f];
    draw();
  }, { passive: false });
  svg.addEventListener("dblclick", () => { zoom = null; draw(); });
  svg.addEventListener("mousemove", (e) => {
    const t = e.target;
    if (t.classList && t.classList.contains("seg")) {
      const w = t.parentNode.dataset.worker;
      hover.textContent = `worker ${w}, ${t.dataset.kind}, iteration ${t.dataset.iteration}: ${(+t.dataset.startMs).toFixed(1)} … ${(+t.dataset.endMs).toFixed(1)} device ms (${(t.dataset.endMs - t.dataset.startMs).toFixed(1)} ms)`;
      hover.style.left = e.clientX + 12 + "px";
      hover.style.top = e.clientY + 12 + "px";
      hover.hidden = false;
    } else hover.hidden = true;
  });
  svg.addEventListener("mouseleave", () => { hover.hidden = true; });

  if (boot.view) {          // the report: the whole run inlined
    merge(boot.view, true);
    draw();
  } else {                  // the live page
    const key = new URLSearchParams(location.search).get("key");
    const es = new EventSource(boot.events + (key ? "?key=" + encodeURIComponent(key) : ""));
    const status = document.getElementById("status");
    es.addEventListener("snapshot", (e) => { merge(JSON.parse(e.data), true); status.textContent = "live"; draw(); });
    es.addEventListener("update", (e) => { merge(JSON.parse(e.data), false); draw(); });
    es.onerror = () => { status.textContent = "reconnecting…"; };
  }
})();
