"use strict";
const $ = (id) => document.getElementById(id);
const MEM = ["params", "grads", "optimizer", "activations", "working", "weight_copies", "buffers", "reserve"];
const TIME = ["compute", "recompute", "exposed_comm", "bubble", "optimizer"];
const SEVEN_B = {model: "custom", layers: 32, hidden: 4096, heads: 32, kv_heads: 32, ffn_hidden: 11008,
  vocab: 32000, tie_embeddings: false};
const BASE = {gpu: "h100-sxm", gpus: 8, gpus_per_node: 8, seq_len: 4096, global_batch: 8, precision: "bf16",
  tp: 1, pp: 1, cp: 1, ep: 1, offload: "none", zero: 0, micro_batch: 1, recompute: "none", schedule: "1f1b",
  virtual_stages: 1, sp: true};
const CASES = {
  dp7b: {...BASE, ...SEVEN_B},
  fsdp7b: {...BASE, ...SEVEN_B, zero: 3},
  big405: {...BASE, model: "llama3.1-405b", gpus: 128, global_batch: 128, tp: 8, pp: 4, zero: 3,
    recompute: "full", micro_batch: 1},
  tiny405: {...BASE, model: "llama3.1-405b", tp: 8, zero: 3, recompute: "full"},
};
let P = null, seq = 0, bestSeq = 0, timer = null, bestTimer = null;
const fmt = (x, d = 1) => Number(x).toLocaleString("en-US", {maximumFractionDigits: d, minimumFractionDigits: d});
const secs = (s) => !s ? "0 ms" : s >= 1 ? fmt(s, 2) + " s" : s >= 0.01 ? fmt(s * 1000, 1) + " ms" :
  s >= 1e-6 ? Number((s * 1000).toPrecision(2)) + " ms" : "<0.001 ms";
const gib = (v) => !v ? "0 GiB" : v >= 1 ? fmt(v, 2) + " GiB" : fmt(v * 1024, v * 1024 >= 10 ? 0 : 1) + " MiB";
const RESULT_IDS = ["mem-chart", "mem-legend", "time-chart", "time-legend", "comm-chart", "fit", "host-mem", "a2a",
  "nparams", "dp", "problems"];
const pct = (x) => fmt(100 * x, 1) + "%";
function esc(s) { return String(s).replace(/[&<>"']/g, (c) => "&#" + c.charCodeAt(0) + ";"); }
function fill(sel, items, labels) {
  sel.innerHTML = items.map((v, i) => `<option value="${esc(v)}">${esc(labels ? labels[i] : v)}</option>`).join("");
}
function fields() { return [...document.querySelectorAll("[data-p]")]; }
function val(el) { return el.type === "checkbox" ? String(el.checked) : el.value.trim(); }
function query() {
  const q = new URLSearchParams(), custom = $("model").value === "custom";
  for (const el of fields()) {
    if (el.hasAttribute("data-shape") && !custom) continue;
    if (el.hasAttribute("data-hw") && !el.dataset.dirty) continue;
    if (val(el) !== "") q.set(el.dataset.p, val(el));
  }
  return q;
}
function setValues(v) {
  for (const [k, x] of Object.entries(v)) {
    const el = $(k); if (!el) continue;
    if (el.type === "checkbox") el.checked = !!x; else el.value = x;
  }
  modelChanged(); gpuChanged();
  for (const k of ["ep", "offload"]) if (k in v && !$(k).disabled) $(k).value = String(v[k]);  // options refilled
}
function modelChanged() {
  const name = $("model").value, custom = name === "custom";
  for (const el of document.querySelectorAll("[data-shape]")) el.disabled = !custom;
  if (!custom) {
    const m = P.models[name];
    for (const el of document.querySelectorAll("[data-shape]")) {
      if (el.type === "checkbox") el.checked = m[el.dataset.p]; else el.value = m[el.dataset.p];
    }
  }
  const experts = custom ? 0 : P.models[name].num_experts, prev = $("ep").value;
  const eps = experts ? [...Array(experts).keys()].map((i) => i + 1).filter((d) => experts % d === 0) : [1];
  fill($("ep"), eps);
  $("ep").value = eps.map(String).includes(prev) ? prev : "1";
  $("ep").disabled = !experts;
  note();
}
function note() {
  const notes = [];
  if ($("ep").disabled) notes.push("ep: this model is dense; expert parallelism needs an MoE preset " +
    "(" + Object.keys(P.models).filter((k) => P.models[k].num_experts).join(", ") + ")");
  if ($("offload").disabled) notes.push(`offload: ${$("gpu").value} has no host to offload to`);
  $("layout-note").textContent = notes.join("; ");
}
function gpuChanged() {
  const g = P.gpus[$("gpu").value], prec = $("precision").value;
  $("hbm_gib").value = g.hbm_gib; $("peak_tflops").value = g.peak_tflops[prec] ?? "";
  $("intra_bw_gbs").value = g.intra_bw_gbs; $("inter_bw_gbs").value = g.inter_bw_gbs;
  for (const el of document.querySelectorAll("[data-hw]")) delete el.dataset.dirty;
  if (!g.can_offload) $("offload").value = "none";
  $("offload").disabled = !g.can_offload;
  note();
}
async function getJSON(url) {
  const r = await fetch(url);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}
function bar(parts, colors, total, limit, unit) {
  const W = 760, H = 34, max = Math.max(total, limit || 0) * 1.05 || 1, sx = (x) => x / max * W;
  let x = 0, svg = `<svg viewBox="0 0 ${W} ${H + 18}" width="100%" role="img">`;
  for (const [k, v] of parts) {
    const w = sx(v);
    svg += `<rect x="${x}" y="4" width="${Math.max(w, 0)}" height="${H - 8}" fill="var(--${colors(k)})">` +
      `<title>${esc(k)}: ${esc(unit(v))}</title></rect>`;
    x += w;
  }
  if (limit) {
    svg += `<line x1="${sx(limit)}" x2="${sx(limit)}" y1="0" y2="${H}" stroke="#b42318" stroke-width="2"/>` +
      `<text x="${Math.min(sx(limit), W - 90)}" y="${H + 14}" font-size="12" fill="#b42318">HBM ` +
      `${fmt(limit, 0)} GiB</text>`;
  }
  return svg + "</svg>";
}
function netParts(m) {
  // Gradients not held at the peak (grads_not_at_peak <= 0) come off grads, then params: under
  // autocast the fp32 .grad is 4 bytes a parameter, the params and grads parts together. No part
  // is ever negative, so the stacked bar never runs backwards.
  const v = Object.fromEntries(MEM.map((k) => [k, m[k] || 0]));
  let off = -(m.grads_not_at_peak || 0);
  for (const k of ["grads", "params", "working", "activations"]) {
    const d = Math.max(0, Math.min(off, v[k])); v[k] -= d; off -= d;
  }
  return MEM.map((k) => [k, v[k]]);
}
function legend(parts, colors, unit) {
  return parts.map(([k, v]) => `<span><i style="background:var(--${colors(k)})"></i>${esc(k.replace("_", " "))}` +
    ` ${esc(unit(v))}</span>`).join("");
}
function commChart(total, exposed) {
  const axes = Object.keys(total), max = Math.max(...axes.map((a) => total[a]), 1e-9), W = 760;
  let y = 0, svg = `<svg viewBox="0 0 ${W} ${axes.length * 26}" width="100%" role="img">`;
  for (const a of axes) {
    const wt = total[a] / max * (W - 260), we = exposed[a] / max * (W - 260);
    svg += `<text x="0" y="${y + 15}" font-size="12">${esc(a)}</text>` +
      `<rect x="40" y="${y + 3}" width="${wt}" height="16" fill="#c7d3ee"/>` +
      `<rect x="40" y="${y + 3}" width="${we}" height="16" fill="#d2553d"/>` +
      `<text x="${46 + wt}" y="${y + 15}" font-size="12">${esc(secs(total[a]))} (exposed ` +
      `${esc(secs(exposed[a]))})</text>`;
    y += 26;
  }
  return svg + "</svg>";
}
function inputError(skipLayout) {
  // the inputs checked against the API's own ranges (/api/presets) before anything is asked or shown
  for (const el of fields()) el.classList.remove("invalid");
  for (const el of fields()) {
    if (el.disabled || el.type !== "number" || (skipLayout && el.hasAttribute("data-layout"))) continue;
    if (el.hasAttribute("data-hw") && !el.dataset.dirty) continue;
    const spec = P.params[el.dataset.p], raw = el.value.trim(), x = Number(raw), whole = spec.kind === "int";
    if (raw === "" && spec.default === null && !el.validity.badInput) continue;  // optional: the API's default
    if (raw === "" || !Number.isFinite(x) || (whole && !Number.isInteger(x)) || x < spec.min || x > spec.max) {
      el.classList.add("invalid");
      const label = el.parentElement.firstChild.textContent.trim();
      return `${label} must be ${whole ? "a whole number" : "a number"} from ${spec.min.toLocaleString("en-US")} ` +
        `to ${spec.max.toLocaleString("en-US")}, got ${raw === "" ? "nothing" : raw}`;
    }
  }
  return "";
}
function showVerdict(ok, text) {
  const v = $("verdict");
  v.className = "verdict " + (ok ? "ok" : "bad"); v.dataset.ok = String(ok); v.textContent = text;
}
function clearResults() {
  for (const id of ["mem-total", "step", "tps", "mfu", "hfu"]) { $(id).textContent = "\u2013"; $(id).className = ""; }
  for (const id of RESULT_IDS) $(id).innerHTML = "";
}
function render(a) {
  const e = a.estimate;
  clearResults();
  showVerdict(a.verdict.ok, a.verdict.text);
  $("nparams").textContent = `${fmt(a.model.num_params / 1e9, 2)}B parameters`;
  const L = a.layout, experts = L && L.ep > 1 ? `; ep = ${L.ep} splits the experts over ${L.ep} of ` +
    `the dp x cp ranks (each expert sharded over edp = ${L.dp_shard * L.cp / L.ep})` : "";
  $("dp").textContent = L ? `dp = gpus / (tp x pp x cp) = ${L.dp_shard}; ` +
    `${L.num_microbatches} micro-batch(es) per step${experts}` : "dp: the degrees do not divide the GPUs";
  const probs = a.problems.map((p) => `<li class="${p.kind === "invalid" ? "bad" : ""}"><b>${esc(p.kind)}</b> ` +
    `${esc(p.message)}</li>`);
  $("problems").innerHTML = probs.length ? probs.join("") : a.verdict.ok ?
    `<li class="ok">meshforge train runs this layout</li>` :
    `<li>no layout rule refuses it, but it does not fit (the verdict above)</li>`;
  for (const id of ["mem-total", "step", "tps", "mfu", "hfu"]) if (!e) $(id).textContent = "\u2013";
  if (!e) { for (const id of ["mem-chart", "mem-legend", "time-chart", "time-legend", "comm-chart", "fit",
    "host-mem", "a2a"])
    $(id).innerHTML = ""; return; }
  const m = e.memory_gib, gib = (v) => fmt(v, 2) + " GiB", memParts = netParts(m);
  $("mem-total").textContent = fmt(m.total, 1);
  $("mem-total").className = e.fits ? "" : "bad";
  $("fit").innerHTML = e.fits ? `<span class="ok">fits in ${fmt(e.hbm_gib, 0)} GiB</span>` :
    `<span class="bad">does not fit: ${esc(e.overflow)}</span>`;
  $("mem-chart").innerHTML = bar(memParts, (k) => k, m.total, e.hbm_gib, gib);
  $("mem-legend").innerHTML = legend(memParts, (k) => k, gib) + (m.grads_not_at_peak < 0 ?
    `<span class="net">gradients not held at the peak (allocated as backward frees the activations): ` +
    `${gib(-m.grads_not_at_peak)}, taken off grads, then params</span>` : "");
  const tParts = TIME.map((k) => [k, e.step_s[k]]), tc = (k) => k === "optimizer" ? "optimizer_t" : k;
  $("time-chart").innerHTML = bar(tParts, tc, e.step_time_s, 0, secs);
  $("time-legend").innerHTML = legend(tParts, tc, secs);
  $("comm-chart").innerHTML = commChart(e.comm_s, e.comm_exposed_s);
  $("a2a").textContent = "ep" in e.comm_s ? `expert-parallel all-to-all (dispatch and combine): ` +
    `${secs(e.ep_a2a_s)} per step, on the critical path` : "";
  const h = e.host_memory_gib;
  $("host-mem").textContent = h.total ? `host memory (CPU offload): ${gib(h.total)} per GPU, ` +
    `${gib(h.per_node)} per node` : "";
  $("step").textContent = secs(e.step_time_s);
  $("tps").textContent = fmt(e.tokens_per_s_per_gpu, 0);
  $("mfu").textContent = pct(e.mfu); $("hfu").textContent = pct(e.hfu);
}
async function update() {
  const mine = ++seq, bad = inputError(false);
  $("status").dataset.state = "loading";
  if (bad) {  // nothing is computed from an invalid input: the error instead of results
    clearResults(); showVerdict(false, "input error: " + bad); $("status").textContent = "input error";
  } else {
    $("results").classList.add("stale");  // greyed until the answer to this input arrives
    try {
      const a = await getJSON("/api/estimate?" + query());
      if (mine !== seq) return;
      render(a);
      $("status").textContent = `${a.model.name} on ${a.cluster.gpus} x ${a.cluster.gpu}`;
    } catch (err) {
      if (mine !== seq) return;
      clearResults(); showVerdict(false, "refused: " + err.message);
      $("status").textContent = "refused: " + err.message;
    }
    $("results").classList.remove("stale");
  }
  $("status").dataset.state = "ready"; $("status").dataset.seq = String(mine);
}
function loadLayout(L) {
  setValues({tp: L.tp, pp: L.pp, cp: L.cp, zero: L.zero_stage, micro_batch: L.micro_batch_size,
    recompute: L.activation_checkpoint, schedule: L.pp > 1 ? L.pp_schedule : $("schedule").value,
    virtual_stages: L.pp_virtual_stages, sp: L.sequence_parallel, ep: L.ep, offload: L.offload});
  update();
}
async function updateBest() {
  const mine = ++bestSeq, q = query();
  for (const k of ["tp", "pp", "cp", "ep", "zero", "micro_batch", "recompute", "schedule", "virtual_stages", "sp",
    "offload"])
    q.delete(k);
  const bad = inputError(true), card = $("best-card");
  if (bad) { $("best-msg").textContent = "input error: " + bad; $("best").tBodies[0].innerHTML = ""; return; }
  $("best-msg").textContent = "searching\u2026";
  card.classList.add("stale");  // the previous answer's rows cannot be loaded while a new search runs
  for (const btn of $("best").querySelectorAll("button")) btn.disabled = true;
  try {
    const b = await getJSON("/api/best?" + q);
    if (mine !== bestSeq) return;
    $("best-msg").textContent = b.message || `${b.considered} layouts considered; the fastest that fit:`;
    $("best").tBodies[0].innerHTML = b.layouts.map((L, i) => `<tr><td>${i + 1}</td><td>${L.tp}</td>` +
      `<td>${L.pp}</td><td>${L.dp_shard}</td><td>${L.cp}</td><td>${L.ep}</td><td>${L.zero_stage}</td>` +
      `<td>${esc(L.offload)}</td><td>${L.micro_batch_size}</td>` +
      `<td>${esc(L.activation_checkpoint)}</td><td>${esc(L.pp > 1 ? L.pp_schedule : "-")}</td>` +
      `<td>${fmt(L.memory_total_gib, 1)}</td><td>${esc(secs(L.step_time_s))}</td>` +
      `<td>${fmt(L.tokens_per_s_per_gpu, 0)}</td><td>${pct(L.mfu)}</td>` +
      `<td><button data-row="${i}">load</button></td></tr>`).join("");
    for (const btn of $("best").querySelectorAll("button[data-row]"))
      btn.onclick = () => loadLayout(b.layouts[Number(btn.dataset.row)]);
  } catch (err) {
    if (mine !== bestSeq) return;
    $("best-msg").textContent = "refused: " + err.message; $("best").tBodies[0].innerHTML = "";
  }
  card.classList.remove("stale");
}
function changed(ev) {
  const el = ev.target;
  if (el.id === "model") modelChanged();
  if (el.id === "gpu" || el.id === "precision") gpuChanged();
  if (el.hasAttribute && el.hasAttribute("data-hw")) el.dataset.dirty = "1";
  clearTimeout(timer); timer = setTimeout(update, 60);
  if (!el.hasAttribute("data-layout")) { clearTimeout(bestTimer); bestTimer = setTimeout(updateBest, 400); }
}
async function download() {
  $("download-msg").textContent = "";
  const r = await fetch("/api/config?" + query());
  if (!r.ok) { $("download-msg").textContent = (await r.json()).error; $("download-msg").className = "bad"; return; }
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([await r.text()], {type: "application/toml"}));
  a.download = "meshforge-train.toml"; document.body.appendChild(a); a.click(); a.remove();
  $("download-msg").className = "ok"; $("download-msg").textContent = "saved meshforge-train.toml";
}
async function start() {
  P = await getJSON("/api/presets");
  fill($("model"), [...Object.keys(P.models), "custom"]);
  fill($("gpu"), Object.keys(P.gpus));
  fill($("tp"), [1, 2, 4, 8, 16, 32, 64]);
  fill($("schedule"), P.params.schedule.choices);
  fill($("recompute"), P.params.recompute.choices);
  setValues({...BASE, model: P.params.model.default});
  for (const el of fields()) { el.addEventListener("input", changed); el.addEventListener("change", changed); }
  for (const b of document.querySelectorAll("[data-case]"))
    b.onclick = () => { setValues(CASES[b.dataset.case]); update(); updateBest(); };
  $("download").onclick = download;
  update(); updateBest();
}
start().catch((err) => { $("status").textContent = "could not start: " + err.message; });
