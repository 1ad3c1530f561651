// cg's dashboard: reads /cg/api/… and /stats every 2 s and renders them.
// Everything that comes from data goes in as text (textContent, DOM nodes), never as HTML:
// tool outputs, conversation ids and model names are whatever clients sent.
"use strict";

(() => {
  const POLL_MS = 2000;
  const PAGE_SIZE = 50;
  const CREDENTIAL_KEY = "cg-credential";
  const VERDICTS = {
    expected: ["expected", "Expected: the conversation's first turn, or only new content was written to the cache."],
    expired: ["expired", "The cache had expired: the previous request came longer ago than the cache's lifetime."],
    client_prefix: ["client changed the prefix", "The client changed what it had sent before, inside the cached part, so the provider wrote it again."],
    cg_prefix: ["cg changed the prefix", "cg forwarded different bytes for an earlier part than on the previous turn (an epoch of the cache-aware policy; outside an epoch, a bug)."],
    kept_warm: ["kept warm", "A keep-alive ping bridged the gap, so the turn read the cache the ping kept."],
  };
  // A change's component (cg.compaction.components), as a person reads what it did.
  const WHAT_CG_DID = {
    offload: "offloaded: head, tail and a summary, the rest behind the marker",
    dedup: "deduplicated: a pointer to the same output earlier in the request",
    textclean: "reformatted: colour codes and redrawn lines cleaned up",
    jsonformat: "reformatted: JSON compacted",
  };
  const CACHE_STATES = {warm: "warm until", kept_warm: "kept warm until", expired: "expired", unknown: "—"};

  const state = {route: "overview", order: "last", offset: 0, id: null, timer: null, generation: 0, shown: {}, charts: {}};

  // --- DOM and formatting -------------------------------------------------------------------------

  function $(id) { return document.getElementById(id); }

  // A node: el("td", {class: "num"}, "text", otherNode). Strings become text nodes.
  function el(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "onclick") node.addEventListener("click", value);
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fill(node, ...children) { node.replaceChildren(...children.flat().filter((c) => c != null)); }

  function int(n) { return n == null ? "—" : Math.round(n).toLocaleString("en-US"); }

  function usd(x) {
    if (x == null) return "—";
    if (x === 0) return "$0";
    return "$" + (Math.abs(x) >= 0.1 ? x.toFixed(2) : Math.abs(x) >= 0.01 ? x.toFixed(3) : x.toFixed(4));
  }

  // An axis tick: 1.5M, 250k, $0.50.
  function compact(n) {
    const abs = Math.abs(n);
    if (abs >= 1e6) return `${+(n / 1e6).toFixed(1)}M`;
    if (abs >= 1e3) return `${+(n / 1e3).toFixed(1)}k`;
    return String(+n.toFixed(2));
  }

  function bytes(n) {
    if (n == null) return "—";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function beforeAfter(before, after) {
    if (before == null) return "—";
    const saved = before > 0 && before !== after ? ` (−${(100 * (before - after) / before).toFixed(1)}%)` : "";
    return `${int(before)} → ${int(after)}${saved}`;
  }

  function duration(seconds) {
    const minutes = Math.floor(seconds / 60);
    if (minutes < 1) return `${Math.floor(seconds)} s`;
    if (minutes < 60) return `${minutes} min`;
    const hours = Math.floor(minutes / 60);
    return hours < 48 ? `${hours} h ${minutes % 60} min` : `${Math.floor(hours / 24)} days ${hours % 24} h`;
  }

  function two(n) { return String(n).padStart(2, "0"); }

  function clock(t) {
    const d = new Date(t * 1000);
    return `${two(d.getHours())}:${two(d.getMinutes())}`;
  }

  function when(t) {
    if (t == null) return "—";
    const d = new Date(t * 1000);
    const time = `${clock(t)}:${two(d.getSeconds())}`;
    if (d.toDateString() === new Date().toDateString()) return time;
    return `${d.toLocaleDateString("en-GB", {day: "numeric", month: "short"})} ${time}`;
  }

  function cacheState(cache) {
    if (!cache) return "—";
    const words = CACHE_STATES[cache.state] || cache.state;
    return cache.until != null && (cache.state === "warm" || cache.state === "kept_warm")
      ? `${words} ${clock(cache.until)}` : words;
  }

  // Shows the view whose data just arrived, and hides the rest and the credential form.
  function reveal(route) {
    $("credential").hidden = true;
    for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== "view-" + route;
  }

  function status(text, problem) {
    const node = $("status");
    node.textContent = text;
    node.classList.toggle("problem", Boolean(problem));
  }

  // --- the API ------------------------------------------------------------------------------------

  class Unauthorized extends Error {}

  function credentialHeaders() {
    const saved = sessionStorage.getItem(CREDENTIAL_KEY);
    if (!saved) return {};
    const {header, key} = JSON.parse(saved);
    return header === "authorization" ? {"Authorization": "Bearer " + key} : {"x-api-key": key};
  }

  async function get(url) {
    const response = await fetch(url, {headers: credentialHeaders(), cache: "no-store", credentials: "omit"});
    if (response.status === 401) throw new Unauthorized();
    return response;
  }

  async function getJSON(url) {
    const response = await get(url);
    const body = await response.json().catch(() => null);
    if (!response.ok) {
      throw new Error((body && body.error && body.error.message) || `${url} answered ${response.status}`);
    }
    return body;
  }

  // Renders `data` only when it differs from what the view last showed (keeps scroll and focus).
  function changed(view, data) {
    const text = JSON.stringify(data);
    if (state.shown[view] === text) return false;
    state.shown[view] = text;
    return true;
  }

  // --- Overview -----------------------------------------------------------------------------------

  const OVERVIEW_ROWS = [
    ["Requests", (s) => int(s.requests)],
    ["Tool-result tokens, before → after", (s) => beforeAfter(s.results_before, s.results_after)],
    ["Whole-request tokens, before → after", (s) => beforeAfter(s.tokens_before, s.tokens_after)],
    ["Billed: uncached input", (s) => int(s.billed.input)],
    ["Billed: cache read", (s) => int(s.billed.cache_read)],
    ["Billed: cache write, 5 min", (s) => int(s.billed.cache_write - s.billed.cache_write_1h)],
    ["Billed: cache write, 1 hour", (s) => int(s.billed.cache_write_1h)],
    ["Billed: output", (s) => int(s.billed.output)],
    ["Cost via cg (list price)", (s) => usd(s.cost_usd.via_cg)],
    ["Estimated cost without cg", (s) => usd(s.cost_usd.direct)],
    ["Ratio, via cg ÷ without", (s) => s.cost_usd.ratio == null ? "—" : `${s.cost_usd.ratio.toFixed(3)}×`],
    ["Expand rounds", (s) => int(s.expand_rounds)],
    ["Repairs", (s) => int(s.repairs)],
    ["Keep-alive pings, cost (list price)", (s) => pingsAndCost(s.pings)],
  ];

  // cg's own spending with --keepalive: apart from the requests' figures above.
  function pingsAndCost(p) {
    return `${int(p.count)} · ${usd(p.cost_usd)}`;
  }

  async function showOverview(current) {
    const midnight = new Date();
    midnight.setHours(0, 0, 0, 0);
    const window = $("chart-window").value;
    const [start, today, week, chart] = await Promise.all([
      getJSON("/cg/api/summary?window=start"),
      getJSON(`/cg/api/summary?since=${midnight.getTime() / 1000}`),
      getJSON("/cg/api/summary?window=7d"),
      getJSON(`/cg/api/summary?window=${encodeURIComponent(window)}`),
    ]);
    if (!current()) return;  // the viewer went elsewhere meanwhile
    reveal("overview");
    const columns = [start, today, week];
    if (changed("overview", {columns: columns.map(({now, series, ...rest}) => rest)})) {
      fill($("overview-figures").tBodies[0], OVERVIEW_ROWS.map(([label, figure], row) =>
        el("tr", {"data-row": row}, el("th", {}, label), columns.map((s) => el("td", {class: "num"}, figure(s))))));
    }
    drawCharts(chart);
    if (changed("breakdown", {window, c: chart.by_client, m: chart.by_model, t: chart.by_tenant})) {
      $("breakdown-window").textContent = $("chart-window").selectedOptions[0].textContent;
      breakdown($("by-client"), "Client", chart.by_client, (r) => r.client);
      breakdown($("by-model"), "Model", chart.by_model, (r) => r.model == null ? "(not named)" : r.model);
      $("by-tenant-box").hidden = !chart.by_tenant;
      if (chart.by_tenant) breakdown($("by-tenant"), "Tenant", chart.by_tenant, (r) => r.tenant || "(none)");
    }
  }

  function breakdown(table, what, rows, name) {
    fill(table,
      el("thead", {}, el("tr", {}, el("th", {}, what), el("th", {class: "num"}, "Requests"),
        el("th", {class: "num"}, "Tokens before → after"), el("th", {class: "num"}, "Via cg"),
        el("th", {class: "num"}, "Without cg"))),
      el("tbody", {}, rows.length ? rows.map((r) => el("tr", {},
        el("td", {}, name(r)), el("td", {class: "num"}, int(r.requests)),
        el("td", {class: "num"}, beforeAfter(r.tokens_before, r.tokens_after)),
        el("td", {class: "num"}, usd(r.cost_via_cg)), el("td", {class: "num"}, usd(r.cost_direct))))
        : el("tr", {}, el("td", {colspan: 5, class: "muted"}, "no requests in this window"))));
  }

  // One point per bucket from the window's start to now, zero where nothing happened.
  function chartData(summary) {
    const width = summary.series.width;
    const byTime = new Map(summary.series.points.map((p) => [p.t, p]));
    const first = summary.series.points.length ? summary.series.points[0].t : summary.now;
    const from = Math.floor(Math.min(summary.since ?? first, first) / width) * width;
    const columns = [[], [], [], [], [], []];
    for (let t = from; t <= summary.now; t += width) {
      const p = byTime.get(t) || {requests: 0, tokens_before: 0, tokens_after: 0, cost_via_cg: 0, cost_direct: 0};
      [t, p.tokens_before, p.tokens_after, p.requests, p.cost_via_cg, p.cost_direct]
        .forEach((v, i) => columns[i].push(v));
    }
    return columns;
  }

  const CHARTS = {
    "chart-tokens": {columns: [1, 2], series: [["before", "#b5524a"], ["after", "#2f7a4f"]], tick: compact},
    "chart-requests": {columns: [3], series: [["requests", "#3a5f9f"]], tick: compact},
    "chart-cost": {columns: [4, 5], series: [["via cg", "#2f7a4f"], ["without cg", "#b5524a"]], tick: (v) => "$" + compact(v)},
  };

  function drawCharts(summary) {
    if (typeof uPlot === "undefined") return;
    const columns = chartData(summary);
    for (const [id, spec] of Object.entries(CHARTS)) {
      const box = $(id);
      const width = Math.max(280, box.clientWidth);  // the view is shown: its box has its width
      const data = [columns[0], ...spec.columns.map((i) => columns[i])];
      const chart = state.charts[id];
      if (chart && chart.width === width) {
        chart.setData(data);
        continue;
      }
      if (chart) chart.destroy();
      state.charts[id] = new uPlot({
        width, height: 170,
        legend: {live: false},
        cursor: {drag: {x: false, y: false}},
        scales: {x: {time: true}},
        axes: [{stroke: "#555"}, {stroke: "#555", size: 56, values: (u, ticks) => ticks.map(spec.tick)}],
        series: [{}, ...spec.series.map(([label, colour]) => ({
          label, stroke: colour, width: 2, fill: colour + "22", points: {show: false}}))],
      }, data, box);
    }
  }

  // --- Conversations ------------------------------------------------------------------------------

  // [key, heading, the order it sorts by (null: not sortable)]
  const COLUMNS = [
    ["id", "Conversation", null], ["tenant", "Tenant", null], ["client", "Client", null], ["model", "Model", null],
    ["first", "First", "first"], ["last", "Last", "last"], ["requests", "Turns", "requests"],
    ["tokens_before", "Tokens before", "tokens_before"], ["tokens_after", "Tokens after", "tokens_after"],
    ["cost", "Cost", "cost"], ["expand_rounds", "Expands", null], ["repairs", "Repairs", null],
    ["cache", "Cache now", null],
  ];

  const CELLS = {
    id: (c) => conversationLink(c.id),
    tenant: (c) => c.tenant || "(none)",
    client: (c) => c.client,
    model: (c) => c.model ?? "—",
    first: (c) => when(c.first_seen),
    last: (c) => when(c.last_seen),
    requests: (c) => int(c.requests),
    tokens_before: (c) => int(c.tokens_before),
    tokens_after: (c) => int(c.tokens_after),
    cost: (c) => usd(c.cost_usd),
    expand_rounds: (c) => int(c.expand_rounds),
    repairs: (c) => int(c.repairs),
    cache: (c) => cacheState(c.cache),
  };
  const TEXT_COLUMNS = new Set(["id", "tenant", "client", "model", "cache"]);

  function conversationLink(id) {
    return el("a", {href: "#/conversation/" + encodeURIComponent(id), title: id, class: "conversation"},
      id.length > 20 ? id.slice(0, 19) + "…" : id);
  }

  async function showConversations(current) {
    const page = await getJSON(`/cg/api/conversations?offset=${state.offset}&limit=${PAGE_SIZE}&order=${state.order}`);
    if (!current()) return;  // the viewer went elsewhere meanwhile
    reveal("conversations");
    if (!changed("conversations", page)) return;
    const tenants = page.conversations.some((c) => c.tenant !== undefined);
    const columns = COLUMNS.filter(([key]) => tenants || key !== "tenant");
    const head = el("tr", {}, columns.map(([key, heading, order]) => order
      ? el("th", {class: order === state.order ? "sortable sorted num" : "sortable num"},
        el("button", {type: "button", "data-order": order, onclick: () => go({order, offset: 0})},
          heading, order === state.order ? " ▾" : " ▿"))
      : el("th", {class: TEXT_COLUMNS.has(key) ? null : "num"}, heading)));
    const rows = page.conversations.map((c) => el("tr", {"data-id": c.id}, columns.map(([key]) =>
      el("td", {"data-column": key, class: key === "cache" ? "cache " + c.cache.state : TEXT_COLUMNS.has(key) ? null : "num"},
        CELLS[key](c)))));
    fill($("conversations"), el("thead", {}, head), el("tbody", {},
      rows.length ? rows : el("tr", {}, el("td", {colspan: columns.length, class: "muted"}, "no conversations yet"))));
    const last = Math.min(page.offset + page.conversations.length, page.total);
    $("page-position").textContent = page.total ? `${int(page.offset + 1)}–${int(last)} of ${int(page.total)}` : "";
    $("page-previous").disabled = page.offset === 0;
    $("page-next").disabled = page.offset + page.limit >= page.total;
  }

  // --- One conversation ---------------------------------------------------------------------------

  async function showConversation(current) {
    const data = await getJSON("/cg/api/conversations/" + encodeURIComponent(state.id));
    if (!current()) return;  // the viewer went elsewhere meanwhile
    reveal("conversation");
    if (!changed("conversation", data)) return;
    const c = data.conversation;
    $("conversation-id").textContent = c.id;
    const facts = [
      ["Tenant", c.tenant === undefined ? null : c.tenant || "(none)"], ["Client", c.client], ["Model", c.model ?? "—"],
      ["First request", when(c.first_seen)], ["Last request", when(c.last_seen)], ["Turns", int(c.requests)],
      ["Tokens before → after", beforeAfter(c.tokens_before, c.tokens_after)], ["Cost via cg", usd(c.cost_usd)],
      ["Expand rounds", int(c.expand_rounds)], ["Repairs", int(c.repairs)],
      ["Keep-alive pings, cost", pingsAndCost(c.pings)], ["Cache now", cacheState(c.cache)],
    ].filter(([, value]) => value !== null);
    fill($("conversation-summary").tBodies[0], facts.map(([label, value]) => el("tr", {}, el("th", {}, label), el("td", {}, value))));
    let n = 0;  // requests are numbered; the pings between them are not turns
    fill($("turns"), data.turns.map((t) => t.kind === "ping" ? ping(t) : turn(t, ++n, c.tenant)));
  }

  function billed(b) {
    if (!b) return "not reported by the provider";
    return `input ${int(b.input)} · cache read ${int(b.cache_read)} · cache write 5 min ${int(b.cache_write - b.cache_write_1h)}`
      + ` · 1 hour ${int(b.cache_write_1h)} · output ${int(b.output)}`;
  }

  function verdict(v) {
    if (!v) return null;
    const [name, words] = VERDICTS[v.verdict] || [v.verdict, ""];
    return el("div", {class: "verdict " + v.verdict},
      el("span", {class: "badge"}, name), " ", words, v.detail ? el("span", {class: "detail"}, " (" + v.detail + ")") : null);
  }

  // `n`: its place in the conversation (its seq is a process-wide request number, not for people).
  // `tenant`: the conversation's, given to a viewer who sees every tenant (its originals are read
  // with ?tenant=), else undefined.
  function turn(t, n, tenant) {
    const flags = [
      t.expand_rounds ? `${t.expand_rounds} expand round${t.expand_rounds > 1 ? "s" : ""}` : null,
      t.repairs ? `${t.repairs} repair${t.repairs > 1 ? "s" : ""}` : null,
      t.epoch ? "decided in a cache-aware epoch" : null,
    ].filter(Boolean);
    return el("article", {class: "turn", "data-seq": t.seq},
      el("h4", {}, `Turn ${n}`, el("span", {class: "muted"},
        ` · ${when(t.time)} · ${t.model ?? "—"} · ${t.path} · ${t.status ?? "no status"} ${t.outcome}`)),
      el("dl", {},
        el("dt", {}, "Sent → forwarded"), el("dd", {}, beforeAfter(t.tokens_before, t.tokens_after) + " tokens"),
        el("dt", {}, "Tool results"),
        el("dd", {}, t.results_before ? beforeAfter(t.results_before, t.results_after) + " tokens" : "none rewritten"),
        el("dt", {}, "Billed"), el("dd", {}, billed(t.billed)),
        el("dt", {}, "Cost"), el("dd", {}, `via cg ${usd(t.cost_usd.via_cg)} · without cg ${usd(t.cost_usd.direct)}`),
        t.added_ms != null ? [el("dt", {}, "cg added"), el("dd", {}, `${t.added_ms.toFixed(1)} ms to the first byte`)] : null,
        flags.length ? [el("dt", {}, "Also"), el("dd", {}, flags.join(" · "))] : null),
      verdict(t.cache_verdict),
      t.changes.length ? changes(t.changes, tenant) : el("p", {class: "muted"}, "cg changed no tool result in this turn."));
  }

  function ping(t) {
    return el("article", {class: "turn ping", "data-seq": t.seq},
      el("h4", {}, "Keep-alive ping", el("span", {class: "muted"}, ` · ${when(t.time)} · ${t.model ?? "—"}`)),
      el("dl", {},
        el("dt", {}, "Billed"), el("dd", {}, billed(t.billed)),
        el("dt", {}, "Cost"), el("dd", {}, `${usd(t.cost_usd.via_cg)}, sent by cg to keep the prompt cache warm`)));
  }

  function changes(list, tenant) {
    return el("table", {class: "list changes"},
      el("thead", {}, el("tr", {}, el("th", {}, "Where"), el("th", {}, "Tool"), el("th", {}, "What cg did"),
        el("th", {class: "num"}, "Tokens before → after"), el("th", {}, "Original"))),
      el("tbody", {}, list.map((c) => el("tr", {class: "change"},
        el("td", {}, `messages[${c.message}]` + (c.block == null ? "" : `.content[${c.block}]`)),
        el("td", {}, c.tool ?? "—"),
        el("td", {}, WHAT_CG_DID[c.component] || `${c.lossy ? "rewrote" : "reformatted"} (${c.component})`),
        el("td", {class: "num"}, beforeAfter(c.tokens_before, c.tokens_after)),
        el("td", {}, c.marker ? el("button", {type: "button", class: "marker", "data-marker": c.marker,
          onclick: () => openOriginal(c.marker, tenant)}, `<<cg:${c.marker}>>`) : "—")))));
  }

  async function openOriginal(marker, tenant) {
    $("original").hidden = false;
    $("original-id").textContent = marker;
    const text = $("original-text");
    text.textContent = "reading…";
    try {
      const whose = tenant === undefined ? "" : "?tenant=" + encodeURIComponent(tenant);
      const response = await get("/cg/expand/" + encodeURIComponent(marker) + whose);
      text.textContent = response.ok ? await response.text()
        : "cg has no such original for you: unknown, evicted, or another tenant's.";
      text.classList.toggle("problem", !response.ok);
    } catch (error) {
      handle(error);
    }
  }

  // --- Health -------------------------------------------------------------------------------------

  function card(title, rows) {
    return el("div", {class: "card"}, el("h3", {}, title), el("table", {class: "figures"}, el("tbody", {},
      rows.filter(Boolean).map(([label, value, problem]) =>
        el("tr", {class: problem ? "problem" : null}, el("th", {}, label), el("td", {class: "num"}, value))))));
  }

  function ms(value) { return value == null ? "—" : `${value.toFixed(1)} ms`; }

  async function showHealth(current) {
    // /stats is the whole process's, every tenant's traffic: shown to a viewer who sees every tenant
    // (the summary gives it by_tenant), not to one tenant's viewer under --tenant credential or header.
    const everyone = "by_tenant" in await getJSON("/cg/api/summary?window=start");
    if (!current()) return;  // the viewer went elsewhere meanwhile
    $("health-hidden").hidden = everyone;
    $("health").hidden = !everyone;
    if (!everyone) {
      reveal("health");
      return;
    }
    const s = await getJSON("/stats");
    if (!current()) return;
    reveal("health");
    const uptime = {...s, uptime_s: 0, size_as_of: 0};
    if (!changed("health", uptime)) return;
    const store = s.store || {};
    const memo = (s.compaction && s.compaction.memo) || {};
    const keepalive = s.keepalive || {};
    const failing = Object.entries(s.responses_by_status || {}).filter(([code]) => Number(code) >= 400);
    fill($("health"),
      card("Store", [
        ["Kind", store.kind ?? "—"],
        ["Healthy", store.healthy === false ? `no: ${store.unhealthy_reason || "failing"}` : "yes", store.healthy === false],
        ["Originals", int(store.entries)],
        ["Size", bytes(store.bytes)],
        ["Counted at", when(store.size_as_of)],
        ["Cap", bytes(store.max_bytes)],
        ["Reads (hits / misses)", `${int(store.reads)} (${int(store.hits)} / ${int(store.misses)})`],
        ["Write errors", int(store.write_errors), store.write_errors > 0],
        ["Evictions", int(store.evictions)],
      ]),
      card("Upstream", [
        ["Requests", int(s.requests)],
        ["In flight", int(s.in_flight)],
        ["Errors (no response)", int(s.upstream_errors), s.upstream_errors > 0],
        ["Retries", int(s.upstream_retries)],
        ...(failing.length ? failing.map(([code, n]) => [`Answered ${code}`, int(n), true]) : [["Error statuses", "none"]]),
        ["Client disconnects", int(s.client_disconnects)],
      ]),
      card("Latency", [
        ["Added by cg, p50", ms(s.added_ttfb.p50_ms)],
        ["Added by cg, p99", ms(s.added_ttfb.p99_ms)],
        ["Upstream first byte, p50", ms(s.upstream_ttfb.p50_ms)],
        ["Upstream first byte, p99", ms(s.upstream_ttfb.p99_ms)],
      ]),
      card("Memo", [
        ["Hit rate", memo.hit_rate == null ? "—" : `${(100 * memo.hit_rate).toFixed(1)}%`],
        ["Decisions kept", int(memo.entries)],
      ]),
      card("Keep-alive", [
        ["Enabled", keepalive.enabled ? "yes" : "no"],
        ["Conversations kept warm", int(keepalive.conversations)],
        ["Pings (failed)", `${int(keepalive.pings)} (${int(keepalive.pings_failed)})`, keepalive.pings_failed > 0],
        ["Pings billed: cache read", int(keepalive.usage && keepalive.usage.cache_read_tokens)],
        ["Pings billed: input + output", int(keepalive.usage && keepalive.usage.input_tokens + keepalive.usage.output_tokens)],
        ["Pings' cost (list price)", keepalive.cost_usd == null ? "—" : usd(keepalive.cost_usd)],
      ]),
      card("Process", [
        ["Up for", duration(s.uptime_s)],
        ["Worker", s.worker ? `${s.worker.index + 1} of ${s.worker.of} (pid ${s.worker.pid})` : "one process"],
      ]));
  }

  // --- routing, polling, the credential -----------------------------------------------------------

  const VIEWS = {overview: showOverview, conversations: showConversations, conversation: showConversation, health: showHealth};

  function parseHash() {
    const [path, query] = location.hash.replace(/^#\/?/, "").split("?");
    const params = new URLSearchParams(query || "");
    if (path.startsWith("conversation/")) {
      try {
        return {route: "conversation", id: decodeURIComponent(path.slice("conversation/".length))};
      } catch (error) {
        if (!(error instanceof URIError)) throw error;
        // a hash no link of the page's makes (#/conversation/%E0): the overview, not a blank page
      }
    }
    return {
      route: VIEWS[path] ? path : "overview",
      order: params.get("order") || "last",
      offset: Math.max(0, Number(params.get("offset")) || 0),
    };
  }

  function go(change) {
    const next = {order: state.order, offset: state.offset, ...change};
    location.hash = `#/conversations?order=${encodeURIComponent(next.order)}&offset=${next.offset}`;
  }

  function showForget() { $("forget").hidden = !sessionStorage.getItem(CREDENTIAL_KEY); }

  function handle(error) {
    if (error instanceof Unauthorized) {
      $("credential").hidden = false;
      for (const view of document.querySelectorAll(".view")) view.hidden = true;
      status("cg needs your credential", true);
      return;
    }
    status(error.message, true);
  }

  // One chain of polls: a refresh started meanwhile (a navigation) ends the older one.
  async function refresh() {
    clearTimeout(state.timer);
    const generation = ++state.generation;
    if (document.hidden) return;  // a tab nobody looks at asks cg nothing; shown again, it refreshes
    try {
      await VIEWS[state.route](() => generation === state.generation);
      if (generation === state.generation) status(`updated ${when(Date.now() / 1000)}`, false);
    } catch (error) {
      if (generation !== state.generation) return;
      handle(error);
      if (error instanceof Unauthorized) return;  // until the form is sent
    }
    if (generation === state.generation) state.timer = setTimeout(refresh, POLL_MS);
  }

  function route() {
    Object.assign(state, parseHash());
    state.shown = {};
    for (const view of document.querySelectorAll(".view")) view.hidden = true;  // none shows another's data
    for (const link of document.querySelectorAll("nav a")) {
      link.classList.toggle("current", link.id === "nav-" + (state.route === "conversation" ? "conversations" : state.route));
    }
    refresh();
  }

  function start() {
    $("credential-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("credential-key").value.trim();
      if (!key) return;
      sessionStorage.setItem(CREDENTIAL_KEY, JSON.stringify({header: $("credential-header").value, key}));
      $("credential-key").value = "";
      showForget();
      route();
    });
    $("forget").addEventListener("click", () => {
      sessionStorage.removeItem(CREDENTIAL_KEY);
      showForget();
      route();
    });
    showForget();
    $("page-previous").addEventListener("click", () => go({offset: Math.max(0, state.offset - PAGE_SIZE)}));
    $("page-next").addEventListener("click", () => go({offset: state.offset + PAGE_SIZE}));
    $("chart-window").addEventListener("change", () => refresh());
    $("original-close").addEventListener("click", () => { $("original").hidden = true; });
    window.addEventListener("hashchange", route);
    document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
    window.addEventListener("resize", () => { if (state.route === "overview") refresh(); });
    route();
  }

  start();
})();
