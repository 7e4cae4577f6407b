// The live page of `tidal serve`: polls /admin/state, /admin/latency and (when the server splits
// requests) /admin/splits, keeps the gauges' history since the page opened, draws with chart.js.
"use strict";

(function () {
  const STATE_MS = 1000, LATENCY_MS = 2000, WINDOW_S = 300, KEEP = 900;
  const COLORS = ["#1d3557", "#e63946", "#2a9d8f", "#f4a261", "#6a4c93", "#8ab17d", "#e76f51", "#264653"];
  const $ = (id) => document.getElementById(id);
  const hist = [];  // [{t, instances: [...], running, waiting}]
  const charts = {};
  let prev = null;  // the previous state, for the events
  let latency = null;
  const page = { polls: 0, latencyPolls: 0, history: hist };
  window.tidalDashboard = page;  // read by tests and by curious users in the console

  function text(id, value) {
    const el = $(id);
    el.textContent = value === null || value === undefined ? "-" : String(value);
  }

  function pct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + " %"; }
  function ms(s) { return s === null || s === undefined ? "-" : (1000 * s).toFixed(s < 0.01 ? 2 : 1) + " ms"; }

  // One shape for both servers: a single engine is instance 0.
  function instancesOf(st) {
    if (st.cluster && Array.isArray(st.cluster.instances)) {
      const held = (st.cluster.kv_pressure && st.cluster.kv_pressure.layers) || {};  // KunServe: layers kept after a drop
      return st.cluster.instances.map((i) => ({
        layers: held[String(i.index)] ? "[" + held[String(i.index)].join(", ") + ")" : "all",
        index: i.index, role: i.role, alive: i.alive, kv: i.kv_usage, blocks: i.num_blocks,
        used: i.num_blocks - i.num_free_blocks, running: i.num_running, waiting: i.num_waiting,
        cap: i.batch_size_cap, budget: i.token_budget, preemptions: i.num_preemptions,
        stepMs: i.step_time_ema_s === null ? null : 1000 * i.step_time_ema_s, policy: i.policy,
        failures: i.failures, restarts: i.restarts, handoffs: i.handoffs_in,
      }));
    }
    const s = st.stats;
    return [{
      index: 0, role: "single", alive: st.alive, kv: s.kv_cache_usage_perc, blocks: s.num_kv_blocks,
      used: s.num_kv_blocks - s.num_free_kv_blocks, running: s.num_requests_running, waiting: s.num_requests_waiting,
      cap: st.batch_size_cap, budget: s.token_budget === undefined ? null : s.token_budget,
      preemptions: s.num_preemptions, stepMs: null, policy: st.policy, failures: 0, restarts: 0, handoffs: 0,
      layers: "all",
    }];
  }

  function findBuckets(p) {  // BucketServe's (low, up, waiting) list, alone or inside a composite
    if (!p || typeof p !== "object") return null;
    if (Array.isArray(p.buckets)) return p;
    for (const v of Object.values(p)) {
      const b = findBuckets(v);
      if (b) return b;
    }
    return null;
  }

  function flat(obj, prefix, out) {
    for (const [k, v] of Object.entries(obj || {})) {
      const key = prefix ? prefix + "." + k : k;
      if (k === "policy" || k === "buckets") continue;
      if (v && typeof v === "object" && !Array.isArray(v)) flat(v, key, out);
      else out.push([key, Array.isArray(v) ? JSON.stringify(v) : v]);
    }
    return out;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      if (c instanceof Node) td.appendChild(c); else td.textContent = c === null || c === undefined ? "-" : String(c);
      tr.appendChild(td);
    }
    return tr;
  }

  function bar(x) {
    const outer = document.createElement("div");
    outer.className = "bar";
    const inner = document.createElement("div");
    inner.style.width = Math.max(0, Math.min(100, 100 * (x || 0))) + "%";
    outer.appendChild(inner);
    return outer;
  }

  function fill(tableId, rows) {
    const body = $(tableId).tBodies[0];
    body.replaceChildren(...rows);
  }

  function event(msg) {
    const li = document.createElement("li");
    li.textContent = new Date().toTimeString().slice(0, 8) + "  " + msg;
    $("events").prepend(li);
    while ($("events").children.length > 200) $("events").lastChild.remove();
  }

  function events(st, insts) {
    if (prev === null) return;
    const before = new Map(instancesOf(prev).map((i) => [i.index, i]));
    for (const i of insts) {
      const b = before.get(i.index);
      if (!b) continue;
      const who = insts.length > 1 ? "instance " + i.index + ": " : "";
      if (i.preemptions > b.preemptions) event(who + "+" + (i.preemptions - b.preemptions) + " preemption(s)");
      if (i.cap !== b.cap && b.cap !== null && i.cap !== null) event(who + "batch size cap " + b.cap + " -> " + i.cap);
      if (i.budget !== b.budget && b.budget !== null && i.budget !== null) event(who + "token budget " + b.budget + " -> " + i.budget);
      if (i.alive !== b.alive) event(who + (i.alive ? "alive" : "DOWN"));
      if (i.failures > b.failures) event(who + "worker failed");
      if (i.restarts > b.restarts) event(who + "worker restarted");
      if (i.handoffs > b.handoffs) event(who + "+" + (i.handoffs - b.handoffs) + " KV hand-off(s) received");
      const nb = findBuckets(i.policy), ob = findBuckets(b.policy);
      if (nb && ob) {
        if ((nb.num_splits || 0) > (ob.num_splits || 0)) event(who + "bucket split: now " + nb.buckets.length + " buckets");
        if ((nb.num_merges || 0) > (ob.num_merges || 0)) event(who + "buckets merged: now " + nb.buckets.length + " buckets");
      }
    }
    // --kv-pressure migrate / drop / auto: throttles, choices, drops, KV exchanges, restores, as the front end logged them
    const kp = (st.cluster && st.cluster.kv_pressure) || null, okp = (prev.cluster && prev.cluster.kv_pressure) || null;
    if (kp && okp) {
      const seen = new Set((okp.events || []).map((e) => e.kind + "@" + e.time));
      for (const e of kp.events || []) {
        if (seen.has(e.kind + "@" + e.time)) continue;
        const extra = Object.entries(e).filter(([k]) => !["kind", "time", "instances"].includes(k))
          .map(([k, v]) => k + "=" + JSON.stringify(v)).join(" ");
        event("kv-pressure " + kp.mode + ": " + e.kind + " on instance(s) " + (e.instances || []).join(", ") + (extra ? "  " + extra.slice(0, 160) : ""));
      }
    }
    const s = st.stats, p = prev.stats;
    if ((s.failovers || 0) > (p.failovers || 0)) event("+" + (s.failovers - p.failovers) + " request failover(s)");
    if ((s.splits || 0) > (p.splits || 0)) event("+" + (s.splits - p.splits) + " split request(s)");
  }

  function render(st) {
    const insts = instancesOf(st);
    const s = st.stats;
    text("model", st.model);
    $("alive").textContent = st.alive ? "alive" : "DEAD";
    $("alive").className = st.alive ? "ok" : "dead";
    text("policy-name", st.policy ? st.policy.policy : (st.scheduler.batching || "continuous"));
    text("layout", st.cluster ? st.cluster.mode + ", " + insts.length + " instances, " + st.cluster.backend : "one instance");
    text("device", st.device + " " + st.dtype);
    text("v-running", s.num_requests_running);
    text("v-waiting", s.num_requests_waiting);
    text("v-kv", pct(s.kv_cache_usage_perc));
    text("v-kv-used", s.num_kv_blocks - s.num_free_kv_blocks);
    text("v-kv-total", s.num_kv_blocks);
    const caps = insts.map((i) => i.cap).filter((c) => c !== null && c !== undefined);
    const budgets = insts.map((i) => i.budget).filter((c) => c !== null && c !== undefined);
    text("v-batch-cap", st.cluster ? (caps.length ? caps.join(" / ") : "-") : st.batch_size_cap);
    text("v-token-budget", budgets.length ? budgets.join(" / ") : st.scheduler.max_num_batched_tokens);
    text("v-preemptions", s.num_preemptions);
    // share of prompt tokens the prefix cache had (pool and host tier), since start
    text("v-prefix-hits", !s.prefix_caching ? "off" : s.prefix_cache_queries ?
      pct(s.prefix_cache_hits / s.prefix_cache_queries) + " of " + s.prefix_cache_queries + " tok" : "-");
    fill("instances", insts.map((i) => row([
      i.index, i.role, i.alive ? "alive" : "down", pct(i.kv), bar(i.kv), i.used + " / " + i.blocks, i.running,
      i.waiting, i.cap, i.budget, i.preemptions, i.stepMs === null ? "-" : i.stepMs.toFixed(1), i.layers])));
    const brows = [], prows = [];
    for (const i of insts) {
      const b = findBuckets(i.policy);
      if (b) b.buckets.forEach((bk, k) => brows.push(row([i.index, k, bk[0], bk[1], bk[2]])));
      for (const [k, v] of flat(i.policy, "", [])) prows.push(row([i.index, k, typeof v === "number" ? +v.toPrecision(4) : v]));
    }
    fill("buckets", brows);
    $("buckets-note").hidden = brows.length > 0;
    fill("policy", prows);
    renderAuto(st);
    events(st, insts);
    prev = st;
    const t = Date.now() / 1000;
    hist.push({ t: t, insts: insts, running: s.num_requests_running, waiting: s.num_requests_waiting });
    while (hist.length > KEEP) hist.shift();
    drawGauges(t);
  }

  // --kv-pressure auto: each instance's response now, and the latest choices with their predicted seconds
  function renderAuto(st) {
    const kp = st.cluster && st.cluster.kv_pressure, auto = kp && kp.auto;
    $("auto-section").hidden = !auto;
    if (!auto) return;
    text("auto-modes", Object.entries(auto.modes).map(([i, m]) => "instance " + i + ": " + m).join(", ") || "no throttle yet");
    const sec = (v) => (v === null || v === undefined ? "-" : v.toFixed(3));
    fill("auto-choices", auto.choices.slice().reverse().map((c) => row([
      c.time.toFixed(2), c.index, c.choice, sec(c.predicted_s.recompute), sec(c.predicted_s.swap),
      sec(c.predicted_s.migrate), sec(c.predicted_s.drop), c.reason])));
  }

  function perInstance(key, scale) {
    const n = hist.length ? hist[hist.length - 1].insts.length : 0;
    const out = [];
    for (let k = 0; k < n; k++) {
      out.push({
        name: n > 1 ? "instance " + k : "engine", color: COLORS[k % COLORS.length],
        points: hist.map((h) => [h.t, h.insts[k] && h.insts[k][key] !== null && h.insts[k][key] !== undefined
          ? scale * h.insts[k][key] : null]),
      });
    }
    return out;
  }

  function chart(id, opts) {
    if (!charts[id]) charts[id] = new window.TidalChart.TimeChart($(id), Object.assign({ windowS: WINDOW_S }, opts));
    return charts[id];
  }

  function drawGauges(t) {
    chart("c-kv", { yMax: 100, unit: "%" }).draw(perInstance("kv", 100), t);
    chart("c-load", {}).draw([
      { name: "running", color: COLORS[0], points: hist.map((h) => [h.t, h.running]) },
      { name: "waiting", color: COLORS[1], points: hist.map((h) => [h.t, h.waiting]) }], t);
    chart("c-cap", {}).draw(perInstance("cap", 1), t);
  }

  function drawLatency(lat) {
    const rows = lat.buckets;
    const mid = (b) => b.t + lat.bucket_s / 2;
    const series = (key, name, color) => ({ name: name, color: color,
      points: rows.map((b) => [mid(b), b[key] === null ? null : 1000 * b[key]]) });
    chart("c-ttft", { unit: "" }).draw([series("ttft_mean_s", "mean", COLORS[0]), series("ttft_max_s", "max", COLORS[1])], lat.now);
    chart("c-tpot", { unit: "" }).draw([series("itl_mean_s", "mean", COLORS[2]), series("itl_max_s", "max", COLORS[3])], lat.now);
    text("v-finished", lat.totals.requests);
    const recent = rows.filter((b) => b.t >= lat.now - 2 * lat.bucket_s);
    const last = (key) => { for (let k = recent.length - 1; k >= 0; k--) if (recent[k][key] !== null) return recent[k][key]; return null; };
    text("v-ttft", ms(last("ttft_mean_s")));
    text("v-tpot", ms(last("itl_mean_s")));
    for (const el of document.querySelectorAll(".bucket-s")) el.textContent = lat.bucket_s;
  }

  async function getJSON(path) {
    const r = await fetch(path, { cache: "no-store" });
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return r.json();
  }

  async function pollState() {
    try {
      const st = await getJSON("/admin/state");
      render(st);
      page.polls += 1;
      text("updated", new Date().toTimeString().slice(0, 8));
      text("error", "");
      if (st.cluster && st.cluster.mode === "split") {
        const sp = await getJSON("/admin/splits");
        $("splits-section").hidden = false;
        fill("splits", sp.splits.slice(-15).reverse().map((e) => row([
          e.request_id, e.pair.join(" -> "), e.split, e.prompt_len, e.predicted_output, e.whole_on, e.kv_bytes])));
      }
    } catch (e) {
      text("error", "cannot reach the server: " + e.message);
    }
    setTimeout(pollState, STATE_MS);
  }

  async function pollLatency() {
    try {
      latency = await getJSON("/admin/latency?window=" + WINDOW_S);
      page.latency = latency;
      drawLatency(latency);
      page.latencyPolls += 1;
    } catch (e) {
      text("error", "cannot reach the server: " + e.message);
    }
    setTimeout(pollLatency, LATENCY_MS);
  }

  window.addEventListener("resize", () => {
    drawGauges(Date.now() / 1000);
    if (latency) drawLatency(latency);
  });
  pollState();
  pollLatency();
})();
