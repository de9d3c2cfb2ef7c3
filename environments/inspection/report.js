// Lachesis report: the group list is rendered from the summary; a group's detail is built
// from its JSON chunk (<script type="application/json" id="gN">) when it is opened.
(function () {
  "use strict";
  // summary rows: [index, line, env, item, outcomes, mean, spread, truncated, toolErrors,
  //                policyVersion, meanTurns, tokens, trainedTokens, matching]
  const rows = JSON.parse(document.getElementById("summary").textContent);
  const $ = (id) => document.getElementById(id);
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" };
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ESC[c]);
  const fmt = (x) => (x === null || x === undefined ? "—" : String(Number(Number(x).toPrecision(3))));
  const signed = (x) => (x >= 0 ? "+" : "") + fmt(x);
  let lo = Infinity, hi = -Infinity;
  for (const r of rows) for (const o of r[4]) { if (o < lo) lo = o; if (o > hi) hi = o; }
  if (!(hi > lo)) { lo -= 0.5; hi += 0.5; }
  let vocab = null;
  let current = null; // the open group's data

  function strip(outcomes) {
    const W = 110, H = 14, x = (o) => 4 + (W - 8) * (o - lo) / (hi - lo);
    let mn = Infinity, mx = -Infinity;
    for (const o of outcomes) { if (o < mn) mn = o; if (o > mx) mx = o; }
    let s = `<svg class="strip" width="${W}" height="${H}"><line x1="4" x2="${W - 4}" y1="7" y2="7" stroke="#dde1ea"/>` +
      `<line x1="${x(mn)}" x2="${x(mx)}" y1="7" y2="7" stroke="#2a62c9" stroke-width="3"/>`;
    for (const o of outcomes) s += `<circle cx="${x(o).toFixed(1)}" cy="7" r="2.6" fill="#1d2330" fill-opacity=".6"/>`;
    return s + "</svg>";
  }

  function renderList() {
    const q = $("q").value.trim().toLowerCase();
    const sort = $("sort").value;
    let shown = q ? rows.filter((r) => (r[2] + " " + r[3]).toLowerCase().includes(q)) : rows.slice();
    if (sort === "spread") shown.sort((a, b) => b[6] - a[6] || a[0] - b[0]);
    else if (sort === "mean") shown.sort((a, b) => b[5] - a[5] || a[0] - b[0]);
    else if (sort === "mean-asc") shown.sort((a, b) => a[5] - b[5] || a[0] - b[0]);
    const out = [];
    for (const r of shown) {
      out.push(`<tr data-i="${r[0]}"${current && current.i === r[0] ? ' class="sel"' : ""}><td>${r[0]}</td><td>${esc(r[1])}</td>` +
        `<td>${esc(r[2])}</td><td class="item" title="${esc(r[3])}">${esc(r[3])}</td>` +
        `<td class="num">${r[4].length}${r[13] < r[4].length ? " (" + r[13] + ")" : ""}</td>` +
        `<td>${strip(r[4])}</td><td class="num">${fmt(r[5])}</td><td class="num">${fmt(r[6])}</td>` +
        `<td class="num">${r[7] || ""}</td><td class="num">${r[8] || ""}</td><td class="num">${r[9] === null ? "" : "v" + r[9]}</td></tr>`);
    }
    $("list").tBodies[0].innerHTML = out.join("");
    $("count").textContent = `${shown.length} of ${rows.length} groups in this page`;
  }

  function flags(t) {
    let s = "";
    if (t.fl.truncated) s += '<span class="flag">truncated</span>';
    if (t.fl.tool_errors) s += `<span class="flag">${t.fl.tool_errors} tool error${t.fl.tool_errors > 1 ? "s" : ""}</span>`;
    if (!t.fl.trainable) s += '<span class="flag soft">not trainable</span>';
    if (!t.match) s += '<span class="flag soft">hidden by filter</span>';
    return s;
  }

  function turnBadge(t, k) {
    const turn = t.turns[k];
    let s = `<span class="turnbadge">turn ${k}${k === t.turns.length - 1 ? " (outcome)" : ""} · score <span class="ts">${fmt(turn.s === null ? (k === t.turns.length - 1 ? t.o : null) : turn.s)}</span>`;
    if (turn.a !== null) s += ` · adv <span class="${turn.a >= 0 ? "adv-pos" : "adv-neg"}">${signed(turn.a)}</span>`;
    if (turn.ns) s += " · new segment";
    s += ` · ${turn.k}/${turn.n} tok`;
    if (turn.v !== null) s += ` · v${turn.v}`;
    return s + "</span>";
  }

  function member(t, i) {
    const n = t.tok.length, trained = t.tr.reduce((a, r) => a + r[1] - r[0], 0);
    let h = `<div class="member${t.match ? "" : " filtered"}" data-t="${i}"><div class="mhead">` +
      `<span class="title">trajectory ${i}</span> · outcome <span class="score">${fmt(t.o)}</span>${flags(t)}<br>` +
      `<span class="meta">${t.turns.length} turn${t.turns.length === 1 ? "" : "s"} · ${n} tokens: ${trained} trained, ${n - trained} context` +
      `${t.pv === null ? "" : " · policy v" + t.pv}${t.stop ? " · stop: " + esc(t.stop) : ""}</span></div><div class="conv">`;
    for (const [role, content, k] of t.msgs) {
      h += `<div class="msg r-${esc(role)}${k === null ? "" : " turn"}"><div class="role">${esc(role)}${k === null ? "" : turnBadge(t, k)}</div>` +
        `<div class="content">${esc(content)}</div></div>`;
    }
    return h + `</div><details class="tokens" data-t="${i}"><summary>Tokens (${n}: ${trained} trained, ${n - trained} context)</summary>` +
      `<div class="legend"><span class="c">context</span> <span style="background:var(--trained)">trained</span>` +
      `${t.adv ? ' · trained tokens coloured by advantage: <span style="background:rgba(30,132,73,.6)">+</span> <span style="background:rgba(192,57,43,.6)">−</span>' : ""}` +
      ` · hover a token for its id, logprob and advantage</div><div class="tokview" data-t="${i}"></div></details></div>`;
  }

  function turnTable(g) {
    const most = Math.max(...g.t.map((t) => t.turns.length));
    if (!most) return "";
    let h = '<table class="turns"><thead><tr><th>turn</th>';
    g.t.forEach((t, i) => { h += `<th>traj. ${i}</th>`; });
    h += "</tr></thead><tbody>";
    for (let k = 0; k < most; k++) {
      h += `<tr><th>${k}</th>`;
      for (const t of g.t) {
        const turn = t.turns[k];
        h += `<td class="turn-score">${turn ? fmt(turn.s === null ? (k === t.turns.length - 1 ? t.o : null) : turn.s) : ""}</td>`;
      }
      h += "</tr>";
    }
    h += '<tr><th>outcome</th>' + g.t.map((t) => `<td class="score">${fmt(t.o)}</td>`).join("") + "</tr>";
    return h + "</tbody></table>";
  }

  function tokenText(id) {
    if (vocab === null) vocab = JSON.parse($("vocab").textContent);
    const text = vocab[id];
    if (text === undefined) return null;
    return text === "" ? "∅" : text.replace(/\n/g, "↵\n");
  }

  function buildTokens(view, t) {
    const trained = new Uint8Array(t.tok.length);
    for (const [a, b] of t.tr) trained.fill(1, a, b);
    const starts = new Map(t.turns.map((turn, k) => [turn.sp[0], k]));
    const segments = new Set(t.seg);
    const scale = current.advScale;
    const out = [];
    for (let j = 0; j < t.tok.length; j++) {
      if (segments.has(j)) out.push(`<span class="tb">new segment</span>`);
      if (starts.has(j)) out.push(`<span class="tb">turn ${starts.get(j)}</span>`);
      const text = tokenText(t.tok[j]);
      const shown = text === null ? `<span class="id">${t.tok[j]}</span>` : esc(text);
      if (!trained[j]) { out.push(`<span class="c" data-j="${j}">${shown}</span>`); continue; }
      let style = "";
      if (t.adv && scale > 0) {
        const a = t.adv[j], alpha = (0.15 + 0.65 * Math.min(1, Math.abs(a) / scale)).toFixed(2);
        style = ` style="background:rgba(${a >= 0 ? "30,132,73" : "192,57,43"},${alpha})"`;
      }
      out.push(`<span class="r" data-j="${j}"${style}>${shown}</span>`);
    }
    view.innerHTML = out.join("");
  }

  async function unpack(chunk) {
    // base64 of zlib-compressed JSON (see html_report._packed)
    const bin = atob(chunk.textContent);
    const bytes = new Uint8Array(bin.length);
    for (let k = 0; k < bin.length; k++) bytes[k] = bin.charCodeAt(k);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return JSON.parse(await new Response(stream).text());
  }

  let opening = 0;
  async function openGroup(i) {
    const chunk = $("g" + i);
    if (!chunk) {
      if (document.readyState === "loading") {
        document.addEventListener("DOMContentLoaded", () => openGroup(i), { once: true });
      } else {
        $("detail").innerHTML = `<p class="hint">Group #${esc(i)} is not embedded in this report.</p>`;
      }
      return;
    }
    if (typeof DecompressionStream === "undefined") {
      $("detail").innerHTML = '<p class="hint">This browser cannot open groups (it lacks DecompressionStream).</p>';
      return;
    }
    const ticket = ++opening;
    const g = await unpack(chunk);
    if (ticket !== opening) return; // another group was asked for meanwhile
    g.advScale = 0;
    for (const t of g.t) if (t.adv) for (const a of t.adv) if (Math.abs(a) > g.advScale) g.advScale = Math.abs(a);
    current = g;
    let h = `<h2>Group #${g.i} · ${typeof g.line === "number" ? "line " + g.line : esc(g.line)}${g.env ? " · " + esc(g.env) : ""}${g.item !== null ? " · item " + esc(g.item) : ""}` +
      `${g.pv === null ? "" : " · policy v" + g.pv}</h2><p class="meta">group id ${esc(g.id)}` +
      `${g.gen ? " · generation " + esc(JSON.stringify(g.gen)) : ""}${g.meta ? " · metadata " + esc(JSON.stringify(g.meta)) : ""}</p>` +
      `<h3>Scores per turn</h3>${turnTable(g)}` +
      `<div class="members" style="grid-template-columns: repeat(${g.t.length}, minmax(340px, 1fr))">`;
    g.t.forEach((t, k) => { h += member(t, k); });
    $("detail").innerHTML = h + "</div>";
    for (const tr of $("list").tBodies[0].rows) tr.classList.toggle("sel", Number(tr.dataset.i) === g.i);
  }

  // Events
  $("q").addEventListener("input", renderList);
  $("sort").addEventListener("change", renderList);
  $("list").tBodies[0].addEventListener("click", (e) => {
    const tr = e.target.closest("tr[data-i]");
    if (tr) location.hash = "g" + tr.dataset.i;
  });
  function fromHash() {
    const m = /^#g(\d+)$/.exec(location.hash);
    if (m) openGroup(Number(m[1]));
  }
  window.addEventListener("hashchange", fromHash);
  $("detail").addEventListener("toggle", (e) => {
    const d = e.target;
    if (!d.open || !d.classList || !d.classList.contains("tokens")) return;
    const view = d.querySelector(".tokview");
    if (!view.childElementCount) buildTokens(view, current.t[Number(d.dataset.t)]);
  }, true);
  const tip = $("tip");
  $("detail").addEventListener("mouseover", (e) => {
    const span = e.target.closest(".tokview span[data-j]");
    if (!span) { tip.hidden = true; return; }
    const t = current.t[Number(span.parentElement.dataset.t)], j = Number(span.dataset.j);
    const isTrained = span.classList.contains("r");
    const text = tokenText(t.tok[j]);
    let s = `token ${j} · id ${t.tok[j]}${text === null ? "" : " · " + JSON.stringify(text.replace("↵\n", "\n"))}\n` +
      (isTrained ? "trained" : "context (not trained)");
    if (isTrained) s += ` · logprob ${t.lp && t.lp[j] !== null ? t.lp[j] : "—"}`;
    if (t.adv) s += ` · advantage ${signed(t.adv[j])}`;
    const turn = t.turns.findIndex((x) => j >= x.sp[0] && j < x.sp[1]);
    if (turn >= 0) s += ` · turn ${turn}`;
    tip.textContent = s;
    tip.hidden = false;
    const r = span.getBoundingClientRect();
    tip.style.left = Math.min(r.left, window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = (r.bottom + 4 + tip.offsetHeight > window.innerHeight ? r.top - tip.offsetHeight - 4 : r.bottom + 4) + "px";
  });
  $("detail").addEventListener("mouseleave", () => { tip.hidden = true; });

  renderList();
  fromHash();
})();
